"""The P/D hand-off MAC key: the deployment's shared secret, from the connector's config or from
KVSTORE_SECRET in the engine's environment (so examples need not put the secret on a command line
that `ps` shows)."""
from __future__ import annotations

from kvstore.integrations.vllm.handoff import handoff_key


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
