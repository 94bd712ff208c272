"""Block keys: deterministic everywhere, and bound to everything that makes KV interchangeable."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from kvstore.errors import FingerprintMismatch, InvalidFingerprint, InvalidTokens
from kvstore.keys import ModelFingerprint, chain_hashes, external_hashes, tail_hash

FP = ModelFingerprint("tiny-llama", "float32", 16, 2, 2, 64, tokenizer_id="bpe-512")

SCRIPT = """
import json, sys
from kvstore.keys import ModelFingerprint, chain_hashes, external_hashes
fp = ModelFingerprint("tiny-llama", "float32", 16, 2, 2, 64, tokenizer_id="bpe-512")
tokens = list(range(1000, 1100)) + [7] * 37
print(json.dumps({"fp": fp.digest, "chain": [h.hex() for h in chain_hashes(fp, tokens)],
                  "ext": [h.hex() for h in external_hashes([0, 5, b"vllm-hash", "x"], fp)],
                  "seed_probe": hash("randomised per process")}))
"""


def test_keys_identical_across_processes_and_hash_seeds():
    outputs = []
    for seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, check=True)
        outputs.append(json.loads(done.stdout))
    assert outputs[0]["seed_probe"] != outputs[1]["seed_probe"]  # the seeds really differed
    for field in ("fp", "chain", "ext"):
        assert outputs[0][field] == outputs[1][field]
    tokens = list(range(1000, 1100)) + [7] * 37
    assert [h.hex() for h in chain_hashes(FP, tokens)] == outputs[0]["chain"]  # and in this process


def test_chain_covers_full_blocks_and_shares_prefixes():
    a = chain_hashes(FP, list(range(40)))
    assert len(a) == 2  # 40 tokens = 2 full blocks of 16; the partial one is never keyed
    b = chain_hashes(FP, list(range(32)) + [999] * 16)
    assert a[:2] == b[:2] and len(b) == 3
    c = chain_hashes(FP, [5] + list(range(1, 32)))
    assert c[0] != a[0] and c[1] != a[1]  # a change in block 0 changes every later key
    assert chain_hashes(FP, list(range(16, 32)), parent=a[0]) == [a[1]]
    assert chain_hashes(FP, np.arange(32, dtype=np.int64)) == a  # numpy input, same keys
    assert all(len(h) == 16 for h in a)


def test_fingerprint_binds_every_field():
    base = chain_hashes(FP, list(range(16)))
    for change in ({"dtype": "bfloat16"}, {"block_size": 16, "tp_rank": 1, "tp_world_size": 2},
                   {"cache_salt": "tenant-secret"}, {"adapter_id": "lora-1"}, {"revision": "v2"},
                   {"kv_layout": "NHD"}, {"tenant": "acme"}):
        other = dataclasses.replace(FP, **change)
        assert other.digest != FP.digest
        assert chain_hashes(other, list(range(16))) != base
        with pytest.raises(FingerprintMismatch) as info:
            FP.check_compatible(other)
        assert set(info.value.differences) == {k for k, v in change.items() if getattr(FP, k) != v}
    FP.check_compatible(dataclasses.replace(FP))


def test_bad_fingerprints_and_tokens_are_refused():
    with pytest.raises(InvalidFingerprint):
        ModelFingerprint("m", "float16", 0, 2, 2, 64)
    with pytest.raises(InvalidFingerprint):
        ModelFingerprint("m", "float16", 16, 2, 2, "64")  # type: ignore[arg-type]
    with pytest.raises(InvalidFingerprint):
        ModelFingerprint("m", "float16", 16, 2, 2, 64, tp_rank=2, tp_world_size=2)
    with pytest.raises(InvalidTokens):
        chain_hashes(FP, [1, -2, 3])
    with pytest.raises(InvalidTokens):
        chain_hashes(FP, [1.5, 2.0])
    with pytest.raises(InvalidTokens):
        chain_hashes(FP, [2**33])
    with pytest.raises(InvalidTokens):
        external_hashes([None])  # type: ignore[list-item]


def test_external_chains_are_salted_by_fingerprint():
    other = dataclasses.replace(FP, model_id="other")
    assert external_hashes([0, 1], FP) != external_hashes([0, 1], other)
    assert external_hashes([0, 1], FP) == external_hashes([0, 1], FP)
    assert len(set(external_hashes(range(1000), FP))) == 1000


def test_a_partial_block_is_keyed_behind_its_exact_prefix_and_never_as_a_full_block():
    tokens = list(range(1000, 1000 + 2 * 16 + 5))
    full = chain_hashes(FP, tokens)
    tail = tail_hash(FP, tokens[32:], full[-1])
    assert tail == tail_hash(FP, np.array(tokens[32:]), full[-1])  # deterministic, any sequence type
    assert tail not in full and len(tail) == 16
    assert tail != tail_hash(FP, tokens[32:-1], full[-1])  # one token fewer: another block
    assert tail != tail_hash(FP, tokens[32:], full[0])  # another prefix: another block
    assert tail != tail_hash(FP, tokens[32:], full[-1], extra=b"lora-7")  # extra keys count
    assert tail_hash(FP, tokens[:5]) == tail_hash(FP, tokens[:5], None)  # a prompt shorter than a block
    # 15 tokens + nothing vs a full block of 16 is never the same key, whatever the tokens.
    assert tail_hash(FP, tokens[:15]) != chain_hashes(FP, tokens[:16])[0]
    for bad in ([], tokens[:16]):
        with pytest.raises(InvalidTokens):
            tail_hash(FP, bad)
