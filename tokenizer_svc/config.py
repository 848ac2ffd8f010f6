"""Settings of ``conveyor serve frontend`` (flags and ``CONVEYOR_FRONTEND_*`` environment variables)."""

from __future__ import annotations

from dataclasses import dataclass

from conveyor.config import require, setting

ENV_PREFIX = "CONVEYOR_FRONTEND_"


@dataclass
class FrontendConfig:
    model: str = setting("default", "the model whose tokenizer and chat template to use (as the worker's --model)")
    host: str = setting("127.0.0.1", "address of the public API (0.0.0.0 to accept other machines)")
    port: int = setting(50051, "port of the public API (conveyor.v1.Conveyor)")
    internal_host: str = setting("127.0.0.1", "address of the internal Deliver service")
    internal_port: int = setting(50055, "port of the internal Deliver service")
    advertise: str = setting("", "address the detokenizer uses to reach this frontend (default internal host:port)")
    scheduler: str = setting("127.0.0.1:50052", "address of the scheduler")
    redis_url: str = setting("redis://127.0.0.1:6379/0", "Redis holding request state")
    redis_prefix: str = setting("conveyor", "prefix of every Redis key")
    max_stop_strings: int = setting(16, "most stop strings per request")
    max_streams: int = setting(512, "most client streams this frontend serves at once (threads)")
    metrics_host: str = setting("127.0.0.1", "address of the Prometheus /metrics endpoint (0.0.0.0 for a scraper elsewhere)")
    metrics_port: int = setting(9101, "port of the Prometheus /metrics endpoint (0: any free port)")
    log_level: str = setting("INFO", "logging level")

    def __post_init__(self):
        require(0 <= self.port < 65536, "port", f"must be in [0, 65535], got {self.port}")
        require(0 <= self.metrics_port < 65536, "metrics_port", f"must be in [0, 65535], got {self.metrics_port}")
        require(0 <= self.internal_port < 65536, "internal_port", f"must be in [0, 65535], got {self.internal_port}")
        require(self.max_stop_strings >= 0, "max_stop_strings", "must be >= 0")
        require(self.max_streams >= 1, "max_streams", "must be >= 1")

    @property
    def deliver_address(self) -> str:
        return self.advertise or f"{self.internal_host}:{self.internal_port}"
