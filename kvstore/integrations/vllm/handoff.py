"""P/D hand-off parameters: what a prefill engine returns for a remote decode, and how long a
decode engine may wait for the blocks they promise.

A decode waits (up to `remote_wait_s`) for blocks still being written only when the parameters
carry a MAC that this deployment's prefill made: any API client can attach plausible
`kv_transfer_params` to a request, and unsigned ones would make the decode wait for blocks that
never come. The MAC covers the key of the last promised block (which chains the prompt's tokens,
its adapter, images, embeddings and salt behind the weights' identity) and a one-time id: signed
parameters copied onto another request (other extras) or sent twice are no reason to wait.
Unsigned, stale, foreign or replayed parameters still load what the store already holds, without
waiting. The key comes from the shared `secret` (or `handoff_secret`) of the store's deployment,
else from `KVSTORE_SECRET` in the engine's environment (the store client reads it too: a secret
kept off the command line); a process-private store gets a random key per process (its prefill
and decode share the process).
"""
from __future__ import annotations

import hashlib
import hmac
import itertools
import json
import os
import secrets
import threading
import time
from typing import Any

PARAMS_KEY = "kvstore"
MAX_AGE_S = 300.0  # signed parameters older than this are no reason to wait
_PROCESS_KEY = secrets.token_bytes(32)  # process-private stores: prefill and decode share this process


def handoff_key(extra: dict[str, Any], private_store: bool) -> bytes | None:
    """The MAC key of this deployment's hand-offs; None when there is nothing to derive it from."""
    secret = extra.get("handoff_secret") or extra.get("secret")
    if not secret and not private_store:
        secret = os.environ.get("KVSTORE_SECRET")
    if secret:
        return hashlib.sha256(b"kvstore hand-off v1\0" + str(secret).encode()).digest()
    return _PROCESS_KEY if private_store else None


def _mac(key: bytes, body: dict[str, Any]) -> str:
    payload = json.dumps({k: v for k, v in body.items() if k != "mac"}, sort_keys=True, separators=(",", ":"))
    return hmac.new(key, payload.encode(), hashlib.sha256).hexdigest()


def make_params(key: bytes | None, chain_digest: str, tokens: list[int], num_blocks: int, num_tokens: int,
                last_key: bytes | None = None, now: float | None = None) -> dict[str, Any]:
    """The `kv_transfer_params` a prefill returns (under PARAMS_KEY), signed when it has a key.
    `last_key`: the store key of the last promised block (None: no block promised)."""
    body: dict[str, Any] = {"fingerprint": chain_digest, "prompt_token_ids": list(tokens), "num_blocks": num_blocks,
                            "num_tokens": num_tokens, "last_key": last_key.hex() if last_key else None,
                            "id": secrets.token_hex(16), "issued": round(time.time() if now is None else now, 3)}
    if key is not None:
        body["mac"] = _mac(key, body)
    return {PARAMS_KEY: body}


def verified(params: dict[str, Any], key: bytes | None, now: float | None = None) -> bool:
    """Whether `params` (the body under PARAMS_KEY) were made by this deployment's prefill, recently."""
    mac = params.get("mac")
    if key is None or not isinstance(mac, str):
        return False
    if not hmac.compare_digest(mac, _mac(key, params)):
        return False
    issued = params.get("issued")
    age = (time.time() if now is None else now) - float(issued) if isinstance(issued, (int, float)) else None
    return age is not None and -MAX_AGE_S <= age <= MAX_AGE_S


class SeenIds:
    """One-time ids of hand-off parameters this engine waited for, kept for as long as parameters
    stay fresh (MAX_AGE_S): inside that window an id is never forgotten. At `capacity` new ids
    are refused (their parameters load what is stored, without waiting) rather than forgetting
    one that could then be replayed."""

    def __init__(self, capacity: int = 1_000_000) -> None:
        self._capacity = capacity
        self._ids: dict[str, float] = {}  # id -> when it expires (insertion order = expiry order)
        self._lock = threading.Lock()

    def first_use(self, ident: str, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        with self._lock:
            for old in [i for i, expires in itertools.takewhile(lambda kv: kv[1] <= now, self._ids.items())]:
                del self._ids[old]
            if ident in self._ids or len(self._ids) >= self._capacity:
                return False
            self._ids[ident] = now + 2 * MAX_AGE_S  # issued up to MAX_AGE_S ago or ahead (clock skew)
            return True


def wait_budget(params: dict[str, Any], key: bytes | None, remote_wait_s: float, last_key: bytes | None,
                seen: SeenIds, now: float | None = None) -> float:
    """Seconds a decode may wait for promised blocks: the configured budget for parameters this
    deployment's prefill signed, recently, for this very request (`last_key`: this request's key
    of the last promised block), the first time they are used; none for anything else."""
    if not verified(params, key, now):
        return 0.0
    if last_key is None or params.get("last_key") != last_key.hex():
        return 0.0  # signed for another prompt, adapter, image or salt
    ident = params.get("id")
    if not isinstance(ident, str) or not seen.first_use(ident):
        return 0.0  # replayed (or no id)
    return remote_wait_s
