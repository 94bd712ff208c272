"""Store keys of kvstore's tier of vLLM's OffloadingConnector (offload_keys) and the deployments
the tier refuses at start-up (offload_tier): a chunk is shared only between engines whose weights,
engine fingerprint and chunk geometry are all equal, and the same on every process."""
from __future__ import annotations

import dataclasses
import subprocess
import sys
from types import SimpleNamespace

import pytest

from kvstore.errors import UnsupportedDeployment
from kvstore.integrations.vllm.offload_keys import ChunkGeometry, chunk_fingerprint, chunk_hash
from kvstore.keys import ModelFingerprint

BASE = ModelFingerprint("/models/tiny", "float32", block_size=128, num_layers=2, num_kv_heads=2, head_size=64,
                        kv_layout="vllm-paged:cpu", revision="|config 0123")
GEOMETRY = ChunkGeometry(chunk_bytes=262144, blocks_per_chunk=1, tokens_per_block=(128,),
                         group_layers=(("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"),),
                         worker_kv_bytes_per_block=262144, hash_algo="sha256")
WEIGHTS = "files 00112233445566778899aabbccddeeff"
OFFLOAD_KEY = bytes(range(32)) + (0).to_bytes(4, "big")  # vLLM's block hash + group index 0


def key(base: ModelFingerprint = BASE, weights: str = WEIGHTS, geometry: ChunkGeometry = GEOMETRY,
        offload_key: bytes = OFFLOAD_KEY) -> tuple[str, bytes]:
    fp = chunk_fingerprint(base, weights, geometry)
    return fp.digest, chunk_hash(fp, offload_key)


def test_other_weights_never_share_a_chunk_key():
    """The same OffloadKey under other weights (a fine-tune at the same path) is another store
    key, in another fingerprint namespace. Kills: a tier keyed by vLLM's OffloadKey alone, or by
    the engine's fingerprint without the weights' identity."""
    digest, h = key()
    other_digest, other_h = key(weights="files ffeeddccbbaa99887766554433221100")
    assert digest != other_digest and h != other_h


@pytest.mark.parametrize("change", [
    {"chunk_bytes": 2 * 262144}, {"blocks_per_chunk": 2}, {"tokens_per_block": (64,)},
    {"group_layers": (("model.layers.0.self_attn.attn",),)}, {"worker_kv_bytes_per_block": 131072},
    {"hash_algo": "xxhash"}])
def test_every_part_of_the_chunk_geometry_keys_the_chunk(change):
    """Engines whose CPU-tier chunks differ in size or arrangement (bytes per chunk, blocks per
    chunk, tokens per block, the groups' layers, the block-hash algorithm) never share a key.
    Kills: a key without the chunk geometry (a chunk of 2 blocks read as a chunk of one)."""
    assert key(geometry=dataclasses.replace(GEOMETRY, **change)) != key()


@pytest.mark.parametrize("change", [
    {"dtype": "bfloat16"}, {"kv_layout": "vllm-paged:cuda:NHD"}, {"revision": "|config 4567"},
    {"model_id": "/models/other"}, {"tp_world_size": 2}, {"cache_salt": "tenant-a"}])
def test_the_engines_fingerprint_keys_the_chunk(change):
    """The engine's own fingerprint (dtype, KV layout, config digest, model, parallelism, salt)
    is part of the key. Kills: a key built from vLLM's OffloadingConfig (model name and dtype)
    alone, under which engines with other configs or layouts share chunks."""
    assert key(base=dataclasses.replace(BASE, **change)) != key()


def test_the_group_index_and_block_hash_key_the_chunk():
    """Kills: a store hash that drops part of vLLM's OffloadKey (e.g. its group index)."""
    other_group = OFFLOAD_KEY[:-4] + (1).to_bytes(4, "big")
    other_block = bytes([255]) + OFFLOAD_KEY[1:]
    assert len({key()[1], key(offload_key=other_group)[1], key(offload_key=other_block)[1]}) == 3


def test_another_process_derives_the_same_key():
    """Two engines must agree on every byte of the key. Kills: a key that folds in anything
    seeded per process (Python's hash(), a random nonce)."""
    code = ("from tests.unit.test_offload_keys import key; d, h = key(); print(d, h.hex())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123", "PATH": ""}, cwd=str(__import__("pathlib").Path(__file__).parents[2]))
    digest, h = key()
    assert out.stdout.split() == [digest, h.hex()]


def test_a_chunk_key_needs_the_weights_identity():
    with pytest.raises(ValueError, match="weights"):
        chunk_fingerprint(BASE, "", GEOMETRY)


def spec(world_size: int = 1, canonical: bool = False) -> SimpleNamespace:
    parallel = SimpleNamespace(world_size=world_size, tp_size=world_size, pp_size=1, pcp_size=1, dcp_size=1)
    return SimpleNamespace(config=SimpleNamespace(parallel=parallel, canonical_layout=canonical))


def vllm_config(lora: bool = False, multimodal: bool = False, embeds: bool = False) -> SimpleNamespace:
    return SimpleNamespace(lora_config=object() if lora else None,
                           model_config=SimpleNamespace(is_multimodal_model=multimodal, enable_prompt_embeds=embeds),
                           cache_config=SimpleNamespace(cache_dtype="auto"))


@pytest.mark.parametrize("engine, tier_spec, says", [
    (vllm_config(), spec(world_size=2), "tensor_parallel_size=pipeline_parallel_size=1"),
    (vllm_config(), spec(canonical=True), "remove canonical_layout"),
    (vllm_config(lora=True), spec(), "enable_lora"),
    (vllm_config(multimodal=True), spec(), "multi_modal_uuids"),
    (vllm_config(embeds=True), spec(), "multi_modal_uuids"),
])
def test_deployments_the_tier_cannot_key_are_refused_saying_what_to_set(engine, tier_spec, says):
    """A chunk row of a TP/PP engine holds every rank's pages, a canonical layout is another
    format, vLLM names an adapter, not its weights, and a multimodal item (or prompt embedding) by
    an identifier a client may reuse: each is refused at start-up with what to set. Kills: a tier
    that starts anyway and shares chunks it cannot key."""
    from kvstore.integrations.vllm.offload_tier import check_supported

    with pytest.raises(UnsupportedDeployment, match=says):
        check_supported(engine, tier_spec)
    check_supported(vllm_config(), spec())  # one worker, direct layout, no adapters: served


def test_the_tier_takes_its_own_engines_config_or_refuses():
    """The tier reads the VllmConfig of the engine that builds it from its caller (vLLM's
    connector), matched by engine id, and refuses without it. Kills: a tier that takes any
    VllmConfig it finds (another engine's in the same process) or starts without one."""
    from vllm.config import VllmConfig

    from kvstore.integrations.vllm.offload_tier import engine_config

    def config_of(engine_id: str) -> VllmConfig:
        config = VllmConfig.__new__(VllmConfig)
        object.__setattr__(config, "kv_transfer_config", SimpleNamespace(engine_id=engine_id))
        return config

    def connector(vllm_config: VllmConfig, engine_id: str):  # as vLLM's builds the tier: a few calls down
        return engine_config(engine_id)

    with pytest.raises(UnsupportedDeployment, match="KVStoreConnector"):
        engine_config("engine-a")  # no caller holds a config
    with pytest.raises(UnsupportedDeployment, match="KVStoreConnector"):
        connector(config_of("engine-b"), "engine-a")
    mine = config_of("engine-a")
    assert connector(mine, "engine-a") is mine


@pytest.mark.parametrize("algo, settings, refused", [
    ("sha256", {}, False), ("xxhash", {}, True), ("xxhash_cbor", {"trust_noncrypto_hashes": "false"}, True),
    ("xxhash", {"trust_noncrypto_hashes": True}, False),
])
def test_block_hashes_a_client_can_collide_are_refused_unless_trusted(algo, settings, refused):
    """A chunk in the shared pool is named by vLLM's block hash; with xxhash a client can craft a
    prompt whose blocks collide with another's and plant KV every engine of the tenant loads.
    Kills: a tier that takes xxhash without the operator's explicit trust (or reads "false" as yes)."""
    from kvstore.integrations.vllm.offload_tier import check_block_hashes

    engine = SimpleNamespace(cache_config=SimpleNamespace(prefix_caching_hash_algo=algo))
    if refused:
        with pytest.raises(UnsupportedDeployment, match="sha256"):
            check_block_hashes(engine, settings)
    else:
        check_block_hashes(engine, settings)
