"""A tenant's fingerprints are named `tenant:hash`, so a daemon can tell whose a fingerprint is from
its name alone; untenanted fingerprints keep the digests they always had (index keys, the vLLM
connector's and the gateway's routing fingerprint all read `digest`)."""
from __future__ import annotations

import pytest
import xxhash

from kvstore.errors import InvalidFingerprint
from kvstore.index.records import NAME
from kvstore.keys import FINGERPRINT_DIGEST, ModelFingerprint, fingerprint_tenant

FIELDS = dict(model_id="m", dtype="float16", block_size=16, num_layers=2, num_kv_heads=2, head_size=64)


def test_an_untenanted_digest_is_unchanged():
    fp = ModelFingerprint(**FIELDS)
    assert fp.digest == xxhash.xxh3_128_hexdigest(fp.canonical()) and len(fp.digest) == 32
    assert fingerprint_tenant(fp.digest) == ""


def test_a_tenants_digest_names_the_tenant_and_fits_the_index_name_rule():
    """Kills: a tenant's fingerprint named like anyone's: the daemon could not tell it is acme's."""
    fp = ModelFingerprint(**FIELDS, tenant="acme.team-2")
    tenant, _, digest = fp.digest.partition(":")
    assert tenant == "acme.team-2" and digest == xxhash.xxh3_128_hexdigest(fp.canonical())
    assert fingerprint_tenant(fp.digest) == "acme.team-2"
    assert NAME.fullmatch(fp.digest) and FINGERPRINT_DIGEST.fullmatch(fp.digest)
    longest = ModelFingerprint(**FIELDS, tenant="t" * 64)
    assert NAME.fullmatch(longest.digest) and len(longest.digest) <= 128
    assert fp.root_hash() != ModelFingerprint(**FIELDS, tenant="beta").root_hash()


@pytest.mark.parametrize("tenant", ["a b", "a/b", "a:b", "-a", "t" * 65, "é"])
def test_a_tenant_that_cannot_name_a_namespace_is_refused(tenant):
    with pytest.raises(InvalidFingerprint, match="tenant"):
        ModelFingerprint(**FIELDS, tenant=tenant)


def test_admin_takes_a_tenants_fingerprint_digest():
    """Kills: `kvstore admin blocks/query/evict --fingerprint` refusing every tenant's digest."""
    import argparse

    from kvstore.admin.cli import fingerprint_arg

    digest = ModelFingerprint(**FIELDS, tenant="acme").digest
    assert fingerprint_arg(digest) == digest and fingerprint_arg("0" * 32) == "0" * 32
    for bad in ("acme:" + "0" * 31, "a b:" + "0" * 32, "0" * 33):
        with pytest.raises(argparse.ArgumentTypeError):
            fingerprint_arg(bad)
