"""P/D hand-off parameters: what a prefill engine returns for a remote decode, and how long a
decode engine may wait for the blocks they promise.

A decode waits (up to `remote_wait_s`) for blocks still being written only when the parameters
carry a MAC that this deployment's prefill made: any API client can attach plausible
`kv_transfer_params` to a request, and unsigned ones would make the decode wait for blocks that
never come. Unsigned or stale parameters still load what the store already holds, without
waiting. The key comes from the shared `secret` (or `handoff_secret`) of the store's deployment,
else from `KVSTORE_SECRET` in the engine's environment (the store client reads it too: a secret
kept off the command line); a process-private store gets a random key per process (its prefill
and decode share the process).
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
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
                now: float | None = None) -> dict[str, Any]:
    """The `kv_transfer_params` a prefill returns (under PARAMS_KEY), signed when it has a key."""
    body: dict[str, Any] = {"fingerprint": chain_digest, "prompt_token_ids": list(tokens), "num_blocks": num_blocks,
                            "num_tokens": num_tokens, "issued": round(time.time() if now is None else now, 3)}
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


def wait_budget(params: dict[str, Any], key: bytes | None, remote_wait_s: float, now: float | None = None) -> float:
    """Seconds a decode may wait for promised blocks: the configured budget for verified
    parameters, none for what any client could have written."""
    return remote_wait_s if verified(params, key, now) else 0.0
