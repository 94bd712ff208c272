"""A single-process vLLM engine with kvstore's connector (or none): the demo's engines.

vLLM's defaults here are the CPU demo's: fp32, eager, one process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`,
so the connector's worker side lives in this process), a failed load recomputed.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm import LLM


def engine(model: str, connector: dict | None, kv_space_gib: int = 1, **engine_args) -> "LLM":
    """An engine on `model`; `connector`: None (no connector) or {"role": kv_producer | kv_consumer |
    kv_both, "extra": kv_connector_extra_config}; `engine_args` override vLLM's options below."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_space_gib))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kwargs = {}
    if connector is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KVStoreConnector", kv_connector_module_path="kvstore.integrations.vllm.connector",
            kv_role=connector.get("role", "kv_both"), kv_connector_extra_config=connector.get("extra", {}),
            kv_load_failure_policy="recompute")  # a failed load costs a recompute, never a failed request
    options = dict(dtype="float32", enforce_eager=True, max_model_len=4096, max_num_seqs=4, max_num_batched_tokens=4096,
                   disable_log_stats=True)
    options.update(engine_args)
    return LLM(model=model, **options, **kwargs)
