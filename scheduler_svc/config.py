"""Settings of ``conveyor serve scheduler`` (flags and ``CONVEYOR_SCHEDULER_*`` environment variables)."""

from __future__ import annotations

from dataclasses import dataclass

from conveyor.config import require, setting

ENV_PREFIX = "CONVEYOR_SCHEDULER_"


@dataclass
class SchedulerConfig:
    host: str = setting("127.0.0.1", "address to listen on (internal service: localhost by default)")
    port: int = setting(50052, "gRPC port")
    engine: str = setting("engine-0", "this engine's name (a scheduler and its worker), unique among the engines "
                                      "sharing a Redis; a scheduler restarted with the same name takes back its requests")
    advertise: str = setting("", "address the frontends and the detokenizer reach this scheduler at "
                                 "(default: 127.0.0.1:PORT, or HOST:PORT when --host names one)")
    engine_ttl: float = setting(3.0, "seconds this engine stays registered without a heartbeat: after it, another "
                                     "engine takes its requests over (its lease on them)")
    worker: str = setting("127.0.0.1:50053", "address of the worker")
    detokenizer: str = setting("127.0.0.1:50054", "address of the detokenizer")
    redis_url: str = setting("redis://127.0.0.1:6379/0", "Redis holding request state", secret=True)
    redis_prefix: str = setting("conveyor", "prefix of every Redis key")
    finished_ttl: float = setting(600.0, "seconds a finished request's record stays in Redis")
    max_num_batched_tokens: int = setting(0, "tokens one step may compute (0: 512 on a CPU worker, 8192 on a GPU)")
    max_num_seqs: int = setting(0, "most requests running at once (0: 64 on a CPU worker, 256 on a GPU)")
    max_waiting: int = setting(1024, "most requests waiting; beyond it Submit returns RESOURCE_EXHAUSTED")
    step_timeout: float = setting(120.0, "seconds the worker may take to answer a step before it is declared dead "
                                         "and its requests are requeued (0: wait forever)")
    prefix_cache: bool = setting(True, "reuse the KV of full blocks a request shares with earlier ones (same "
                                       "tokens from the start); --no-prefix-cache computes every prompt whole")
    speculative: str = setting("off", "speculative decoding: 'ngram' lets each decode draft tokens from what followed "
                                      "its last tokens earlier in the sequence (prompt lookup), verified in the same "
                                      "step (the output is the same as without); 'off'", choices=("ngram", "off"))
    spec_tokens: int = setting(4, "speculation: the most tokens a decode drafts")
    spec_max_batch: int = setting(8, "speculation: no drafting in a step with more running requests (a verify row "
                                     "then costs more than it saves)")
    max_step_failures: int = setting(3, "failed worker steps a request may cause (found by running it alone) "
                                        "before it ends with an error, so that the others go on")
    metrics_host: str = setting("127.0.0.1", "address of the Prometheus /metrics endpoint (0.0.0.0 for a scraper elsewhere)")
    metrics_port: int = setting(9102, "port of the Prometheus /metrics endpoint (0: any free port)")
    log_level: str = setting("INFO", "logging level")

    def __post_init__(self):
        require(0 <= self.port < 65536, "port", f"must be in [0, 65535], got {self.port}")
        require(0 <= self.metrics_port < 65536, "metrics_port", f"must be in [0, 65535], got {self.metrics_port}")
        require(self.max_num_batched_tokens >= 0, "max_num_batched_tokens", "must be >= 0")
        require(self.max_num_seqs >= 0, "max_num_seqs", "must be >= 0")
        require(self.max_waiting >= 1, "max_waiting", "must be >= 1")
        require(self.finished_ttl > 0, "finished_ttl", "must be > 0")
        require(self.step_timeout >= 0, "step_timeout", "must be >= 0")
        require(self.max_step_failures >= 1, "max_step_failures", "must be >= 1")
        require(self.speculative in ("ngram", "off"), "speculative", f"must be ngram or off, got {self.speculative!r}")
        require(1 <= self.spec_tokens <= 16, "spec_tokens", f"must be in [1, 16], got {self.spec_tokens}")
        require(self.spec_max_batch >= 1, "spec_max_batch", f"must be >= 1, got {self.spec_max_batch}")
        require(self.engine_ttl >= 0.5, "engine_ttl", "must be >= 0.5")
        require(bool(self.engine) and ":" not in self.engine, "engine", "must be a non-empty name without ':'")

    def advertised(self, port: int) -> str:
        """Where the other processes reach this scheduler (``port``: the one it bound)."""
        if self.advertise:
            return self.advertise
        host = self.host if self.host not in ("0.0.0.0", "::", "[::]", "") else "127.0.0.1"
        return f"{host}:{port}"

    def limits(self, device: str) -> tuple[int, int]:
        """(max_num_batched_tokens, max_num_seqs), filling the 0 = auto values for the worker's device."""
        gpu = device.startswith("cuda")
        return (self.max_num_batched_tokens or (8192 if gpu else 512), self.max_num_seqs or (256 if gpu else 64))
