"""The P/D hand-off MAC key: the deployment's shared secret, from the connector's config or from
KVSTORE_SECRET in the engine's environment (so examples need not put the secret on a command line
that `ps` shows)."""
from __future__ import annotations

import time

from kvstore.integrations.vllm.handoff import MAX_AGE_S, SeenIds, handoff_key, make_params, wait_budget


def test_the_environment_secret_keys_hand_offs_like_the_same_secret_in_the_config(monkeypatch):
    """Kills: a key taken from the config only (engines given the secret by KVSTORE_SECRET sign
    nothing, and their decodes never wait for a prefill's blocks)."""
    monkeypatch.setenv("KVSTORE_SECRET", "hand-off-secret-0123456789")
    from_env = handoff_key({}, private_store=False)
    assert from_env is not None
    assert from_env == handoff_key({"secret": "hand-off-secret-0123456789"}, private_store=False)
    assert handoff_key({"secret": "another-secret-0123456789"}, private_store=False) != from_env  # the config wins


def test_no_secret_anywhere_means_unsigned_and_a_private_store_keeps_its_process_key(monkeypatch):
    monkeypatch.delenv("KVSTORE_SECRET", raising=False)
    assert handoff_key({}, private_store=False) is None
    monkeypatch.setenv("KVSTORE_SECRET", "hand-off-secret-0123456789")
    private = handoff_key({}, private_store=True)
    assert private is not None and private != handoff_key({}, private_store=False)


KEY = b"k" * 32
LAST = bytes(range(16))


def params(**kwargs) -> dict:
    return make_params(KEY, "f" * 32, [1, 2, 3], 1, 3, LAST, **kwargs)["kvstore"]


def test_only_fresh_parameters_signed_for_this_request_and_used_once_buy_a_wait():
    """The wait budget of a decode. Kills, one assertion each: no MAC check (forged, tampered),
    no age check (stale), a MAC that does not bind the request's last promised key (foreign), no
    one-time id (replayed)."""
    seen = SeenIds()
    assert wait_budget(params(), KEY, 5.0, LAST, seen) == 5.0
    forged = make_params(None, "f" * 32, [1, 2, 3], 1, 3, LAST)["kvstore"]
    assert wait_budget(forged, KEY, 5.0, LAST, seen) == 0.0
    tampered = params()
    tampered["num_tokens"] = 300
    assert wait_budget(tampered, KEY, 5.0, LAST, seen) == 0.0
    assert wait_budget(params(now=time.time() - 3600), KEY, 5.0, LAST, seen) == 0.0
    assert wait_budget(params(), KEY, 5.0, bytes(16), seen) == 0.0  # this request's key is another
    assert wait_budget(params(), KEY, 5.0, None, seen) == 0.0  # this request has no key there
    once = params()
    assert wait_budget(once, KEY, 5.0, LAST, seen) == 5.0
    assert wait_budget(once, KEY, 5.0, LAST, seen) == 0.0  # replayed


def test_one_time_ids_are_never_forgotten_inside_their_window():
    """At capacity new ids are refused; an id is forgotten only once no parameters carrying it
    can still be fresh. Kills: evicting the oldest id at capacity (it could then be replayed)."""
    seen = SeenIds(capacity=2)
    assert seen.first_use("a", now=0.0) and seen.first_use("b", now=1.0)
    assert not seen.first_use("c", now=2.0)  # full: refused, not evicting "a"
    assert not seen.first_use("a", now=3.0)
    assert seen.first_use("c", now=2 * MAX_AGE_S + 0.5)  # "a" can no longer be fresh: forgotten
    assert not seen.first_use("b", now=2 * MAX_AGE_S + 0.6)
