"""Settings of ``conveyor serve detokenizer`` (flags and ``CONVEYOR_DETOKENIZER_*`` environment variables)."""

from __future__ import annotations

from dataclasses import dataclass

from conveyor.config import require, setting

ENV_PREFIX = "CONVEYOR_DETOKENIZER_"


@dataclass
class DetokenizerConfig:
    model: str = setting("default", "the model whose tokenizer to use (as the worker's --model)")
    host: str = setting("127.0.0.1", "address to listen on (internal service: localhost by default)")
    port: int = setting(50054, "gRPC port")
    link_port: int = setting(0, "port of the link schedulers send each step's tokens on (0: a free one; the "
                                "detokenizer's Link call names it)")
    redis_url: str = setting("redis://127.0.0.1:6379/0", "Redis holding request state", secret=True)
    redis_prefix: str = setting("conveyor", "prefix of every Redis key")
    orphan_timeout: float = setting(30.0, "seconds a request may have no frontend holding its client stream (its "
                                    "frontend died or lost it) before it is aborted; a client may resume meanwhile")
    metrics_host: str = setting("127.0.0.1", "address of the Prometheus /metrics endpoint (0.0.0.0 for a scraper elsewhere)")
    metrics_port: int = setting(9104, "port of the Prometheus /metrics endpoint (0: any free port)")
    log_level: str = setting("INFO", "logging level")

    def __post_init__(self):
        require(0 <= self.port < 65536, "port", f"must be in [0, 65535], got {self.port}")
        require(0 <= self.link_port < 65536, "link_port", f"must be in [0, 65535], got {self.link_port}")
        require(self.orphan_timeout >= 0, "orphan_timeout", f"must be >= 0, got {self.orphan_timeout}")
        require(0 <= self.metrics_port < 65536, "metrics_port", f"must be in [0, 65535], got {self.metrics_port}")
