"""The connector's settings, read once from vLLM's config and `kv_connector_extra_config`, and
checked: what the scheduler side and the worker side share (kvstore.integrations.vllm.connector).
A deployment kvstore cannot serve exactly is refused here, at start-up, with what to set."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from ...client import Client
from ...keys import ModelFingerprint
from .fingerprint import all_rank_fingerprints, check_kv_scales, fingerprint_from_vllm, group_fingerprints, uses_mla
from .groups import FULL, SLIDING, SUPPORTED, CacheGroup, check_groups
from .handoff import handoff_key
from .parallel import check_context_parallel, check_hybrid_pipeline, world, worker_ranks
from .store import check_deployment, is_private, store_for


@dataclass
class ConnectorSettings:
    """Everything both sides of one engine's connector read (see connector_settings)."""

    role: Any
    vllm_config: Any
    kv_cache_config: Any
    extra: dict[str, Any]
    block_size: int
    kv_role: str
    groups: list[CacheGroup]
    num_blocks: int
    mla: bool
    fingerprint: ModelFingerprint  # this rank's (the scheduler: rank 0's)
    group_fingerprints: list[ModelFingerprint]  # one per KV cache group: the store namespaces
    rank_group_fingerprints: list[list[ModelFingerprint]]  # every rank's, per group: what "stored" means
    saves_here: bool  # MLA's latent cache is the same on every TP rank: rank 0 stores the one copy
    store: Client
    private_store: bool  # embedded or memory://: private to this process
    process_local: bool  # the P/D pair shares this process (the demo)
    handoff_key: bytes | None  # MAC key of P/D hand-off parameters
    save_enabled: bool
    load_enabled: bool
    remote_wait_s: float  # how long a decode waits for a hand-off's blocks still being written
    # Loads of up to this many blocks run inside the step (no scheduler round trip); larger ones run
    # asynchronously while other requests keep going. With several KV cache groups every load is
    # asynchronous (-1): vLLM can take an in-step load's failure per block only for one group.
    sync_load_blocks: int
    # In-step loads of at least this many blocks (0: never) go layer by layer on a thread. Off by
    # default: on CPU caches the copy competes with the forward for the same cores.
    layerwise_load_blocks: int
    layer_load_timeout_s: float | None  # a layer's wait before the step's loads fail (None: the store's)
    # The prompt's trailing partial block is saved too, so the same prompt again (a retry, a P/D
    # decode) recomputes one token instead of up to block_size - 1.
    partial_blocks: bool
    save_queue_bytes: int  # offload saves queued beyond this are dropped


def connector_settings(vllm_config: Any, kv_transfer_config: Any, kv_cache_config: Any,
                       role: Any) -> ConnectorSettings:
    """Read and check the settings; UnsupportedDeployment for what kvstore cannot serve exactly."""
    extra = dict(kv_transfer_config.kv_connector_extra_config or {})
    block_size = int(vllm_config.cache_config.block_size)
    kv_role = str(kv_transfer_config.kv_role)
    tp, pp, dcp, pcp = world(vllm_config.parallel_config)
    check_context_parallel(dcp, pcp)
    check_deployment(extra, tp * pp, kv_role)
    check_kv_scales(vllm_config)
    groups = cache_groups(kv_cache_config, block_size)
    check_hybrid_pipeline(len(groups), pp)
    mla = uses_mla(vllm_config)
    tp_rank, pp_rank = (0, 0) if role != KVConnectorRole.WORKER else worker_ranks(tp, pp)
    fingerprint = fingerprint_from_vllm(vllm_config, tp_rank, extra, pp_rank)
    private = is_private(extra)
    multi = len(groups) > 1
    own = group_fingerprints(fingerprint, groups)
    ranks = [group_fingerprints(fp, groups) for fp in all_rank_fingerprints(vllm_config, extra)]
    looked_up = {fp.digest for fps in (own, *ranks) for fp in fps}  # all this engine's client mirrors
    return ConnectorSettings(
        role=role, vllm_config=vllm_config, kv_cache_config=kv_cache_config, extra=extra, block_size=block_size,
        kv_role=kv_role, groups=groups, num_blocks=int(getattr(kv_cache_config, "num_blocks", 0) or 0), mla=mla,
        fingerprint=fingerprint, group_fingerprints=own, rank_group_fingerprints=ranks,
        saves_here=not (mla and tp_rank > 0), store=store_for(extra, looked_up), private_store=private,
        process_local=bool(extra.get("process_local")), handoff_key=handoff_key(extra, private),
        save_enabled=bool(extra.get("save", kv_role in ("kv_both", "kv_producer"))),
        load_enabled=bool(extra.get("load", True)), remote_wait_s=float(extra.get("remote_wait_s", 5.0)),
        sync_load_blocks=-1 if multi else int(extra.get("sync_load_blocks", 64)),
        layerwise_load_blocks=0 if multi else int(extra.get("layerwise_load_blocks", 0)),
        layer_load_timeout_s=extra.get("layer_load_timeout_s"),
        partial_blocks=bool(extra.get("partial_blocks", True)),
        save_queue_bytes=int(float(extra.get("save_queue_mib", 256)) * (1 << 20)))


class ConnectorSide:
    """One side of the connector: the settings, as attributes."""

    def __init__(self, settings: ConnectorSettings) -> None:
        self.settings = settings
        for name in ConnectorSettings.__dataclass_fields__:
            setattr(self, name, getattr(settings, name))


def cache_groups(kv_cache_config: Any, block_size: int) -> list[CacheGroup]:
    """vLLM's KV cache groups, each classified by vLLM's own spec kind; unsupported ones refused."""
    if kv_cache_config is None or not getattr(kv_cache_config, "kv_cache_groups", None):
        return [CacheGroup(0, FULL, (), block_size)]
    from vllm.v1.kv_cache_interface import (get_kv_cache_spec_kind, get_kv_cache_spec_sliding_window,
                                            iter_layer_specs)

    transfer = set(getattr(kv_cache_config, "transfer_group_ids", range(len(kv_cache_config.kv_cache_groups))))
    groups, unsupported = [], {}
    for index, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        kind = get_kv_cache_spec_kind(spec).value
        if kind not in SUPPORTED:
            unsupported[index] = kind
        elif index not in transfer:
            unsupported[index] = f"{kind} excluded from KV transfer"
        window = get_kv_cache_spec_sliding_window(spec) if kind == SLIDING else None
        retained = max((int(getattr(s, "extra_retained_tokens", 0) or 0) for s in iter_layer_specs(spec)),
                       default=0)
        groups.append(CacheGroup(index, kind, tuple(group.layer_names), int(spec.block_size), window, retained))
    check_groups(groups, unsupported, block_size)
    return groups
