"""Every Prometheus metric Conveyor exports, in one place (names, help, labels, buckets, process).

Each process serves its own registry on ``--metrics-port`` (``/metrics``): the dashboards in
``deploy/grafana`` and the table in ``docs/metrics.md`` use only the names defined here, and
``tests/test_observability.py`` checks that each one exists on its process. Latency buckets run from
1 ms (GPU inter-token latency) to minutes (CPU prefill of long prompts, queueing under load).
"""

from __future__ import annotations

import gc
import urllib.request
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.parser import text_string_to_metric_families

from conveyor.params import STRUCTURED_KINDS

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                   0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


@dataclass(frozen=True)
class Spec:
    """One Prometheus series: its name, kind, help, the process that exports it and its labels."""

    name: str
    kind: type
    help: str
    process: str  # frontend | scheduler | worker | detokenizer | every
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None
    known: tuple[str, ...] = ()  # values of the one label, exported (at 0) from the start: panels show 0, not "no data"


SPECS = [
    # frontend: what the client sees
    Spec("conveyor_time_to_first_token_seconds", Histogram, "Request arrival at the frontend to its first token "
         "sent to the client.", "frontend", buckets=LATENCY_BUCKETS),
    Spec("conveyor_time_per_output_token_seconds", Histogram, "Per request: (end-to-end - time to first token) / "
         "(output tokens - 1).", "frontend", buckets=LATENCY_BUCKETS),
    Spec("conveyor_inter_token_latency_seconds", Histogram, "Per output token after the first: time since the "
         "previous one reached the client (a delta of k tokens counts k times, each gap/k).", "frontend",
         buckets=LATENCY_BUCKETS),
    Spec("conveyor_e2e_request_latency_seconds", Histogram, "Request arrival to its last delta.", "frontend",
         buckets=LATENCY_BUCKETS),
    Spec("conveyor_request_prompt_tokens", Histogram, "Prompt length of finished requests.", "frontend",
         buckets=TOKEN_BUCKETS),
    Spec("conveyor_request_generation_tokens", Histogram, "Output length of finished requests.", "frontend",
         buckets=TOKEN_BUCKETS),
    Spec("conveyor_prompt_tokens_total", Counter, "Prompt tokens of finished requests.", "frontend"),
    Spec("conveyor_generation_tokens_total", Counter, "Output tokens sent to clients.", "frontend"),
    Spec("conveyor_requests_total", Counter, "Finished requests by finish reason (stop, length, abort, error).",
         "frontend", ("finish_reason",), known=("stop", "length", "abort", "error")),
    Spec("conveyor_requests_rejected_total", Counter, "Requests refused before they ran, by reason "
         "(invalid_argument, resource_exhausted, already_exists, unavailable).", "frontend", ("reason",),
         known=("invalid_argument", "resource_exhausted", "already_exists", "unavailable")),
    Spec("conveyor_client_streams", Gauge, "Client streams open on this frontend.", "frontend"),
    Spec("conveyor_resumed_streams_total", Counter, "Client streams resumed by request id (Resume).", "frontend"),
    Spec("conveyor_stalled_streams_total", Counter, "Client streams found behind Redis and replayed (a delivery "
         "was lost while a process restarted).", "frontend"),
    Spec("conveyor_http_requests_total", Counter, "OpenAI HTTP API requests answered, by route and HTTP status.",
         "frontend", ("route", "status")),
    Spec("conveyor_http_request_seconds", Histogram, "OpenAI HTTP API: request arrival to the response's headers "
         "(a stream's first byte; the whole body for the rest), by route.", "frontend", ("route",),
         buckets=LATENCY_BUCKETS),
    Spec("conveyor_engine_routes_total", Counter, "Requests sent to each engine, by why: prefix (it took the "
         "longest prefix of the prompt before), balance (the least loaded), only (one engine), failover (its "
         "engine was gone).", "frontend", ("engine", "reason")),
    Spec("conveyor_engine_up", Gauge, "Per engine registered in Redis: 1 while it is live and serving (its "
         "scheduler heartbeats, its worker and Redis answer), else 0.", "frontend", ("engine",)),
    # scheduler: queue, cache, steps
    Spec("conveyor_requests_running", Gauge, "Requests in the running set.", "scheduler"),
    Spec("conveyor_requests_waiting", Gauge, "Requests in the waiting queue.", "scheduler"),
    Spec("conveyor_kv_blocks_used", Gauge, "KV cache blocks held by requests.", "scheduler"),
    Spec("conveyor_kv_blocks_total", Gauge, "KV cache blocks of the worker.", "scheduler"),
    Spec("conveyor_kv_cache_usage_ratio", Gauge, "Used / total KV cache blocks (0 to 1).", "scheduler"),
    Spec("conveyor_prefix_cache_queries_total", Counter, "Prompt tokens (with the output so far, for a "
         "recompute) of admitted requests looked up in the prefix cache.", "scheduler"),
    Spec("conveyor_prefix_cache_hits_total", Counter, "Of the tokens looked up, those found in the prefix "
         "cache: their KV was reused, not computed.", "scheduler"),
    Spec("conveyor_prefix_cache_blocks", Gauge, "KV blocks the prefix cache can hand out (held, or free until "
         "evicted).", "scheduler"),
    Spec("conveyor_engine_takeovers_total", Counter, "Requests this engine took over from engines whose lease "
         "in Redis expired (they died), recomputed here from their tokens so far.", "scheduler"),
    Spec("conveyor_queue_time_seconds", Histogram, "Submit to first scheduled (again after a preemption).",
         "scheduler", buckets=LATENCY_BUCKETS),
    Spec("conveyor_prefill_time_seconds", Histogram, "First scheduled to first output token.", "scheduler",
         buckets=LATENCY_BUCKETS),
    Spec("conveyor_decode_time_seconds", Histogram, "First output token to finish.", "scheduler",
         buckets=LATENCY_BUCKETS),
    Spec("conveyor_step_duration_seconds", Histogram, "Engine step, sent to answered, by phase (prefill: only "
         "prompt chunks; decode: only decode tokens; mixed: both).", "scheduler", ("phase",), LATENCY_BUCKETS),
    Spec("conveyor_batch_size", Histogram, "Sequences in one engine step.", "scheduler", buckets=BATCH_BUCKETS),
    Spec("conveyor_batch_tokens", Histogram, "Tokens computed in one engine step.", "scheduler", buckets=TOKEN_BUCKETS),
    Spec("conveyor_preemptions_total", Counter, "Requests preempted (KV freed, recomputed later).", "scheduler"),
    Spec("conveyor_aborts_total", Counter, "Requests aborted (client cancel, disconnect, deadline, Abort).",
         "scheduler"),
    Spec("conveyor_steps_total", Counter, "Engine steps run.", "scheduler"),
    Spec("conveyor_spec_draft_tokens_total", Counter, "Speculation: tokens drafted for the worker to verify.",
         "scheduler"),
    Spec("conveyor_spec_accepted_tokens_total", Counter, "Speculation: drafted tokens the model confirmed (each "
         "emitted without a step of its own).", "scheduler"),
    Spec("conveyor_spec_verify_steps_total", Counter, "Speculation: decodes that verified drafts (tokens confirmed "
         "per verify: conveyor_spec_accepted_tokens_total over this).", "scheduler"),
    Spec("conveyor_spec_verify_cost", Gauge, "Speculation's cost model, measured by the worker at its start-up: the "
         "time of a decode verifying this many drafts over one verifying none.", "scheduler", ("drafts",)),
    Spec("conveyor_spec_skipped_total", Counter, "Speculation: decodes that did not draft, by why: batch (more "
         "running than --spec-max-batch), paused (the request's drafts confirmed too few to pay for their rows), blocks (no free block "
         "for the drafts' room).", "scheduler", ("reason",), known=("batch", "paused", "blocks")),
    Spec("conveyor_worker_up", Gauge, "1 while the worker answers steps, 0 while it is unreachable.", "scheduler"),
    Spec("conveyor_redis_rtt_seconds", Gauge, "Round-trip time of the last Redis ping.", "scheduler"),
    Spec("conveyor_redis_repairs_total", Counter, "Request records rewritten whole because Redis had lost them "
         "(it restarted) or a write failed half way.", "scheduler"),
    # worker
    Spec("conveyor_worker_forward_seconds", Histogram, "Worker compute of one step (forward and sampling).", "worker",
         buckets=LATENCY_BUCKETS),
    Spec("conveyor_worker_tokens_total", Counter, "Tokens the worker computed (prompt chunks and decodes).", "worker"),
    Spec("conveyor_worker_sequences", Gauge, "Sequences the worker holds state for.", "worker"),
    Spec("conveyor_worker_constrained_sequences_total", Counter, "Sequences registered with a constraint "
         "(structured output), by kind; a sequence registered again (preempted, recomputed) counts again.", "worker",
         ("kind",), known=STRUCTURED_KINDS),
    Spec("conveyor_worker_mask_seconds", Histogram, "A step's grammar work (feeding the matchers their new tokens, "
         "filling the masks of what may come next), on its own thread while the forward runs.", "worker",
         buckets=LATENCY_BUCKETS),
    Spec("conveyor_worker_constraint_errors_total", Counter, "Sequences ended because their constraint allowed no "
         "token or refused their output (the request ends with an error, alone).", "worker"),
    # detokenizer
    Spec("conveyor_detokenizer_push_seconds", Histogram, "Handling one step's tokens (decode, stop strings, "
         "delivery to frontends).", "detokenizer", buckets=LATENCY_BUCKETS),
    Spec("conveyor_detokenizer_tokens_total", Counter, "Tokens turned into text.", "detokenizer"),
    Spec("conveyor_stop_string_matches_total", Counter, "Requests ended by a stop string.", "detokenizer"),
    Spec("conveyor_replays_total", Counter, "Requests whose text was rebuilt from Redis and delivered again (a "
         "frontend found its stream behind Redis, or a client resumed).", "detokenizer"),
    Spec("conveyor_orphan_aborts_total", Counter, "Requests aborted because no frontend held their client stream "
         "for --orphan-timeout seconds.", "detokenizer"),
    # every process
    Spec("conveyor_grpc_errors_total", Counter, "gRPC calls answered with an error, by method and status code.",
         "every", ("method", "code")),
    Spec("conveyor_process_up", Gauge, "1 while the process serves (its health is SERVING).", "every"),
    Spec("conveyor_gc_frozen_objects", Gauge, "Objects the process moved out of the garbage collector's sight before "
         "serving (gc.freeze of what its imports made): a full collection does not walk them.", "every"),
]
BY_NAME = {s.name: s for s in SPECS}


class Metrics:
    """One process's metrics: ``m.get("conveyor_batch_size").observe(8)`` or attribute style ``m.batch_size``."""

    def __init__(self, process: str):
        self.process = process
        self.registry = CollectorRegistry(auto_describe=True)
        self._metrics = {}
        for spec in SPECS:
            if spec.process not in (process, "every"):
                continue
            kwargs = {"buckets": spec.buckets} if spec.buckets else {}
            name = spec.name.removesuffix("_total") if spec.kind is Counter else spec.name
            self._metrics[spec.name] = metric = spec.kind(name, spec.help, spec.labels, registry=self.registry, **kwargs)
            for value in spec.known:
                metric.labels(value)
        if "conveyor_gc_frozen_objects" in self._metrics:
            self._metrics["conveyor_gc_frozen_objects"].set_function(gc.get_freeze_count)

    def get(self, name: str):
        return self._metrics[name]

    def __getattr__(self, short: str):
        """Found once, then an attribute like any other (some are reached once per token)."""
        metrics = self.__dict__["_metrics"]
        for name in (f"conveyor_{short}", f"conveyor_{short}_total"):
            if name in metrics:
                self.__dict__[short] = metrics[name]
                return metrics[name]
        raise AttributeError(f"{self.process} has no metric conveyor_{short}")

    def serve(self, port: int, host: str = "0.0.0.0") -> int:
        """Serve ``/metrics`` on ``port`` (0: a free one); returns the port, or 0 when ``port`` is None."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return server.server_port


def names_for(process: str) -> list[str]:
    """The names of the series ``process`` exports."""
    return [s.name for s in SPECS if s.process in (process, "every")]


def markdown_table() -> str:
    """The table in docs/metrics.md (``python -m conveyor.metrics > docs/metrics.md`` rewrites it)."""
    kinds = {Histogram: "histogram", Counter: "counter", Gauge: "gauge"}
    lines = [
        "# Metrics",
        "",
        "Every process serves Prometheus metrics on its own `--metrics-port` (frontend 9101, scheduler 9102,",
        "worker 9103, detokenizer 9104). Generated from `conveyor/metrics.py` by `python -m conveyor.metrics`;",
        "a test fails when this file and the code disagree.",
        "",
        "| name | type | process | labels | meaning |",
        "| --- | --- | --- | --- | --- |",
    ]
    for s in SPECS:
        labels = ", ".join(s.labels) or "-"
        lines.append(f"| `{s.name}` | {kinds[s.kind]} | {s.process} | {labels} | {s.help} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")


def scrape(address: str) -> dict[str, list]:
    """Sample name -> [(labels, value)] from a /metrics endpoint."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, []).append((s.labels, s.value))
    return samples


def value(samples: dict, name: str, **labels) -> float:
    """The sum of ``name``'s samples (of ``scrape``) whose labels include ``labels``."""
    return sum(v for lab, v in samples.get(name, []) if all(lab.get(k) == x for k, x in labels.items()))
