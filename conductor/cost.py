"""Cost model: how long prefill, decode steps and KV transfers take.

Defaults describe a LLaMA-2-70B-class model (80 layers, 8 KV heads of 128, fp16) on one
A100/H800-class instance, the setting of the Mooncake paper: ~10k prefill tokens/s with a
quadratic attention term, ~25 ms decode steps growing with batch and context, and RDMA at
100 Gbit/s between instances. Calibrate with `CostModel.from_dict` from your own measurements.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class CostModel:
    prefill_ms_per_token: float = 0.1
    prefill_ms_per_token_sq: float = 2e-6  # attention: grows with context length squared
    decode_ms_per_step: float = 25.0
    decode_ms_per_seq: float = 0.25  # each sequence in the batch adds this
    decode_ms_per_kilotoken: float = 0.01  # each 1k tokens of context in the batch adds this
    kv_bytes_per_token: int = 2 * 80 * 8 * 128 * 2  # K and V, layers, KV heads, head size, fp16
    link_gbps: dict[str, float] = field(default_factory=lambda: {"rdma": 12.5, "tcp": 2.5, "shm": 10.0})
    kv_transfer_fixed_ms: float = 1.0

    @classmethod
    def from_dict(cls, data: dict) -> "CostModel":
        return cls(**data)

    @classmethod
    def from_fingerprint(cls, fingerprint, dtype_bytes: int = 2, **overrides) -> "CostModel":
        """KV bytes per token from a kvstore ModelFingerprint; other terms default or overridden."""
        kv = 2 * fingerprint.num_layers * fingerprint.num_kv_heads * fingerprint.head_size * dtype_bytes
        return cls(kv_bytes_per_token=kv, **overrides)

    def prefill_ms(self, uncached_tokens: int, context_tokens: int) -> float:
        """Compute the uncached tail of a prompt whose full length is `context_tokens`."""
        if uncached_tokens <= 0:
            return 0.0
        cached = context_tokens - uncached_tokens
        attention = self.prefill_ms_per_token_sq * (context_tokens ** 2 - cached ** 2)
        return self.prefill_ms_per_token * uncached_tokens + attention

    def decode_step_ms(self, batch: int, context_tokens: int) -> float:
        if batch <= 0:
            return 0.0
        return self.decode_ms_per_step + self.decode_ms_per_seq * batch + self.decode_ms_per_kilotoken * context_tokens / 1000

    def transfer_ms(self, tokens: int, transport: str = "rdma") -> float:
        if tokens <= 0:
            return 0.0
        return self.kv_transfer_fixed_ms + tokens * self.kv_bytes_per_token / (self.link_gbps[transport] * 1e9) * 1e3

    def to_dict(self) -> dict:
        return asdict(self)
