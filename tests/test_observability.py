"""Metrics on every process, the shipped dashboards against a real Prometheus, and the compose file."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml
from helpers import KV_BLOCK_BYTES, ROOT, free_port, scrape, start_stack, value

from conveyor import metrics as metric_specs
from conveyor.client import Client
from conveyor.errors import InvalidArgument

SERVICES = ("frontend", "scheduler", "worker", "detokenizer")
PROMPTS = ["Name a color.", "What is 3 + 4?", "Say hi in French.", "Name a planet.", "Give me a word."]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = start_stack(tmp_path_factory.mktemp("obs"), kv_cache_bytes=128 << 20)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def traffic(stack):
    """Known traffic: what the client saw, to compare with what the processes counted."""
    seen = []

    def one(prompt: str):
        start_t = time.perf_counter()
        ttft, deltas = None, []
        with Client(stack.endpoint, timeout=120) as c:
            for d in c.stream(messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=12,
                              stop=[" and"]):
                if ttft is None and d.token_ids:
                    ttft = time.perf_counter() - start_t
                deltas.append(d)
        return {"ttft": ttft, "prompt": deltas[-1].prompt_tokens, "completion": deltas[-1].completion_tokens,
                "reason": deltas[-1].finish_reason, "tokens": sum(len(d.token_ids) for d in deltas)}

    with ThreadPoolExecutor(5) as pool:
        seen = list(pool.map(one, PROMPTS))
    with Client(stack.endpoint, timeout=60) as c, pytest.raises(InvalidArgument):
        c.generate("bad", temperature=-1.0)  # one rejection, one gRPC error
    return seen


def test_every_documented_metric_exists_on_its_process(stack, traffic):
    for service in SERVICES:
        samples = scrape(stack.child(service).metrics)
        families = {n.removesuffix("_bucket").removesuffix("_count").removesuffix("_sum").removesuffix("_created")
                    for n in samples}
        for name in metric_specs.names_for(service):
            labelled = metric_specs.BY_NAME[name].labels
            if labelled and name == "conveyor_grpc_errors_total" and service != "frontend":
                continue  # a labelled counter has no series until its first error
            assert name in families or name.removesuffix("_total") in families, f"{name} missing on {service}"


def test_metric_values_agree_with_what_the_client_saw(stack, traffic):
    fe = scrape(stack.child("frontend").metrics)
    assert value(fe, "conveyor_generation_tokens_total") == sum(t["tokens"] for t in traffic)
    assert value(fe, "conveyor_prompt_tokens_total") == sum(t["prompt"] for t in traffic)
    assert value(fe, "conveyor_request_generation_tokens_sum") == sum(t["completion"] for t in traffic)
    for reason in ("stop", "length"):
        assert value(fe, "conveyor_requests_total", finish_reason=reason) == sum(t["reason"] == reason for t in traffic)
    assert value(fe, "conveyor_time_to_first_token_seconds_count") == len(traffic)
    server_ttft = value(fe, "conveyor_time_to_first_token_seconds_sum")
    assert 0 < server_ttft <= sum(t["ttft"] for t in traffic)  # the server's TTFT is inside the client's
    assert value(fe, "conveyor_requests_rejected_total", reason="invalid_argument") == 1
    assert value(fe, "conveyor_grpc_errors_total", code="INVALID_ARGUMENT") == 1
    assert value(fe, "conveyor_process_up") == 1
    sch = scrape(stack.child("scheduler").metrics)
    steps = value(sch, "conveyor_steps_total")
    assert steps > 0 and value(sch, "conveyor_batch_size_count") == steps
    assert value(sch, "conveyor_kv_blocks_total") == (128 << 20) // KV_BLOCK_BYTES
    assert value(sch, "conveyor_requests_running") == 0 and value(sch, "conveyor_kv_blocks_used") == 0
    assert value(sch, "conveyor_queue_time_seconds_count") >= len(traffic)
    assert value(sch, "conveyor_worker_up") == 1
    wk = scrape(stack.child("worker").metrics)
    reused = value(sch, "conveyor_prefix_cache_hits_total")  # prompt tokens the worker did not compute
    assert 0 <= reused <= value(sch, "conveyor_prefix_cache_queries_total")
    assert value(wk, "conveyor_worker_tokens_total") + reused >= sum(t["prompt"] + t["tokens"] for t in traffic) - len(traffic)
    dt = scrape(stack.child("detokenizer").metrics)
    assert value(dt, "conveyor_detokenizer_tokens_total") >= sum(t["tokens"] for t in traffic)
    stopped = sum(t["reason"] == "stop" for t in traffic)
    assert value(dt, "conveyor_stop_string_matches_total") <= stopped
    for samples in (fe, sch, wk, dt):  # each process froze what its imports made (tens of thousands of objects)
        assert value(samples, "conveyor_gc_frozen_objects") > 10_000


def test_labelled_counters_dashboards_query_start_at_zero_for_every_known_label():
    from prometheus_client import generate_latest

    from conveyor.metrics import Metrics

    texts = {}
    for spec in metric_specs.SPECS:
        if spec.known and spec.process not in texts:
            texts[spec.process] = generate_latest(Metrics(spec.process).registry).decode()
        for known in spec.known:
            assert f'{spec.name}{{{spec.labels[0]}="{known}"}} 0.0' in texts[spec.process], (spec.name, known)
    assert any(spec.known for spec in metric_specs.SPECS)


def test_metrics_table_in_docs_is_current():
    assert (ROOT / "docs" / "metrics.md").read_text() == metric_specs.markdown_table()


def test_dashboards_are_current_and_use_only_defined_metrics():
    sys.path.insert(0, str(ROOT / "deploy" / "grafana"))
    import make_dashboards

    defined = {s.name for s in metric_specs.SPECS}
    for name, text in make_dashboards.render().items():
        assert (ROOT / "deploy" / "grafana" / "dashboards" / name).read_text() == text, f"{name} is stale"
        for expr in _exprs(json.loads(text)):
            used = {w for w in expr.replace("(", " ").replace(")", " ").replace("[", " ").split() if w.startswith("conveyor_")}
            used = {u.removesuffix("_bucket") for u in used}
            assert used and used <= defined, f"{name}: {expr} uses {used - defined}"


def _exprs(dashboard: dict) -> list[str]:
    return [t["expr"] for p in dashboard["panels"] for t in p["targets"]]


@pytest.mark.skipif(not shutil.which("prometheus"), reason="needs Debian's prometheus (make test installs it)")
def test_every_dashboard_query_returns_data_from_a_real_prometheus(stack, traffic, tmp_path):
    config = tmp_path / "prometheus"
    shutil.copytree(ROOT / "deploy" / "prometheus", config)
    targets = [{"targets": [stack.child(s).metrics], "labels": {"service": s}} for s in SERVICES]
    (config / "targets" / "conveyor.json").write_text(json.dumps(targets))
    port = free_port()
    proc = subprocess.Popen(["prometheus", f"--config.file={config / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        api = f"http://127.0.0.1:{port}/api/v1"
        _wait_for_targets(api, len(SERVICES))
        with Client(stack.endpoint, timeout=120) as c:  # traffic across several scrapes (5 s apart)
            deadline = time.monotonic() + 16
            while time.monotonic() < deadline:
                c.generate("Count to five.", max_tokens=8, temperature=0.5)
                with pytest.raises(InvalidArgument):
                    c.generate("x", top_p=2.0)
        time.sleep(6)  # one more scrape after the last request
        empty = []
        for name in ("overview.json", "scheduler.json", "health.json"):
            for expr in _exprs(json.loads((ROOT / "deploy" / "grafana" / "dashboards" / name).read_text())):
                query = expr.replace("$__rate_interval", "1m")
                with urllib.request.urlopen(f"{api}/query?{urllib.parse.urlencode({'query': query})}", timeout=10) as r:
                    reply = json.load(r)
                assert reply["status"] == "success", query
                if not reply["data"]["result"]:
                    empty.append(f"{name}: {query}")
        assert not empty, "queries without data:\n" + "\n".join(empty)
    finally:
        proc.terminate()
        proc.wait()


def _wait_for_targets(api: str, count: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{api}/targets", timeout=5) as r:
                active = json.load(r)["data"]["activeTargets"]
            if len([t for t in active if t["health"] == "up"]) == count:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError("Prometheus did not scrape every target")


# ---------------------------------------------------------------- docker-compose


@pytest.mark.skipif(not shutil.which("docker-compose"), reason="needs Debian's docker-compose (make test installs it)")
def test_compose_file_validates():
    for files in (["docker-compose.yml"], ["docker-compose.yml", "docker-compose.gpu.yml"]):
        args = [a for f in files for a in ("-f", f)]
        done = subprocess.run(["docker-compose", *args, "config", "-q"], cwd=ROOT, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr


def test_compose_commands_ports_and_health_checks_match_the_cli():
    from conveyor.cli import build_parser

    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    parser = build_parser()
    addresses = {}
    for name in SERVICES:
        service = compose["services"][name]
        argv = [a.replace("${CONVEYOR_MODEL:-default}", "default") for a in service["command"]]
        args = parser.parse_args(argv)  # every flag exists and parses
        assert args.command == "serve" and args.service == name
        addresses[name] = args.port
        test = service["healthcheck"]["test"]
        assert test[:4] == ["CMD", "python", "-m", "conveyor.healthcheck"]
        assert test[4] == f"127.0.0.1:{args.port}"
        assert test[5] == {"frontend": "conveyor.v1.Conveyor"}.get(name, f"conveyor.v1.{name.capitalize()}")
        assert test[6:] == (["--public"] if name == "frontend" else [])  # internal ports: mutual TLS
        assert args.metrics_host == "0.0.0.0" and args.host == "0.0.0.0"
    frontend = parser.parse_args(compose["services"]["frontend"]["command"])
    scheduler = parser.parse_args(compose["services"]["scheduler"]["command"])
    detok = parser.parse_args([a.replace("${CONVEYOR_MODEL:-default}", "default")
                               for a in compose["services"]["detokenizer"]["command"]])
    assert scheduler.advertise == f"scheduler:{addresses['scheduler']}"  # how the frontend and detokenizer reach it
    assert frontend.detokenizer == f"detokenizer:{addresses['detokenizer']}" and detok.port == addresses["detokenizer"]
    assert scheduler.worker == f"worker:{addresses['worker']}"
    assert scheduler.detokenizer == f"detokenizer:{addresses['detokenizer']}"
    assert frontend.advertise == f"frontend:{frontend.internal_port}"
    assert compose["services"]["frontend"]["ports"] == [f"${{CONVEYOR_PORT:-50051}}:{addresses['frontend']}",
                                                        f"${{CONVEYOR_HTTP_PORT:-8000}}:{frontend.http_port}"]
    scrape_targets = json.loads((ROOT / "deploy" / "prometheus" / "targets" / "conveyor.json").read_text())
    for entry in scrape_targets:
        service = entry["labels"]["service"]
        args = parser.parse_args([a.replace("${CONVEYOR_MODEL:-default}", "default")
                                  for a in compose["services"][service]["command"]])
        assert entry["targets"] == [f"{service}:{args.metrics_port}"]
    assert Path(ROOT / "Dockerfile").read_text().count("ENTRYPOINT") == 1


# ---------------------------------------------------------------- conveyor bench


def test_conveyor_bench_sweeps_and_writes_json_and_a_plot(stack, tmp_path):
    from helpers import conveyor_command

    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    done = subprocess.run(
        conveyor_command("bench", "--target", stack.endpoint, "--concurrency", "1", "4", "--num-requests", "4",
                         "--prompt-tokens", "24", "--max-tokens", "8", "--warmup", "1", "--json", str(out),
                         "--plot", str(png)),
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr
    assert "concurrency 1" in done.stdout and "concurrency 4" in done.stdout and "TTFT p50" in done.stdout
    assert "4/4" in done.stderr  # the progress bar
    report = json.loads(out.read_text())
    assert [level["level"] for level in report["levels"]] == ["concurrency 1", "concurrency 4"]
    for level in report["levels"]:
        assert level["summary"]["failures"] == 0 and level["summary"]["output_tokens_per_second"] > 0
        assert all(r["output_tokens"] == 8 and r["prompt_tokens"] == 24 for r in level["requests"])
        assert level["summary"]["ttft"]["p50"] <= level["summary"]["e2e"]["p50"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rate = subprocess.run(conveyor_command("bench", "--target", stack.endpoint, "--rate", "4", "--num-requests", "3",
                                           "--prompt-tokens", "8", "--max-tokens", "4", "--warmup", "0"),
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert rate.returncode == 0 and "rate 4/s" in rate.stdout
