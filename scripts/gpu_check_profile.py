"""The GPU check's engine profile: prefill and decode step times of a random-weight Llama-3-8B-shaped
layer stack on the device, turned into a stand-in engine profile (`h200-llama3-8b-measured`) that
`python -m benchmarks.fleet --profile` uses like the cited ones (conductor/sim/engine/profile.py).

The stack is Llama-3-8B's shape: 32 layers, hidden 4096, 32 query heads and 8 KV heads of 128,
MLP 14336 (SwiGLU), RMSNorm, an LM head of 128256 on the last token; bf16 weights drawn at random
(the time of a matrix product does not depend on its values); PyTorch eager, SDPA attention (no
RoPE: elementwise, a fraction of a percent of the time). Measured:

- prefill of T tokens from an empty context, T = 1024 and 4096, batch 1 (median of 3 after a
  warm-up): fitted as a*T + b*T^2, so the linear layers' rate and attention's are separated;
- a decode step of batch 1 behind C cached tokens, C = 1024 and 16384: its slope in C is the KV
  read rate, its intercept the weights' read plus the per-step overhead.

The profile's roofline fields follow: gemm_efficiency = 2 * params / (peak * a), attention_efficiency
= 2 * layers * q_dim / (peak * b), memory_efficiency = kv_bytes_per_token / (hbm * slope),
step_overhead_ms = intercept - weight_bytes / (hbm * memory_efficiency); peak 989 TFLOP/s dense BF16
and 4.8 TB/s HBM3e (NVIDIA's H200 SXM datasheet). Capacity from the device's memory at vLLM's
default utilisation (0.9) less the weights and 4 GiB of activations; the link to the store pool
stays the cited profile's assumption (40 GB/s), and so do the scheduler limits.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

NAME = "h200-llama3-8b-measured"
PEAK_FLOPS = 989e12
HBM_BYTES_PER_S = 4.8e12


@dataclass(frozen=True)
class Shape:
    layers: int = 32
    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 8
    head: int = 128
    ffn: int = 14336
    vocab: int = 128256


class Stack:
    """Random bf16 weights of the shape, and its forward passes."""

    def __init__(self, shape: Shape, device: str, dtype: Any = None) -> None:
        import torch

        self.torch, self.shape, self.device = torch, shape, device
        self.dtype = dtype or torch.bfloat16
        s = shape

        def weight(rows: int, cols: int) -> Any:
            return torch.empty(rows, cols, dtype=self.dtype, device=device).normal_(0, 0.02)

        self.layers = [dict(q=weight(s.hidden, s.heads * s.head), k=weight(s.hidden, s.kv_heads * s.head),
                            v=weight(s.hidden, s.kv_heads * s.head), o=weight(s.heads * s.head, s.hidden),
                            gate=weight(s.hidden, s.ffn), up=weight(s.hidden, s.ffn), down=weight(s.ffn, s.hidden))
                       for _ in range(s.layers)]
        self.head_w = weight(s.hidden, s.vocab)

    @property
    def params(self) -> int:
        per_layer = sum(w.numel() for w in self.layers[0].values())
        return per_layer * len(self.layers) + self.head_w.numel()

    def _norm(self, x: Any) -> Any:
        return x * self.torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5).to(x.dtype)

    def _mlp(self, h: Any, w: dict) -> Any:
        return (self.torch.nn.functional.silu(h @ w["gate"]) * (h @ w["up"])) @ w["down"]

    def prefill(self, tokens: int) -> Any:
        torch, s = self.torch, self.shape
        F = torch.nn.functional
        x = torch.randn(tokens, s.hidden, dtype=self.dtype, device=self.device)
        for w in self.layers:
            h = self._norm(x)
            q = (h @ w["q"]).view(tokens, s.heads, s.head).transpose(0, 1)[None]
            k = (h @ w["k"]).view(tokens, s.kv_heads, s.head).transpose(0, 1)[None]
            v = (h @ w["v"]).view(tokens, s.kv_heads, s.head).transpose(0, 1)[None]
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + a[0].transpose(0, 1).reshape(tokens, s.heads * s.head) @ w["o"]
            x = x + self._mlp(self._norm(x), w)
        return self._norm(x[-1:]) @ self.head_w

    def decode_inputs(self, batch: int, context: int) -> list[tuple[Any, Any]]:
        torch, s = self.torch, self.shape
        return [(torch.randn(batch, s.kv_heads, context, s.head, dtype=self.dtype, device=self.device),
                 torch.randn(batch, s.kv_heads, context, s.head, dtype=self.dtype, device=self.device))
                for _ in self.layers]

    def decode(self, cache: list[tuple[Any, Any]]) -> Any:
        torch, s = self.torch, self.shape
        F = torch.nn.functional
        batch = cache[0][0].shape[0]
        x = torch.randn(batch, s.hidden, dtype=self.dtype, device=self.device)
        for w, (k_cache, v_cache) in zip(self.layers, cache):
            h = self._norm(x)
            q = (h @ w["q"]).view(batch, s.heads, 1, s.head)
            k = torch.cat([k_cache, (h @ w["k"]).view(batch, s.kv_heads, 1, s.head)], dim=2)
            v = torch.cat([v_cache, (h @ w["v"]).view(batch, s.kv_heads, 1, s.head)], dim=2)
            a = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
            x = x + a.reshape(batch, s.heads * s.head) @ w["o"]
            x = x + self._mlp(self._norm(x), w)
        return self._norm(x) @ self.head_w


def timed(torch: Any, fn: Any, reps: int = 3) -> float:
    """Median seconds of `fn` after one warm-up (CUDA: synchronised)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    fn()
    sync()
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def measure(device: str = "cuda", shape: Shape = Shape(), prefill_tokens: tuple[int, int] = (1024, 4096),
            contexts: tuple[int, int] = (1024, 16384), reps: int = 3) -> dict:
    """The timings and the profile made of them (see the module docstring)."""
    import torch

    with torch.inference_mode():
        stack = Stack(shape, device)
        t1, t2 = (timed(torch, lambda n=n: stack.prefill(n), reps) for n in prefill_tokens)
        decode = []
        for context in contexts:
            cache = stack.decode_inputs(1, context)
            decode.append(timed(torch, lambda cache=cache: stack.decode(cache), max(reps, 5)))
            del cache
        params = stack.params
        del stack
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    n1, n2 = prefill_tokens
    a = (t1 * n2 * n2 - t2 * n1 * n1) / (n1 * n2 * (n2 - n1))  # seconds per token, linear part
    b = (t2 * n1 - t1 * n2) / (n1 * n2 * (n2 - n1))  # seconds per token squared, attention
    c1, c2 = contexts
    slope = (decode[1] - decode[0]) / (c2 - c1)
    intercept = decode[0] - slope * c1
    kv_bytes_per_token = 2 * shape.layers * shape.kv_heads * shape.head * 2
    weight_bytes = 2 * params
    q_dim = shape.heads * shape.head
    memory_efficiency = min(1.0, kv_bytes_per_token / (HBM_BYTES_PER_S * slope)) if slope > 0 else 0.8
    overhead_ms = max(0.0, 1e3 * (intercept - weight_bytes / (HBM_BYTES_PER_S * memory_efficiency)))
    total = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else 80 << 30
    block_size = 128
    blocks = max(1, int((0.9 * total - weight_bytes - (4 << 30)) // (kv_bytes_per_token * block_size)))
    profile = dict(
        name=NAME, model="meta-llama/Meta-Llama-3-8B (shape; random weights)", params=float(params),
        weight_bytes=float(weight_bytes), num_layers=shape.layers, q_dim=q_dim, num_kv_heads=shape.kv_heads,
        head_size=shape.head, dtype="bfloat16", dtype_bytes=2, block_size=block_size, num_gpu_blocks=blocks,
        max_num_seqs=1024, max_num_batched_tokens=8192, max_model_len=131072, peak_flops=PEAK_FLOPS,
        gemm_efficiency=round(min(1.0, 2 * params / (PEAK_FLOPS * a)) if a > 0 else 0.5, 4),
        attention_efficiency=round(min(1.0, 2 * shape.layers * q_dim / (PEAK_FLOPS * b)) if b > 0 else 0.5, 4),
        memory_bytes_per_s=HBM_BYTES_PER_S, memory_efficiency=round(memory_efficiency, 4),
        step_overhead_ms=round(overhead_ms, 3), link_bytes_per_s=40e9, transfer_fixed_ms=1.0)
    return {"prefill_seconds": {str(n1): t1, str(n2): t2}, "prefill_ms_per_token": round(1e3 * t2 / n2, 5),
            "decode_step_ms": {str(c1): round(1e3 * decode[0], 3), str(c2): round(1e3 * decode[1], 3)},
            "params": params, "profile": profile}
