"""The gateway routes by the engines' fingerprint when the model dir gives it another: the digest
the engines report is their chains' root, so prompts hash to the engines' own keys."""
from __future__ import annotations

from conductor.gateway.fingerprint import engines_fingerprint
from kvstore.keys import ModelFingerprint, chain_hashes


def test_the_engines_digest_hashes_prompts_to_the_engines_keys():
    """Kills: a root other than the digest (the pool looked up under keys no engine stored)."""
    theirs = ModelFingerprint("model", "float32", 16, 2, 2, 64, revision="|config 0123abcd")
    adopted = engines_fingerprint(theirs.digest, 16)
    assert adopted is not None and adopted.digest == theirs.digest
    tokens = list(range(100))
    assert chain_hashes(adopted, tokens) == chain_hashes(theirs, tokens)


def test_only_an_untenanted_128_bit_digest_is_taken():
    assert engines_fingerprint("acme:" + "0" * 32, 16) is None  # a tenant's: its root is not its digest
    assert engines_fingerprint("xyz", 16) is None
