"""Writes the Grafana dashboards in deploy/grafana/dashboards/ and their copy for the Kubernetes ConfigMap in
deploy/kubernetes/base/dashboards/ (``python deploy/grafana/make_dashboards.py``).

The JSON is generated so that every panel is built the same way and only names from
``conveyor/metrics.py`` appear; ``tests/test_observability.py`` checks the files are up to date and
evaluates every query against a real Prometheus scraping a running stack.
"""

from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).resolve().parent / "dashboards"
KUBERNETES_COPY = Path(__file__).resolve().parent.parent / "kubernetes" / "base" / "dashboards"  # kustomize reads only below its root
RATE = "$__rate_interval"
DATASOURCE = {"type": "prometheus", "uid": "prometheus"}


def quantiles(metric: str, by: str = "", qs=(0.5, 0.9, 0.99)) -> list[tuple[str, str]]:
    """(legend, expr) per quantile of a histogram."""
    group = f"le{', ' + by if by else ''}"
    label = f" {{{{{by}}}}}" if by else ""
    return [(f"p{int(q * 100)}{label}",
             f"histogram_quantile({q}, sum by ({group}) (rate({metric}_bucket[{RATE}])))") for q in qs]


def panel(title: str, targets: list[tuple[str, str]], unit: str = "short", kind: str = "timeseries",
          description: str = "") -> dict:
    return {
        "type": kind, "title": title, "description": description, "datasource": DATASOURCE,
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
        "targets": [{"refId": chr(65 + i), "expr": expr, "legendFormat": legend, "datasource": DATASOURCE}
                    for i, (legend, expr) in enumerate(targets)],
    }


def dashboard(uid: str, title: str, panels: list[dict]) -> dict:
    for i, p in enumerate(panels):  # two panels per row, 8 units high
        p["id"] = i + 1
        p["gridPos"] = {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)}
    return {
        "uid": uid, "title": title, "tags": ["conveyor"], "timezone": "browser", "schemaVersion": 39,
        "version": 1, "refresh": "10s", "time": {"from": "now-30m", "to": "now"}, "panels": panels,
        "templating": {"list": []}, "annotations": {"list": []},
    }


def overview() -> dict:
    return dashboard("conveyor-overview", "Conveyor / Overview", [
        panel("Requests finished / s", [("{{finish_reason}}",
              f"sum by (finish_reason) (rate(conveyor_requests_total[{RATE}]))")], "reqps"),
        panel("Tokens / s", [("prompt (in)", f"sum(rate(conveyor_prompt_tokens_total[{RATE}]))"),
                             ("generated (out)", f"sum(rate(conveyor_generation_tokens_total[{RATE}]))")]),
        panel("Time to first token", quantiles("conveyor_time_to_first_token_seconds"), "s"),
        panel("Time per output token", quantiles("conveyor_time_per_output_token_seconds"), "s"),
        panel("Inter-token latency", quantiles("conveyor_inter_token_latency_seconds"), "s"),
        panel("End-to-end latency", quantiles("conveyor_e2e_request_latency_seconds"), "s"),
        panel("Errors / s", [("{{code}}", f"sum by (code) (rate(conveyor_grpc_errors_total[{RATE}]))"),
                             ("rejected: {{reason}}",
                              f"sum by (reason) (rate(conveyor_requests_rejected_total[{RATE}]))")], "reqps"),
        panel("Open client streams", [("{{instance}}", "sum by (instance) (conveyor_client_streams)")]),
        panel("HTTP API requests / s", [("{{route}} {{status}}",
              f"sum by (route, status) (rate(conveyor_http_requests_total[{RATE}]))")], "reqps"),
        panel("HTTP API latency (to the headers)", quantiles("conveyor_http_request_seconds", by="route",
                                                             qs=(0.5, 0.99)), "s"),
        panel("Engines up (live and serving)", [("{{engine}}", "max by (engine) (conveyor_engine_up)")]),
        panel("Requests routed to engines / s", [("{{engine}} {{reason}}",
              f"sum by (engine, reason) (rate(conveyor_engine_routes_total[{RATE}]))")], "reqps"),
    ])


def scheduler() -> dict:
    return dashboard("conveyor-scheduler", "Conveyor / Scheduler", [
        panel("Requests running and waiting, per engine", [
            ("running {{instance}}", "sum by (instance) (conveyor_requests_running)"),
            ("waiting {{instance}}", "sum by (instance) (conveyor_requests_waiting)")]),
        panel("Requests taken over from dead engines", [
            ("{{instance}}", f"sum by (instance) (increase(conveyor_engine_takeovers_total[{RATE}]))")]),
        panel("KV cache usage", [("used / total", "max(conveyor_kv_cache_usage_ratio)")], "percentunit"),
        panel("KV blocks", [("used", "sum(conveyor_kv_blocks_used)"), ("total", "sum(conveyor_kv_blocks_total)")]),
        panel("Preemptions and aborts / s", [("preemptions", f"sum(rate(conveyor_preemptions_total[{RATE}]))"),
                                             ("aborts", f"sum(rate(conveyor_aborts_total[{RATE}]))")], "ops"),
        panel("Batch size (sequences per step)", quantiles("conveyor_batch_size", qs=(0.5, 0.9))),
        panel("Tokens per step", quantiles("conveyor_batch_tokens", qs=(0.5, 0.9))),
        panel("Step time by phase", quantiles("conveyor_step_duration_seconds", by="phase", qs=(0.5, 0.9)), "s"),
        panel("Steps / s", [("steps", f"sum(rate(conveyor_steps_total[{RATE}]))")], "ops"),
        panel("Queue time", quantiles("conveyor_queue_time_seconds"), "s"),
        panel("Prefix cache hit rate (tokens found / looked up)",
              [("hit rate", f"sum(rate(conveyor_prefix_cache_hits_total[{RATE}])) / "
                            f"sum(rate(conveyor_prefix_cache_queries_total[{RATE}]))")], "percentunit"),
        panel("Prefix cache tokens / s and cached blocks",
              [("looked up / s", f"sum(rate(conveyor_prefix_cache_queries_total[{RATE}]))"),
               ("found / s", f"sum(rate(conveyor_prefix_cache_hits_total[{RATE}]))"),
               ("cached blocks", "sum(conveyor_prefix_cache_blocks)")]),
        panel("Speculation: tokens drafted and confirmed / s, and the share confirmed",
              [("drafted / s", f"sum(rate(conveyor_spec_draft_tokens_total[{RATE}]))"),
               ("confirmed / s", f"sum(rate(conveyor_spec_accepted_tokens_total[{RATE}]))"),
               ("confirmed share", f"sum(rate(conveyor_spec_accepted_tokens_total[{RATE}])) / "
                                   f"sum(rate(conveyor_spec_draft_tokens_total[{RATE}]))")]),
        panel("Speculation: tokens confirmed per verify step",
              [("confirmed per verify", f"sum(rate(conveyor_spec_accepted_tokens_total[{RATE}])) / "
                                        f"sum(rate(conveyor_spec_verify_steps_total[{RATE}]))")]),
        panel("Speculation: decodes that did not draft / s, by why",
              [("{{reason}}", f"sum by (reason) (rate(conveyor_spec_skipped_total[{RATE}]))")], "ops"),
        panel("Prefill and decode time", quantiles("conveyor_prefill_time_seconds", qs=(0.5, 0.9))
              + [(f"decode {legend}", expr) for legend, expr in quantiles("conveyor_decode_time_seconds", qs=(0.5, 0.9))],
              "s"),
    ])


def health() -> dict:
    return dashboard("conveyor-health", "Conveyor / Health", [
        panel("Processes up", [("{{service}}", "max by (service) (conveyor_process_up)")], kind="stat"),
        panel("Worker reachable (scheduler's view)", [("worker", "max(conveyor_worker_up)")], kind="stat"),
        panel("Redis round trip", [("rtt", "max(conveyor_redis_rtt_seconds)")], "s"),
        panel("gRPC errors by method", [("{{method}} {{code}}",
              f"sum by (method, code) (increase(conveyor_grpc_errors_total[{RATE}]))")]),
        panel("Worker forward time", quantiles("conveyor_worker_forward_seconds", qs=(0.5, 0.9)), "s"),
        panel("Worker tokens / s and sequences held",
              [("tokens / s", f"sum(rate(conveyor_worker_tokens_total[{RATE}]))"),
               ("sequences", "sum(conveyor_worker_sequences)")]),
        panel("Structured output: constrained sequences and constraint errors / s",
              [("{{kind}}", f"sum by (kind) (rate(conveyor_worker_constrained_sequences_total[{RATE}]))"),
               ("constraint errors", f"sum(rate(conveyor_worker_constraint_errors_total[{RATE}]))")], "ops"),
        panel("Structured output: grammar work per step (overlaps the forward)",
              quantiles("conveyor_worker_mask_seconds", qs=(0.5, 0.99)), "s"),
        panel("Detokenizer step handling", quantiles("conveyor_detokenizer_push_seconds", qs=(0.5, 0.9)), "s"),
        panel("Detokenizer tokens / s and stop-string matches",
              [("tokens / s", f"sum(rate(conveyor_detokenizer_tokens_total[{RATE}]))"),
               ("stop strings / s", f"sum(rate(conveyor_stop_string_matches_total[{RATE}]))")]),
        panel("Recovery: records rewritten, replays, resumes",
              [("Redis records repaired", f"sum(increase(conveyor_redis_repairs_total[{RATE}]))"),
               ("streams replayed from Redis", f"sum(increase(conveyor_replays_total[{RATE}]))"),
               ("stalled streams found", f"sum(increase(conveyor_stalled_streams_total[{RATE}]))"),
               ("client streams resumed", f"sum(increase(conveyor_resumed_streams_total[{RATE}]))"),
               ("orphans aborted", f"sum(increase(conveyor_orphan_aborts_total[{RATE}]))")]),
    ])


DASHBOARDS = {"overview.json": overview, "scheduler.json": scheduler, "health.json": health}


def render() -> dict[str, str]:
    return {name: json.dumps(build(), indent=2) + "\n" for name, build in DASHBOARDS.items()}


if __name__ == "__main__":
    for folder in (OUT, KUBERNETES_COPY):
        folder.mkdir(parents=True, exist_ok=True)
        for name, text in render().items():
            (folder / name).write_text(text)
            print(folder / name)
