"""`kvstore demo`: real vLLM (CPU) with the kvstore connector on the embedded default store.

1. A tiny local model is built (no hub access).
2. A baseline engine without the connector computes every prompt from scratch.
3. An engine with the connector serves prompts that share a prefix: later prompts load the
   shared blocks from the store instead of recomputing them.
4. A prefill engine (kv_producer) computes a new prompt and hands its KV over through the store to a
   decode engine (kv_consumer), which loads every full prompt block and generates.
Engines run one after another in this process (the embedded store lives here); the table shows
prompt tokens, tokens loaded from the store, time to first token beside the same prompt's on the
engine without the connector, whether the output (greedy tokens) is identical to the recomputed
baseline, and what each TTFT includes (first sight: computes and saves; warm: loads from the store).
Every engine first runs the same warm-up, the twin of every prompt of the demo (`warmup_twin`: the
same lengths and calls, no prefix shared with them), so each row compares engines in the same state.
"""
from __future__ import annotations

import contextlib
import gc
import itertools
import os
import statistics
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
    baseline_ms: float | None = None  # the same prompt's TTFT on the engine without the connector
    saved_blocks: int = 0  # blocks this step saved to the store
    handoff_ms: float | None = None  # P/D: the decode engine's wait for and load of the prefill's KV

    def includes(self) -> str:
        """What this TTFT paid for, in words."""
        computed = self.prompt_tokens - self.loaded_tokens
        if self.handoff_ms is not None:
            return f"hand-off: loads {self.loaded_tokens} tokens ({self.handoff_ms:.1f} ms), computes {computed}"
        if self.loaded_tokens:
            return f"warm: loads {self.loaded_tokens} tokens from the store, computes {computed}"
        saved = f" (then saves {self.saved_blocks} blocks)" if self.saved_blocks else ""
        return f"first sight: computes {computed} tokens{saved}"


@dataclass
class Step:
    """One measured prompt: its TTFT (a 1-token generation), then its full output."""

    name: str
    prompt: list[int]
    remote_decode: bool = False  # P/D prefill: keep the KV for a decode engine (kv_transfer_params out)
    round: int = 0

    @property
    def key(self) -> tuple[str, int]:
        return self.name, self.round


ROUNDS = 5  # each row's TTFT is the median of this many rounds, each on prompts of its own


def _shift(prompt: list[int], by: int) -> list[int]:
    return [(t - 3 + by) % 500 + 3 for t in prompt]  # token ids 3..502 of the tiny model's vocabulary


def rounds(steps: list[Step], count: int = ROUNDS) -> list[Step]:
    """`steps` `count` times, round k's prompts shifted so no round shares a prefix with another
    (a first sight in every round); within a round they share what `steps` share."""
    return [Step(s.name, _shift(s.prompt, 37 * k), s.remote_decode, k) for k in range(count) for s in steps]


def warmup_twin(steps: list[Step], offset: int = 250) -> list[Step]:
    """Steps like `steps` (same lengths, same repeats, the same shared prefix among them) over other
    tokens, so they share no prefix with the measured prompts of any round: an engine that runs
    them first has seen every shape, path (compute, save, load) and length it is then measured
    on, as every other engine has. Without it the connector's first measured prompt paid one-time
    costs the baseline engine had already paid (13x the baseline's TTFT in one run)."""
    return [Step(f"warm-up {s.name}", _shift(s.prompt, offset), s.remote_decode) for s in steps]


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
    from .local_engine import engine

    # Producer and consumer share this process's embedded store: say so, or the connector refuses.
    extra = {"metadata": store_url, "dram": "512MiB", "process_local": True}
    llm = engine(model, None if role is None else {"role": role, "extra": extra})
    _generate(llm, [1, 2, 3], 2)  # a first forward pass is slow; shorter than a block: nothing saved
    return llm


def _release(llm) -> None:
    from vllm.distributed import cleanup_dist_env_and_memory
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

    del llm
    ensure_kv_transfer_shutdown()
    cleanup_dist_env_and_memory()
    gc.collect()


_request_ids = itertools.count()


def _generate(llm, prompt: list[int], max_tokens: int, transfer: dict | None = None):
    """(the finished output, TTFT ms): the engine is stepped by hand, so the TTFT is the time to the
    step that produced the first token, as a streaming client sees it. `LLM.generate` returns only
    once the engine has no request left, and a P/D prefill's request stays until its KV is handed
    to the store: its time was the hand-off's, not the first token's. The steps go on until the
    engine is idle, so nothing of this request spills into the next measurement."""
    from vllm import SamplingParams

    llm.reset_prefix_cache()  # every measurement starts without vLLM's own prefix cache
    params = SamplingParams(temperature=0, max_tokens=max_tokens,
                            extra_args={"kv_transfer_params": transfer} if transfer else None)
    engine, request_id = llm.llm_engine, f"demo-{next(_request_ids)}"
    started = time.perf_counter()
    engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    first = final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id != request_id:
                continue
            if first is None and out.outputs and out.outputs[0].token_ids:
                first = time.perf_counter()
            if out.finished:
                final = out
    if final is None or first is None:
        raise RuntimeError(f"the engine finished without an answer to request {request_id}")
    return final, (first - started) * 1e3


def _totals() -> dict:
    try:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        connector = get_kv_transfer_group()
    except Exception:  # noqa: BLE001 - the baseline engine has no connector
        return {}
    connector.flush_saves()
    return dict(connector.totals.data)


def _serve(llm, steps: list[Step], max_tokens: int, transfers: dict[tuple[str, int], dict] | None = None
           ) -> tuple[dict[tuple[str, int], dict], dict[tuple[str, int], dict]]:
    """Each step's TTFT (1 token) and then its full output, as every engine runs them. Returns, by
    step key, {"ttft_ms", "tokens", "loaded", "saved", "load_ms"} (the last three from the
    connector's counters, zero without one), and the kv_transfer_params each remote-decode step
    handed out. `transfers`: the params a decode engine is given, by step key."""
    results, handed = {}, {}
    for step in steps:
        transfer = {"do_remote_decode": True} if step.remote_decode else (transfers or {}).get(step.key)
        before = _totals()
        out, ttft = _generate(llm, step.prompt, 1, transfer)
        moved = {key: value - before.get(key, 0) for key, value in _totals().items()}
        if step.remote_decode:
            handed[step.key] = out.kv_transfer_params
            tokens = None  # a prefill engine's output is its hand-off, not text
        else:
            tokens = list(_generate(llm, step.prompt, max_tokens, transfer)[0].outputs[0].token_ids)
        results[step.key] = {"ttft_ms": ttft, "tokens": tokens, "loaded": int(moved.get("hit_tokens", 0)),
                             "saved": int(moved.get("saved_blocks", 0)), "load_ms": (moved.get("load_seconds", 0.0) + moved.get("handoff_wait_seconds", 0.0)) * 1e3}
    return results, handed


def _row(label: str, step: Step, results: dict, expected: dict, handoff: bool = False) -> Row:
    """One table row: medians over the rounds; token counts of the first round (the same in each)."""
    mine = [results[step.name, k] for k in range(ROUNDS)]
    base = [expected[step.name, k] for k in range(ROUNDS)]
    identical = None if mine[0]["tokens"] is None else all(m["tokens"] == b["tokens"] for m, b in zip(mine, base))
    return Row(label, len(step.prompt), mine[0]["loaded"], statistics.median(m["ttft_ms"] for m in mine), identical,
               statistics.median(b["ttft_ms"] for b in base), mine[0]["saved"],
               statistics.median(m["load_ms"] for m in mine) if handoff else None)


def run(max_tokens: int = 16, verbose: bool = False) -> int:
    """Run the demo, print the table; exit code 0 when every output matched."""
    _quiet(verbose)
    log = None if verbose else os.path.join(tempfile.gettempdir(), f"kvstore-demo-{os.getpid()}.log")
    print("kvstore demo: vLLM on CPU with a tiny local model, KV blocks kept in an embedded kvstore"
          + (f" (vLLM's log: {log})" if log else "") + "\n", flush=True)
    with _stderr_to(log):
        rows = _run(max_tokens)
    return _report(rows)


def demo_steps() -> tuple[list[Step], list[Step]]:
    """(the connector engine's steps, the P/D steps: the prefill's; the decode engine runs the same prompt)."""
    prefix = [(7 * i) % 500 + 3 for i in range(3 * BLOCK)]  # a 384-token system prompt shared by all
    question = prefix + [11, 12, 13, 14, 15]
    shared = [Step("question 1", question), Step("question 2 (shared prefix)", prefix + [21, 22, 23]),
              Step("question 1 again", question)]
    handoff = [Step("hand-off", [(5 * i) % 480 + 17 for i in range(2 * BLOCK + 60)], remote_decode=True)]
    return shared, handoff


def _run(max_tokens: int) -> list[Row]:
    from .tiny_model import build_tiny_model

    cache_dir = os.path.join(os.path.expanduser("~"), ".cache", "kvstore", "tiny-llama-demo")
    model = build_tiny_model(cache_dir, layers=4, hidden=256, heads=4)
    store_url = f"memory://demo-{os.getpid()}"
    shared, handoff = demo_steps()
    plain = [Step(s.name, s.prompt) for s in handoff]  # the hand-off prompt as an engine without P/D serves it
    # Every engine first runs the same warm-up: the twin of every prompt of the demo (the same
    # lengths and calls, sharing no prefix with them), the hand-off's in its own role's form.
    warm_shared, warm_handoff, warm_plain = warmup_twin(shared), warmup_twin(handoff), warmup_twin(plain)

    baseline = _engine(model, None, store_url)
    _serve(baseline, warm_shared + warm_plain, max_tokens)
    expected, _ = _serve(baseline, rounds(shared + plain), max_tokens)
    _release(baseline)

    llm = _engine(model, "kv_both", store_url)
    _serve(llm, warm_shared + warm_plain, max_tokens)
    results, _ = _serve(llm, rounds(shared), max_tokens)
    rows = [_row("question 1 (first sight)" if step.name == "question 1" else step.name, step, results, expected)
            for step in shared]
    _release(llm)

    producer = _engine(model, "kv_producer", store_url)
    _, warm_handed = _serve(producer, warm_shared + warm_handoff, max_tokens)
    results, handed = _serve(producer, rounds(handoff), max_tokens)
    rows.append(_row("prefill engine (producer)", handoff[0], results, expected))
    _release(producer)

    consumer = _engine(model, "kv_consumer", store_url)  # given the producer's kv_transfer_params
    _serve(consumer, warm_shared + warm_plain, max_tokens, warm_handed)
    results, _ = _serve(consumer, rounds(plain), max_tokens, handed)
    rows.append(_row("decode engine (consumer)", plain[0], results, expected, handoff=True))
    _release(consumer)
    return rows


def _report(rows: list[Row]) -> int:
    print(f"{'step':<28}{'prompt tokens':>14}{'loaded from store':>19}{'TTFT ms':>9}{'no connector ms':>17}"
          f"  {'identical':<10}TTFT includes")
    for r in rows:
        same = "-" if r.identical is None else ("yes" if r.identical else "NO")
        base = "-" if r.baseline_ms is None else f"{r.baseline_ms:.1f}"
        print(f"{r.step:<28}{r.prompt_tokens:>14}{r.loaded_tokens:>19}{r.ttft_ms:>9.1f}{base:>17}  {same:<10}"
              f"{r.includes()}")
    print(f"\nTTFT: the time to each engine's first token, the median of {ROUNDS} rounds on prompts of their own. "
          "\"no connector ms\": the\nsame prompts on an engine without the connector. Every engine first ran the same "
          "warm-up (prompts of the\nsame lengths and calls, sharing nothing with these), so each row compares like with "
          "like.\n\"identical\": greedy output equal to the recomputed one in every round.")
    ok = all(r.identical is not False for r in rows) and rows[2].loaded_tokens > 0 and rows[-1].loaded_tokens > 0
    return 0 if ok else 1
