"""Sharing bound to identity at the gateway: with API keys, the cache_salt an engine sees is derived
from the key that authenticated the request (the caller's own salt nested under it), and routing
hashes prompts under that same salt."""
from __future__ import annotations

from conductor.gateway.tenancy import bound_salt, match_key
from kvstore_testing.fake_engines import FakeEngine, Rig, completion

KEY_A, KEY_B = "sk-tenant-a-0123456789", "sk-tenant-b-0123456789"
PROMPT = list(range(64))


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


async def test_two_keys_with_the_same_prompt_and_salt_get_different_salts():
    """Kills: the client's salt forwarded as is (on the raw-bytes path too), a salt from the caller's
    salt alone, a key's salt that changes between its requests."""
    d = FakeEngine("d0")
    async with Rig([], [d], api_keys=[KEY_A, KEY_B]) as rig:
        for key in (KEY_A, KEY_B, KEY_A):
            status, _ = await rig.post("/v1/completions", completion(PROMPT, cache_salt="shared"), auth(key))
            assert status == 200
        status, _ = await rig.post("/v1/completions", completion(PROMPT), auth(KEY_B))  # no salt of its own
        assert status == 200
    a1, b, a2, b_none = (r["cache_salt"] for r in d.requests)
    assert a1 == a2 == bound_salt(KEY_A, "shared")  # one tenant shares with itself
    assert a1 != b and "shared" not in (a1, b)  # never with the other, never the caller's salt as sent
    assert b_none == bound_salt(KEY_B, None) and b_none not in (b, a1)  # a caller's salt nests under its key


async def test_routing_credits_only_the_same_tenants_prefix():
    """Routing's prefix hashing uses the bound salt: tenant B's copy of tenant A's prompt is not
    credited with A's blocks at the engine; A's own repeat is.
    Kills: routing hashing the caller's salt (or none) while the engines see the bound one."""
    d = FakeEngine("d0")
    async with Rig([], [d], api_keys=[KEY_A, KEY_B], policy="cache_local") as rig:
        async def credited(key: str) -> int:
            async with rig.http.post(rig.url + "/v1/completions", json=completion(PROMPT, cache_salt="s"),
                                     headers=auth(key)) as resp:
                assert resp.status == 200
                return int(resp.headers["X-Conductor-Credited-Tokens"])

        assert await credited(KEY_A) == 0
        assert await credited(KEY_B) == 0  # the same prompt and salt, another key: nothing of A's
        assert await credited(KEY_A) == len(PROMPT)


async def test_without_keys_the_callers_salt_goes_as_sent():
    """No identity to bind to: the caller's salt (vLLM's own semantics). Kills: a salt invented
    without a key."""
    d = FakeEngine("d0")
    async with Rig([], [d]) as rig:
        status, _ = await rig.post("/v1/completions", completion(PROMPT, cache_salt="mine"))
        assert status == 200
        status, _ = await rig.post("/v1/completions", completion(PROMPT))
        assert status == 200
    assert d.requests[0]["cache_salt"] == "mine" and "cache_salt" not in d.requests[1]


async def test_a_salt_that_is_not_a_string_is_refused():
    d = FakeEngine("d0")
    async with Rig([], [d], api_keys=[KEY_A]) as rig:
        status, body = await rig.post("/v1/completions", completion(PROMPT, cache_salt=7), auth(KEY_A))
    assert status == 400 and body["error"]["param"] == "cache_salt" and not d.requests


def test_salts_depend_on_key_secret_and_caller_salt_only():
    """Kills: a gateway secret that makes two keys' salts equal, a derivation that ignores the caller's salt."""
    assert bound_salt(KEY_A, "x") == bound_salt(KEY_A, "x")
    assert len({bound_salt(KEY_A, "x"), bound_salt(KEY_A, "y"), bound_salt(KEY_B, "x"),
                bound_salt(KEY_A, "x", "s" * 16), bound_salt(KEY_B, "x", "s" * 16)}) == 5
    assert match_key(KEY_B.encode(), [KEY_A, KEY_B]) == KEY_B and match_key(b"sk-other", [KEY_A]) is None
