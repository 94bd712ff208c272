"""Sharing bound to identity: with API keys, each request's `cache_salt` is derived from the key that
authenticated it, so two tenants never share a KV block whatever salt they send.

vLLM (and the kvstore connector) start a salted prompt's block chain from its `cache_salt`: equal
salts share blocks, different salts share none. A caller-chosen salt is no boundary between
tenants: one tenant can send another's salt (or none), and the time to first token then tells it
whether the other sent a prompt. Here the salt the engines see is

    "kv1-" + hex(HMAC-SHA256(salt_secret or the API key, "cache_salt\\0" + the caller's salt))[:32]

so a caller's own salt only subdivides its key's space (the same key and salt share; anything else
does not), and no caller can produce another key's salt without that key (or the gateway's secret).
Without API keys there is no identity to bind to: the caller's salt goes to the engines as sent.
"""
from __future__ import annotations

import hashlib
import hmac
from typing import Any

from aiohttp import web

from .errors import ApiError

SALT_PREFIX = "kv1-"  # the derivation's version: a change of scheme must not meet old blocks


# The API key that authenticated a request (set by the gateway's auth middleware).
TENANT: Any = web.RequestKey("conductor_gateway_tenant", str) if hasattr(web, "RequestKey") \
    else "conductor_gateway_tenant"


def match_key(token: bytes, keys: list[str]) -> str | None:
    """The configured key `token` is, compared with every key in constant time (no early exit
    whose timing tells how much of a guess matched); None when it is none of them."""
    found = None
    for key in keys:
        if hmac.compare_digest(token, key.encode()):
            found = key
    return found


def key_id(key: str) -> str:
    """A name for a key that is safe to log and label metrics with (never the key itself)."""
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def bound_salt(key: str, caller_salt: str | None, secret: str | None = None) -> str:
    """The salt the engines key a request by: the caller's salt nested under its key."""
    mac_key = (secret or key).encode()
    # The key id is in the message too, so with a gateway secret two keys still never collide.
    message = b"cache_salt\0" + key_id(key).encode() + b"\0" + (caller_salt or "").encode()
    return SALT_PREFIX + hmac.new(mac_key, message, hashlib.sha256).hexdigest()[:32]


def bind_salt(body: dict, key: str | None, secret: str | None = None) -> bool:
    """Replace `body`'s `cache_salt` with the one bound to `key`; whether the body changed (it
    always does with a key: the engines must never see a caller's salt as is)."""
    if key is None:
        return False
    caller = body.get("cache_salt")
    if caller is not None and not isinstance(caller, str):
        raise ApiError(400, "cache_salt must be a string", param="cache_salt")
    body["cache_salt"] = bound_salt(key, caller, secret)
    return True
