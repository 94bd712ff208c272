"""`kvstore demo`: real vLLM (CPU) with the kvstore connector on the embedded default store.

1. A tiny local model is built (no hub access).
2. A baseline engine without the connector computes every prompt from scratch.
3. An engine with the connector serves prompts that share a prefix: later prompts load the
   shared blocks from the store instead of recomputing them.
4. A prefill engine (kv_producer) computes a new prompt and hands its KV over through the store to a
   decode engine (kv_consumer), which loads every full prompt block and generates.
Engines run one after another in this process (the embedded store lives here); the table shows
prompt tokens, tokens loaded from the store, time to first token, and whether the output
(greedy tokens) is identical to the recomputed baseline.
"""
from __future__ import annotations

import contextlib
import gc
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Iterator

BLOCK = 128  # vLLM's CPU KV block size


@dataclass
class Row:
    step: str
    prompt_tokens: int
    loaded_tokens: int
    ttft_ms: float
    identical: bool | None
    handoff_ms: float | None = None  # P/D: the decode engine's load of the prefill's KV


def _quiet(verbose: bool) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if not verbose:  # a newcomer wants the table, not vLLM's start-up chatter
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        import logging
        import warnings

        warnings.filterwarnings("ignore")
        logging.getLogger("kvstore").setLevel(logging.ERROR)


@contextlib.contextmanager
def _stderr_to(path: str | None) -> Iterator[None]:
    """Send file descriptor 2 to `path`: vLLM's C++ warnings and progress bars bypass Python logging."""
    if path is None:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "ab") as log:
        os.dup2(log.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def _engine(model: str, role: str | None, store_url: str):
    from .engine_run import engine

    # Producer and consumer share this process's embedded store: say so, or the connector refuses.
    extra = {"metadata": store_url, "dram": "512MiB", "process_local": True}
    llm = engine(model, None if role is None else {"role": role, "extra": extra})
    _generate(llm, [1, 2, 3], 2)  # warm up (a first forward pass is slow); shorter than a block: nothing saved
    return llm


def _release(llm) -> None:
    from vllm.distributed import cleanup_dist_env_and_memory
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

    del llm
    ensure_kv_transfer_shutdown()
    cleanup_dist_env_and_memory()
    gc.collect()


def _generate(llm, prompt: list[int], max_tokens: int, transfer: dict | None = None):
    from vllm import SamplingParams

    llm.reset_prefix_cache()  # every measurement starts without vLLM's own prefix cache
    params = SamplingParams(temperature=0, max_tokens=max_tokens,
                            extra_args={"kv_transfer_params": transfer} if transfer else None)
    started = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    return out, (time.perf_counter() - started) * 1e3


def _totals() -> dict:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    connector = get_kv_transfer_group()
    connector.flush_saves()
    return dict(connector.totals.data)


def _loaded_tokens() -> int:
    return int(_totals().get("hit_tokens", 0))


def run(max_tokens: int = 16, verbose: bool = False) -> int:
    """Run the demo, print the table; exit code 0 when every output matched."""
    _quiet(verbose)
    log = None if verbose else os.path.join(tempfile.gettempdir(), f"kvstore-demo-{os.getpid()}.log")
    print("kvstore demo: vLLM on CPU with a tiny local model, KV blocks kept in an embedded kvstore"
          + (f" (vLLM's log: {log})" if log else "") + "\n", flush=True)
    with _stderr_to(log):
        rows, baseline_ttft = _run(max_tokens)
    return _report(rows, baseline_ttft)


def _run(max_tokens: int) -> tuple[list[Row], dict[str, float]]:
    from .tiny_model import build_tiny_model

    cache_dir = os.path.join(os.path.expanduser("~"), ".cache", "kvstore", "tiny-llama-demo")
    model = build_tiny_model(cache_dir, layers=4, hidden=256, heads=4)
    store_url = f"memory://demo-{os.getpid()}"
    prefix = [(7 * i) % 500 + 3 for i in range(3 * BLOCK)]  # a 384-token system prompt shared by all
    prompts = {
        "question 1 (cold)": prefix + [11, 12, 13, 14, 15],
        "question 2 (shared prefix)": prefix + [21, 22, 23],
        "question 1 again": prefix + [11, 12, 13, 14, 15],
    }
    handoff = [(5 * i) % 480 + 17 for i in range(2 * BLOCK + 60)]

    baseline = _engine(model, None, store_url)
    expected = {name: list(_generate(baseline, p, max_tokens)[0].outputs[0].token_ids) for name, p in prompts.items()}
    expected["hand-off"] = list(_generate(baseline, handoff, max_tokens)[0].outputs[0].token_ids)
    baseline_ttft = {name: _generate(baseline, p, 1)[1] for name, p in prompts.items()}
    _release(baseline)

    rows: list[Row] = []
    llm = _engine(model, "kv_both", store_url)
    for name, prompt in prompts.items():
        before = _loaded_tokens()
        _, ttft = _generate(llm, prompt, 1)
        loaded = _loaded_tokens() - before
        out, _ = _generate(llm, prompt, max_tokens)
        rows.append(Row(name, len(prompt), loaded, ttft, list(out.outputs[0].token_ids) == expected[name]))
    _release(llm)

    producer = _engine(model, "kv_producer", store_url)
    before = _loaded_tokens()  # after the engine's warm-up, which may load its own short prompt
    out, ttft = _generate(producer, handoff, 1, {"do_remote_decode": True})
    transfer = out.kv_transfer_params
    rows.append(Row("prefill engine (producer)", len(handoff), _loaded_tokens() - before, ttft, None))
    _release(producer)
    consumer = _engine(model, "kv_consumer", store_url)
    before_stats = _totals()
    _, ttft = _generate(consumer, handoff, 1, transfer)  # time to the decode engine's first token
    stats = {key: value - before_stats.get(key, 0) for key, value in _totals().items()}
    out, _ = _generate(consumer, handoff, max_tokens, transfer)
    rows.append(Row("decode engine (consumer)", len(handoff), int(stats.get("hit_tokens", 0)), ttft,
                    list(out.outputs[0].token_ids) == expected["hand-off"],
                    handoff_ms=stats.get("load_seconds", 0.0) * 1e3))
    _release(consumer)
    return rows, baseline_ttft


def _report(rows: list[Row], baseline_ttft: dict[str, float]) -> int:
    print(f"{'step':<30}{'prompt tokens':>14}{'loaded from store':>19}{'TTFT ms':>10}{'hand-off ms':>13}"
          "  identical to recompute")
    for r in rows:
        same = "-" if r.identical is None else ("yes" if r.identical else "NO")
        handoff_ms = "-" if r.handoff_ms is None else f"{r.handoff_ms:.1f}"
        print(f"{r.step:<30}{r.prompt_tokens:>14}{r.loaded_tokens:>19}{r.ttft_ms:>10.1f}{handoff_ms:>13}  {same}")
    print("\nbaseline TTFT without the connector: "
          + ", ".join(f"{name} {ms:.1f} ms" for name, ms in baseline_ttft.items()))
    print("(TTFT is the time to each engine's first token; the decode engine's includes the hand-off, the time it "
          "took to load the prefill engine's KV from the store)")
    ok = all(r.identical is not False for r in rows) and rows[2].loaded_tokens > 0 and rows[-1].loaded_tokens > 0
    return 0 if ok else 1
