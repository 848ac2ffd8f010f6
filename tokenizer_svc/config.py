"""Settings of ``conveyor serve frontend`` (flags and ``CONVEYOR_FRONTEND_*`` environment variables)."""

from __future__ import annotations

from dataclasses import dataclass

from conveyor.config import parse_size, require, setting

ENV_PREFIX = "CONVEYOR_FRONTEND_"


@dataclass
class FrontendConfig:
    model: str = setting("default", "the model whose tokenizer and chat template to use (as the worker's --model)")
    host: str = setting("127.0.0.1", "address of the public API (0.0.0.0 to accept other machines)")
    port: int = setting(50051, "port of the public API (conveyor.v1.Conveyor)")
    http_port: int = setting(8000, "port of the OpenAI-compatible HTTP API on --host (-1: off; 0: any free port)")
    internal_host: str = setting("127.0.0.1", "address of the internal service, where the detokenizer delivers "
                                              "deltas")
    internal_port: int = setting(50055, "gRPC port of the internal service (health, and the Link call that names "
                                        "--link-port)")
    link_port: int = setting(0, "port of the link the detokenizer sends deltas on, on --internal-host (0: a free one)")
    advertise: str = setting("", "address the detokenizer uses to reach this frontend (default internal host:port)")
    detokenizer: str = setting("127.0.0.1:50054", "address of the detokenizer (asked to replay a stream from Redis)")
    redis_url: str = setting("redis://127.0.0.1:6379/0", "Redis holding request state", secret=True)
    redis_prefix: str = setting("conveyor", "prefix of every Redis key")
    max_stop_strings: int = setting(16, "most stop strings per request")
    max_stop_token_ids: int = setting(64, "most stop token ids per request (each is checked on every token)")
    max_logit_bias: int = setting(300, "most logit_bias entries per request (applied on every token)")
    max_grammar_bytes: int = setting(64 << 10, "largest structured-output spec (JSON schema, regex, grammar), in bytes")
    max_prompt_tokens: int = setting(0, "most prompt tokens per request (0: the model's max length - 1)")
    max_message_bytes: int = setting(4 << 20, "largest request message in bytes (beyond: RESOURCE_EXHAUSTED)",
                                     parse=parse_size)
    request_timeout: float = setting(0.0, "seconds a request may run before it is aborted with DEADLINE_EXCEEDED "
                                          "(0: no limit but the client's own deadline)")
    api_keys_file: str = setting("", "file of API keys, one 'name:key' per line; with keys set, calls without "
                                     "one get UNAUTHENTICATED")
    api_keys: str = setting("", "API keys, comma-separated 'name:key' (prefer the environment variable)",
                            secret=True)
    max_streams_per_key: int = setting(0, "most streams one API key may have open (0: no limit)")
    tls_cert: str = setting("", "PEM certificate of the public API (with --tls-key: TLS)")
    tls_key: str = setting("", "PEM private key of the public API")
    tls_client_ca: str = setting("", "PEM CA that must sign client certificates (mutual TLS)")
    stream_interval: int = setting(1, "tokens a stream gathers before its next message to the client (its first "
                                      "message and the finish go at once): 1 sends every token as it comes; more "
                                      "cost the frontend less CPU per token at many streams, and make each "
                                      "stream's tokens arrive in bursts (vLLM's and SGLang's --stream-interval)")
    max_streams: int = setting(512, "most client streams this frontend serves at once (more get RESOURCE_EXHAUSTED)")
    http_header_timeout: float = setting(10.0, "seconds an HTTP connection may take to send a request's headers "
                                               "before it is closed (half-sent requests hold no connection)")
    http_max_connections: int = setting(1000, "most HTTP connections and requests at once (more get 503)")
    shared_prefix_cache: bool = setting(False, "let every API key reuse every other's cached prompt prefixes (a "
                                               "trusted deployment; default: each key has its own, so no key can "
                                               "time another's prompts)")
    allowed_origins: str = setting("*", "origins a browser may call the HTTP API from (CORS), comma-separated; '*': "
                                        "any (vLLM's default); '': none")
    metrics_host: str = setting("127.0.0.1", "address of the Prometheus /metrics endpoint (0.0.0.0 for a scraper elsewhere)")
    metrics_port: int = setting(9101, "port of the Prometheus /metrics endpoint (0: any free port)")
    log_level: str = setting("INFO", "logging level")

    def __post_init__(self):
        require(0 <= self.port < 65536, "port", f"must be in [0, 65535], got {self.port}")
        require(0 <= self.metrics_port < 65536, "metrics_port", f"must be in [0, 65535], got {self.metrics_port}")
        require(0 <= self.link_port < 65536, "link_port", f"must be in [0, 65535], got {self.link_port}")
        require(0 <= self.internal_port < 65536, "internal_port", f"must be in [0, 65535], got {self.internal_port}")
        require(self.max_stop_strings >= 0, "max_stop_strings", "must be >= 0")
        require(self.max_stop_token_ids >= 0, "max_stop_token_ids", "must be >= 0")
        require(self.max_logit_bias >= 0, "max_logit_bias", "must be >= 0")
        require(self.max_grammar_bytes >= 1, "max_grammar_bytes", "must be >= 1")
        require(self.max_streams >= 1, "max_streams", "must be >= 1")
        require(1 <= self.stream_interval <= 1024, "stream_interval", f"must be in [1, 1024], got {self.stream_interval}")
        require(self.http_header_timeout > 0, "http_header_timeout", "must be > 0")
        require(self.http_max_connections >= 1, "http_max_connections", "must be >= 1")
        require(-1 <= self.http_port < 65536, "http_port", f"must be -1 (off) or in [0, 65535], got {self.http_port}")
        require(self.max_prompt_tokens >= 0, "max_prompt_tokens", "must be >= 0")
        require(self.max_message_bytes >= 1024, "max_message_bytes", "must be >= 1K")
        require(self.request_timeout >= 0, "request_timeout", "must be >= 0")
        require(self.max_streams_per_key >= 0, "max_streams_per_key", "must be >= 0")
        require(bool(self.tls_cert) == bool(self.tls_key), "tls_key", "and --tls-cert go together")
        require(not self.tls_client_ca or bool(self.tls_cert), "tls_client_ca", "needs --tls-cert and --tls-key")

    @property
    def deliver_address(self) -> str:
        return self.advertise or f"{self.internal_host}:{self.internal_port}"
