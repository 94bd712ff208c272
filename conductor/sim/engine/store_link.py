"""An engine's link to the kvstore pool: what the kvstore connector does, through `kvstore.Client`.

- Before a prefill: the connector's keys for the prompt (`hashing.store_keys`), the leading ones
  the pool holds (the index mirror, every rank's fingerprint: here one), up to the tokens vLLM may
  take from outside (all but the last prompt token); the hit blocks are read with `get_many` into
  real buffers, asynchronously (the request waits, the engine keeps stepping).
- A P/D decode carries the prefill's `kv_transfer_params["kvstore"]`: fingerprint checked, then
  it waits on the mirror (up to `remote_wait_s`) for the promised blocks and loads them.
- After a prefill: newly full prompt blocks (and, once the prompt is computed, its trailing
  partial block) are saved in the background with `put_many`, skipping blocks the pool holds.
- A P/D prefill ends with the connector's `kv_transfer_params`.

Block bytes: the profile's full-size block scaled down by `bytes_scale` (a 16 MiB Llama-3-8B block
at the default 1/16384 is 1 KiB), every byte derived from the block's key and position, so every
load is checked (`wrong_bytes` counts bytes that differ: must stay 0). A load's time is its real
time (the engine clock runs `time_scale` times slower than the wall, so it is scaled like
everything else) plus the modelled time to move the full-size KV (`Profile.transfer_ms`)."""
from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from kvstore.keys import ModelFingerprint
from kvstore.prefix import loadable_blocks, loadable_tokens

from .hashing import store_keys
from .profile import Profile
from .scheduler import Request

log = logging.getLogger("conductor.sim.engine")
PARAMS_KEY = "kvstore"


def block_bytes(key: bytes, nbytes: int, position: np.ndarray) -> np.ndarray:
    """A block's bytes: its 16-byte key repeated, mixed with each byte's position."""
    return np.frombuffer(key * (nbytes // 16 + 1), np.uint8, nbytes) ^ position


def fingerprint_for(profile: Profile, bytes_scale: int) -> ModelFingerprint:
    """The engines' store fingerprint: free-form blocks (their size is the scaled one)."""
    return ModelFingerprint(model_id=profile.model, dtype=profile.dtype, block_size=profile.block_size,
                            num_layers=profile.num_layers, num_kv_heads=profile.num_kv_heads,
                            head_size=profile.head_size, kv_layout="bytes",
                            cache_salt=f"conductor.sim.engine bytes 1/{bytes_scale}")


@dataclass
class LinkStats:
    loaded_blocks: int = 0
    load_bytes: int = 0
    load_seconds: float = 0.0
    load_failures: int = 0
    hit_tokens: int = 0
    saved_blocks: int = 0
    save_bytes: int = 0
    save_failures: int = 0
    wrong_bytes: int = 0
    remote_waits: int = 0
    remote_timeouts: int = 0
    load_cpu_s: float = 0.0  # CPU the store calls took on this process's threads
    save_cpu_s: float = 0.0
    # From a save's call (its blocks computed) to its blocks in the pool: the wall seconds a request
    # for the same prefix on another engine finds nothing there yet.
    save_lag_s: float = 0.0  # summed over the saves
    save_lag_max_s: float = 0.0
    saves: int = 0
    by_engine: dict = field(default_factory=dict)


class StoreLink:
    """Shared by every engine of the process (one client); each engine has the connector's threads of
    its own: two loading (`kvstore-load`), one saving in order (`SaveWriter`), so one engine's saves
    never queue behind another's, as in separate vLLM processes."""

    def __init__(self, client, profile: Profile, bytes_scale: int, *, remote_wait_s: float = 5.0,
                 threads: int = 2) -> None:
        self.client, self.profile = client, profile
        self.fingerprint = fingerprint_for(profile, bytes_scale)
        self.nbytes = max(16, profile.block_bytes // bytes_scale)
        self.position = ((np.arange(self.nbytes, dtype=np.uint32) * 131) >> 3).astype(np.uint8)
        self.remote_wait_s = remote_wait_s
        self.load_threads = threads
        self.loaders: dict[str, ThreadPoolExecutor] = {}
        self.writers: dict[str, ThreadPoolExecutor] = {}
        self.stats = LinkStats()
        self.saving: set[asyncio.Future] = set()

    def _executor(self, table: dict[str, ThreadPoolExecutor], engine: str, threads: int,
                  name: str) -> ThreadPoolExecutor:
        pool = table.get(engine)
        if pool is None:
            pool = table[engine] = ThreadPoolExecutor(threads, thread_name_prefix=f"{name}-{engine}")
        return pool

    def close(self) -> None:
        for pool in [*self.loaders.values(), *self.writers.values()]:
            pool.shutdown(wait=True, cancel_futures=False)

    # ------------------------------------------------------------------ keys
    def keys(self, request: Request) -> list[bytes]:
        """One key per prompt block: full blocks, then the partial one's when it has a key."""
        cached = getattr(request, "_store_keys", None)
        if cached is None:
            prompt = request.prompt
            remote = (request.kv_params or {}).get(PARAMS_KEY)
            tokens = prompt
            if remote is not None and remote.get("prompt_token_ids") is not None:
                theirs = list(remote["prompt_token_ids"])
                n = 0
                for a, b in zip(prompt, theirs):
                    if a != b:
                        break
                    n += 1
                tokens = prompt[:n]
            full, tail = store_keys(self.fingerprint, tokens, request.cache_salt, partial=tokens == prompt)
            cached = full + ([tail] if tail is not None else [])
            request._store_keys = cached  # type: ignore[attr-defined]
            request._store_full = len(full)  # type: ignore[attr-defined]
        return cached

    def usable_blocks(self, request: Request) -> int:
        bs = self.profile.block_size
        return min(-(-loadable_tokens(request.num_prompt) // bs), len(self.keys(request)))

    # ------------------------------------------------------------------ before a prefill
    def matched_tokens(self, request: Request, local_tokens: int) -> int:
        bs = self.profile.block_size
        usable = self.usable_blocks(request)
        remote = (request.kv_params or {}).get(PARAMS_KEY)
        if remote is not None:
            if remote.get("fingerprint") != self.fingerprint.digest:
                log.error("request %s carries KV of fingerprint %s, this engine is %s: recomputing",
                          request.rid, remote.get("fingerprint"), self.fingerprint.digest)
                return 0
            promised = int(remote.get("num_tokens", int(remote.get("num_blocks", 0)) * bs))
            matched = min(-(-promised // bs), usable)
            tokens = min(promised, matched * bs)
        else:
            keys = self.keys(request)[:usable]
            match = self.client.mirror.match(self.fingerprint, keys)
            if match.stale:
                return 0
            tokens = match.length * bs
        tokens = min(tokens, loadable_tokens(request.num_prompt))
        return max(0, tokens - local_tokens)

    def start_load(self, request: Request, local_tokens: int, tokens: int, clock, done: Callable[[Request, int], None],
                   engine: str) -> asyncio.Task:
        return asyncio.get_running_loop().create_task(self._load(request, local_tokens, tokens, clock, done, engine))

    async def _load(self, request: Request, local_tokens: int, tokens: int, clock, done, engine: str) -> None:
        bs = self.profile.block_size
        first = local_tokens // bs
        last = -(-(local_tokens + tokens) // bs)
        keys = self.keys(request)[first:last]
        wait = self.remote_wait_s if PARAMS_KEY in (request.kv_params or {}) else 0.0
        started = time.perf_counter()
        try:
            pool = self._executor(self.loaders, engine, self.load_threads, "standin-load")
            good = await asyncio.get_running_loop().run_in_executor(pool, self._read, keys, wait)
        except Exception as exc:  # a failed load is a recompute, never a crash
            log.warning("load of %d blocks failed: %s", len(keys), exc)
            good = 0
        real = time.perf_counter() - started
        loaded = min(tokens, good * bs - (local_tokens - first * bs)) if good < len(keys) else tokens
        loaded = max(0, loaded)
        self.stats.load_seconds += real
        self.stats.hit_tokens += loaded
        per = self.stats.by_engine.setdefault(engine, {"loaded_blocks": 0, "hit_tokens": 0})
        per["loaded_blocks"] += good
        per["hit_tokens"] += loaded
        # The full-size KV's transfer, on top of the real (scaled-down) read.
        await clock.sleep(self.profile.transfer_ms(loaded) / 1e3)
        done(request, loaded)

    def _read(self, keys: list[bytes], wait_s: float) -> int:
        """Read `keys` into fresh buffers and check every byte; the leading blocks that arrived right."""
        cpu = time.thread_time()
        try:
            return self._read_checked(keys, wait_s)
        finally:
            self.stats.load_cpu_s += time.thread_time() - cpu

    def _read_checked(self, keys: list[bytes], wait_s: float) -> int:
        if wait_s > 0:
            self.stats.remote_waits += 1
            fp, mirror = self.fingerprint, self.client.mirror
            if not mirror.wait_until(lambda m: all(m.contains(fp, k) for k in keys), wait_s):
                self.stats.remote_timeouts += 1
        buffers = [np.empty(self.nbytes, np.uint8) for _ in keys]
        found = self.client.get_many(keys, buffers, fingerprint=self.fingerprint)
        good = 0
        for key, ok, buf in zip(keys, found, buffers):
            if not ok:
                break
            wrong = int(np.count_nonzero(buf != block_bytes(key, self.nbytes, self.position)))
            if wrong:
                self.stats.wrong_bytes += wrong
                break
            good += 1
        self.stats.loaded_blocks += good
        self.stats.load_bytes += good * self.nbytes
        self.stats.load_failures += len(keys) - good
        return good

    # ------------------------------------------------------------------ after a prefill
    def save(self, request: Request, start: int, end: int, tail: bool, engine: str = "") -> None:
        keys = self.keys(request)
        full = request._store_full  # type: ignore[attr-defined]
        wanted = keys[start:min(end, full)]
        if tail and len(keys) > full:
            wanted.append(keys[full])
        if not wanted:
            return
        writer = self._executor(self.writers, engine, 1, "standin-save")
        future = asyncio.get_running_loop().run_in_executor(writer, self._write, wanted, time.monotonic())
        self.saving.add(future)
        future.add_done_callback(self.saving.discard)

    def _write(self, keys: list[bytes], asked: float | None = None) -> None:
        cpu = time.thread_time()
        try:
            self._write_new(keys)
        finally:
            self.stats.save_cpu_s += time.thread_time() - cpu
            if asked is not None:
                lag = time.monotonic() - asked
                self.stats.save_lag_s += lag
                self.stats.save_lag_max_s = max(self.stats.save_lag_max_s, lag)
                self.stats.saves += 1

    def _write_new(self, keys: list[bytes]) -> None:
        fp, mirror = self.fingerprint, self.client.mirror
        new = [k for k in keys if not mirror.contains(fp, k)]
        if not new:
            return
        try:
            self.client.put_many(((k, block_bytes(k, self.nbytes, self.position)) for k in new), fingerprint=fp)
        except Exception as exc:  # the pool is a cache: a failed save costs hits, not answers
            self.stats.save_failures += len(new)
            log.warning("save of %d blocks failed: %s", len(new), exc)
            return
        self.stats.saved_blocks += len(new)
        self.stats.save_bytes += len(new) * self.nbytes

    def transfer_params(self, request: Request) -> dict:
        """What a P/D prefill returns (the connector's `request_finished`)."""
        bs = self.profile.block_size
        keys = self.keys(request)
        full = request._store_full  # type: ignore[attr-defined]
        return {PARAMS_KEY: {"fingerprint": self.fingerprint.digest, "prompt_token_ids": request.prompt,
                             "num_blocks": min(loadable_blocks(request.num_prompt, bs), full),
                             "num_tokens": min(loadable_tokens(request.num_prompt), len(keys) * bs)}}

    async def flush(self, timeout: float = 30.0) -> None:
        if self.saving:
            await asyncio.wait(list(self.saving), timeout=timeout)
