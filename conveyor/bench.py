"""``conveyor bench``: a serving benchmark against a running stack (through the SDK) or any server with
the OpenAI completions API (llama.cpp's llama-server, vLLM, SGLang, TGI), with the same prompts and
percentiles, so that they can be compared side by side (``bench/side_by_side.py`` does).

    conveyor bench --concurrency 1 8 32 --num-requests 32 --prompt-tokens 128 --max-tokens 64 \\
        --json bench.json --plot bench.png
    conveyor bench --rate 0.5 1 2 --num-requests 40          # Poisson arrivals, requests/s
    conveyor bench --backend openai --target http://127.0.0.1:8080 --concurrency 1 8

Each level sends ``--num-requests`` requests (after ``--warmup`` untimed ones): either ``c`` at a
time (fixed concurrency) or arriving as a Poisson process at a rate. Prompts are exactly
``--prompt-tokens`` tokens (random single-token words, drawn with ``--seed``, checked with the
server's Tokenize, or with ``--model``'s tokenizer for an OpenAI server) and outputs exactly
``--max-tokens`` (``ignore_eos``; an OpenAI server streams one token per event). Reported per level:
requests/s, output tokens/s, TTFT / TPOT / ITL / end-to-end at p50 / p90 / p99, and failures.
"""

from __future__ import annotations

import http.client
import json
import random
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from urllib.parse import urlsplit

from conveyor.client import Client
from conveyor.config import require, setting
from conveyor.errors import ConveyorError

ENV_PREFIX = "CONVEYOR_BENCH_"
WORDS = ("the cat dog sun sea sky red blue tree book road home time day way man car city house water light "
         "green small big old new good long high hand part eye place work world life school game river stone").split()


@dataclass
class BenchConfig:
    """Settings of ``conveyor bench`` (flags and ``CONVEYOR_BENCH_*`` environment variables)."""

    target: str = setting("127.0.0.1:50051", "the frontend's address (--backend openai: the server's base URL)")
    backend: str = setting("conveyor", "conveyor: the gRPC API through the SDK; openai: POST /v1/completions with "
                                       "stream=true (llama-server, vLLM, ...)", choices=("conveyor", "openai"))
    model: str = setting("default", "--backend openai: the model whose tokenizer makes the exact-length prompts "
                                    "(a --model value); the server's own model id (from /v1/models) is sent as the model")
    api_key: str = setting("", "API key of the server (prefer the environment variable)", secret=True)
    ca_cert: str = setting("", "PEM CA that signed the server's certificate (TLS)")
    concurrency: list[int] = setting(None, "fixed-concurrency levels to sweep (default: 1 8 32 unless --rate)", nargs="+")
    rate: list[float] = setting(None, "Poisson arrival rates to sweep, in requests/s (instead of --concurrency)",
                                nargs="+")
    num_requests: int = setting(32, "timed requests per level")
    prompt_tokens: int = setting(128, "prompt length in tokens (exact)")
    max_tokens: int = setting(64, "output length in tokens (exact: ignore_eos)")
    seed: int = setting(0, "seed of the prompts and of the arrival times")
    warmup: int = setting(2, "untimed requests before each level")
    timeout: float = setting(600.0, "deadline of each request, in seconds")
    json: str = setting("", "write the results (summaries and every request) to this JSON file")
    plot: str = setting("", "draw latency distributions and throughput over time to this PNG file")

    def __post_init__(self):
        require(self.num_requests >= 1, "num_requests", "must be >= 1")
        require(self.prompt_tokens >= 1 and self.max_tokens >= 1, "prompt_tokens", "and --max-tokens must be >= 1")
        require(not (self.rate and self.concurrency), "rate", "and --concurrency cannot be combined")
        require(all(r > 0 for r in self.rate or []), "rate", "must be > 0")
        require(all(c >= 1 for c in self.concurrency or []), "concurrency", "must be >= 1")
        if not self.rate and not self.concurrency:
            self.concurrency = [1, 8, 32]


@dataclass
class RequestResult:
    """One request's timings in a level, in seconds since the level started."""

    start: float  # seconds since the level started
    ttft: float | None = None
    token_times: list[float] = field(default_factory=list)  # arrival of each output token, since start
    end: float | None = None
    output_tokens: int = 0
    prompt_tokens: int = 0  # as asked (prompts are made to be exactly this long)
    error: str | None = None

    @property
    def e2e(self) -> float | None:
        return None if self.end is None else self.end - self.start

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


class ConveyorBackend:
    """Conveyor's gRPC API through the SDK."""

    def __init__(self, client: Client, cfg: BenchConfig):
        self.client, self.cfg = client, cfg
        info = client.server_info()
        self.description = f"{info.model_name} on {info.worker} at {cfg.target}"

    def tokenize(self, text: str) -> list[int]:
        return self.client.tokenize(text)

    def stream(self, prompt: str, max_tokens: int) -> Iterator[int]:
        """Streams one request; yields the number of output tokens in each piece that arrives."""
        for delta in self.client.stream(prompt, max_tokens=max_tokens, ignore_eos=True, temperature=0.0,
                                        timeout=self.cfg.timeout):
            yield len(delta.token_ids)


class OpenAIBackend:
    """POST ``/v1/completions`` with ``stream: true`` (server-sent events), greedy, ``ignore_eos``, prompt
    cache off where the server has one (llama-server's ``cache_prompt``), ``model`` the id the server
    lists. Each event counts as one token, as llama-server and vLLM mostly stream them; the usage chunk
    at the end adds any tokens an event carried more. Plain HTTP with the standard library: one
    connection a request."""

    def __init__(self, cfg: BenchConfig):
        from conveyor.model_files import resolve_model
        from conveyor.tokenizer import load_tokenizer

        self.cfg = cfg
        url = urlsplit(cfg.target if "://" in cfg.target else f"http://{cfg.target}")
        self.host, self.port, self.scheme = url.hostname, url.port, url.scheme
        self.tokenizer = load_tokenizer(cfg.model)
        self.model = self._served_model() or resolve_model(cfg.model).path.name
        self.description = f"{self.model} at {cfg.target} (OpenAI completions API)"

    def _connection(self) -> http.client.HTTPConnection:
        kind = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        return kind(self.host, self.port, timeout=self.cfg.timeout)

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.cfg.api_key:
            headers["Authorization"] = f"Bearer {self.cfg.api_key}"
        return headers

    def _served_model(self) -> str | None:
        """The id the server lists first on ``/v1/models`` (servers that check ``model`` want theirs)."""
        conn = self._connection()
        try:
            conn.request("GET", "/v1/models", headers=self._headers())
            response = conn.getresponse()
            models = json.loads(response.read()) if response.status == 200 else {}
            return (models.get("data") or [{}])[0].get("id")
        except (OSError, http.client.HTTPException, ValueError, AttributeError):
            return None
        finally:
            conn.close()

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def stream(self, prompt: str, max_tokens: int) -> Iterator[int]:
        """Stream one completion; yields the count of output tokens each event brings."""
        body = json.dumps({"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                           "stream": True, "ignore_eos": True, "cache_prompt": False,
                           "stream_options": {"include_usage": True}})
        conn = self._connection()
        seen = 0
        try:
            conn.request("POST", "/v1/completions", body, self._headers())
            response = conn.getresponse()
            if response.status != 200:
                raise ConveyorError(f"HTTP {response.status}: {response.read(500).decode(errors='replace')}")
            for line in response:
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    return
                event = json.loads(data)
                if event.get("choices"):
                    seen += 1
                    yield 1
                elif event.get("usage"):  # an event may carry several tokens (text held back): count them all
                    missing = event["usage"].get("completion_tokens", seen) - seen
                    if missing > 0:
                        yield missing
        except (OSError, http.client.HTTPException, ValueError) as exc:
            raise ConveyorError(f"{type(exc).__name__}: {exc}") from exc
        finally:
            conn.close()


_NAMES = ["Alice", "Bruno", "Chen", "Dana", "Emeka", "Farah", "Goran", "Hana", "Ivan", "Jun", "Kofi", "Lena"]
_CITIES = ["Lisbon", "Osaka", "Lagos", "Quito", "Oslo", "Hanoi", "Tunis", "Perth", "Lyon", "Cusco"]
_TOPICS = ["volcanoes", "the history of tea", "how bicycles stay upright", "octopuses", "the moon landing",
           "jazz", "bread baking", "glaciers", "chess openings", "honeybees", "the printing press", "comets"]
_SENTENCES = [
    "The river rose after three days of rain, and the village moved its market to the hill.",
    "A small bakery on the corner sells rye bread every morning before the sun comes up.",
    "The committee voted to repair the old bridge instead of building a new one downstream.",
    "Every winter the lake freezes thick enough for the children to skate across it.",
    "The library extended its opening hours so that students could study late in the evening.",
    "Two engineers rebuilt the clock tower's gears by hand over the course of a summer.",
    "The orchard lost half its apples to an early frost, but the pears survived.",
    "A new train line now links the harbour with the airport in under twenty minutes.",
]


def _passage(rng: random.Random, sentences: int) -> str:
    return " ".join(rng.sample(_SENTENCES, sentences))


def _code(rng: random.Random) -> str:
    name, a, b = rng.choice(["add", "scale", "blend", "shift"]), rng.randint(2, 9), rng.randint(2, 9)
    return (f"def {name}(values):\n    x = 0\n    for v in values:\n        x = x + v * {a}\n"
            f"    if x > {b * 10}:\n        x = x - {b}\n    return x\n")


def speculation_prompts(per_kind: int, seed: int = 0) -> dict[str, list[str]]:
    """Speculation's workload (``bench/speculative.py``, ``tests/test_speculative.py``): ``per_kind`` prompts of each
    kind, from output that repeats its input most to least: repeat a passage, summarize one, edit a piece of code,
    extract JSON from a sentence, free chat. The same ones for the same ``seed``."""
    rng = random.Random(seed)
    return {
        "repeat": [f"Repeat this text exactly, word for word:\n\n{_passage(rng, 2)}" for _ in range(per_kind)],
        "summarize": [f"Summarize this in two sentences:\n\n{_passage(rng, 5)}" for _ in range(per_kind)],
        "code edit": [f"Rename the variable x to total in this function and show the whole function:\n\n{_code(rng)}"
                      for _ in range(per_kind)],
        "json": [f"Extract the person's name, age and city as JSON with keys name, age and city: "
                 f"{rng.choice(_NAMES)} is {rng.randint(18, 90)} years old and lives in {rng.choice(_CITIES)}."
                 for _ in range(per_kind)],
        "free chat": [f"Tell me something interesting about {rng.choice(_TOPICS)}." for _ in range(per_kind)],
    }


def make_prompts(client, count: int, tokens: int, seed: int) -> list[str]:
    """``count`` prompts of exactly ``tokens`` tokens: random words that are one token each."""
    rng = random.Random(seed)
    single = [w for w in WORDS if len(client.tokenize(" " + w)) == 1]
    if not single:
        raise RuntimeError("no single-token words for this tokenizer")
    prompts = []
    for _ in range(count):
        text = "".join(" " + rng.choice(single) for _ in range(tokens))
        ids = client.tokenize(text)
        while len(ids) > tokens:  # a tokenizer that merges neighbours: trim until exact
            text = text[: text.rfind(" ")]
            ids = client.tokenize(text)
        while len(ids) < tokens:
            text += " " + rng.choice(single)
            ids = client.tokenize(text)
        prompts.append(text)
    return prompts


def one_request(backend, prompt: str, cfg: BenchConfig, level_start: float) -> RequestResult:
    """Send one request through ``backend`` and time its tokens (an error is recorded, not raised)."""
    result = RequestResult(start=time.perf_counter() - level_start, prompt_tokens=cfg.prompt_tokens)
    try:
        for count in backend.stream(prompt, cfg.max_tokens):  # the level's length, not the one the backend was made with
            now = time.perf_counter() - level_start
            if count and result.ttft is None:
                result.ttft = now - result.start
            result.token_times += [now] * count
            result.output_tokens += count
        result.end = time.perf_counter() - level_start
    except ConveyorError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


class Progress:
    """A one-line progress bar on stderr."""

    def __init__(self, label: str, total: int):
        self.label, self.total, self.done = label, total, 0
        self.lock = threading.Lock()
        self._draw()

    def tick(self) -> None:
        with self.lock:
            self.done += 1
            self._draw()

    def _draw(self) -> None:
        width = 30
        filled = width * self.done // self.total
        sys.stderr.write(f"\r{self.label:>16} [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total}")
        if self.done == self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def run_level(backend, prompts: list[str], cfg: BenchConfig, concurrency: int | None = None,
              rate: float | None = None) -> tuple[list[RequestResult], float]:
    """All requests of one level; returns the results and the level's wall time."""
    label = f"concurrency {concurrency}" if rate is None else f"rate {rate:g}/s"
    for prompt in prompts[: cfg.warmup]:
        one_request(backend, prompt, cfg, time.perf_counter())
    timed = prompts[cfg.warmup :]
    progress = Progress(label, len(timed))
    start = time.perf_counter()

    def job(prompt: str) -> RequestResult:
        result = one_request(backend, prompt, cfg, start)
        progress.tick()
        return result

    if rate is None:
        with ThreadPoolExecutor(concurrency) as pool:
            results = list(pool.map(job, timed))
    else:
        rng = random.Random(cfg.seed)
        with ThreadPoolExecutor(min(256, len(timed))) as pool:
            futures, at = [], 0.0
            for prompt in timed:
                at += rng.expovariate(rate)
                time.sleep(max(0.0, at - (time.perf_counter() - start)))
                futures.append(pool.submit(job, prompt))
            results = [f.result() for f in futures]
    return results, time.perf_counter() - start


def percentiles(values: list[float]) -> dict[str, float | None]:
    """p50, p90 and p99 of ``values`` (None each when there are none)."""
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    if len(values) == 1:
        return {"p50": values[0], "p90": values[0], "p99": values[0]}
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return {"p50": cuts[49], "p90": cuts[89], "p99": cuts[98]}


def summarize(results: list[RequestResult], wall: float) -> dict:
    """A level's throughput and latency percentiles over its successful requests."""
    ok = [r for r in results if r.error is None]
    itl = [b - a for r in ok for a, b in zip(r.token_times, r.token_times[1:])]
    return {
        "requests": len(results), "failures": len(results) - len(ok), "wall_seconds": wall,
        "requests_per_second": len(ok) / wall, "output_tokens_per_second": sum(r.output_tokens for r in ok) / wall,
        "ttft": percentiles([r.ttft for r in ok if r.ttft is not None]),
        "tpot": percentiles([r.tpot for r in ok if r.tpot is not None]),
        "itl": percentiles(itl),
        "e2e": percentiles([r.e2e for r in ok]),
    }


def print_table(levels: list[tuple[str, dict]]) -> None:
    """The levels as one table on stdout (latencies in milliseconds)."""
    def ms(value):
        return f"{value * 1000:8.1f}" if value is not None else f"{'-':>8}"

    head = f"{'level':>16}{'req/s':>8}{'out tok/s':>11}{'fail':>6}"
    for metric in ("TTFT", "TPOT", "ITL", "E2E"):
        head += "".join(f"{metric + ' ' + q:>9}" for q in ("p50", "p90", "p99"))
    print(head + "   (latencies in ms)")
    for label, s in levels:
        row = f"{label:>16}{s['requests_per_second']:8.2f}{s['output_tokens_per_second']:11.1f}{s['failures']:6d}"
        for metric in ("ttft", "tpot", "itl", "e2e"):
            row += "".join(f"{ms(s[metric][q]):>9}" for q in ("p50", "p90", "p99"))
        print(row)


def plot(levels: list[tuple[str, list[RequestResult]]], path: str) -> None:
    """A PNG at ``path``: each level's token arrivals and its latency percentiles."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(16, 9))
    panels = [("time to first token (s)", lambda rs: [r.ttft for r in rs if r.ttft is not None]),
              ("time per output token (s)", lambda rs: [r.tpot for r in rs if r.tpot is not None]),
              ("inter-token latency (s)", lambda rs: [b - a for r in rs for a, b in zip(r.token_times, r.token_times[1:])]),
              ("end-to-end latency (s)", lambda rs: [r.e2e for r in rs if r.e2e is not None])]
    for ax, (title, pick) in zip(axes.flat, panels):
        for label, results in levels:
            values = sorted(pick([r for r in results if r.error is None]))
            if values:
                ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=label)
        ax.set_title(title + ": cumulative share")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax = axes.flat[4]
    for label, results in levels:
        times = sorted(t for r in results for t in r.token_times)
        if times:
            buckets = [0] * (int(times[-1]) + 1)
            for t in times:
                buckets[int(t)] += 1
            ax.plot(range(len(buckets)), buckets, label=label)
    ax.set_title("output tokens / s over time")
    ax.set_xlabel("seconds since the level started")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    axes.flat[5].axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def sweep(backend, cfg: BenchConfig) -> list[tuple[str, list[RequestResult], float]]:
    """Every level of ``cfg`` against ``backend``: (label, results, wall seconds)."""
    print(f"{backend.description}: prompts {cfg.prompt_tokens} tokens, outputs {cfg.max_tokens} tokens, "
          f"{cfg.num_requests} requests per level (+{cfg.warmup} warm-up), seed {cfg.seed}", flush=True)
    prompts = make_prompts(backend, cfg.num_requests + cfg.warmup, cfg.prompt_tokens, cfg.seed)
    levels: list[tuple[str, list[RequestResult], float]] = []
    for c in cfg.concurrency or []:
        results, wall = run_level(backend, prompts, cfg, concurrency=c)
        levels.append((f"concurrency {c}", results, wall))
    for r in cfg.rate or []:
        results, wall = run_level(backend, prompts, cfg, rate=r)
        levels.append((f"rate {r:g}/s", results, wall))
    return levels


def run(cfg: BenchConfig) -> int:
    """``conveyor bench``: sweep the levels, print the table (and write the JSON and plot asked for); returns the
    exit status."""
    if cfg.backend == "openai":
        backend = OpenAIBackend(cfg)
        model = backend.model
        levels = sweep(backend, cfg)
    else:
        with Client(cfg.target, timeout=cfg.timeout, api_key=cfg.api_key or None, ca_cert=cfg.ca_cert or None) as client:
            backend = ConveyorBackend(client, cfg)
            model = backend.description
            levels = sweep(backend, cfg)
    summaries = [(label, summarize(results, wall)) for label, results, wall in levels]
    print_table(summaries)
    if cfg.json:
        with open(cfg.json, "w") as f:
            json.dump({"config": asdict(cfg), "model": model,
                       "levels": [{"level": label, "summary": s, "requests": [asdict(r) for r in results]}
                                  for (label, s), (_, results, _) in zip(summaries, levels)]}, f, indent=1)
        print(f"results: {cfg.json}")
    if cfg.plot:
        plot([(label, results) for label, results, _ in levels], cfg.plot)
        print(f"plot: {cfg.plot}")
    return 1 if any(s["failures"] for _, s in summaries) else 0
