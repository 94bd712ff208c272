"""Which parallel layouts the connector keys exactly, and which rank a worker is.

A store block is `block_size` tokens of one rank's layers. Decode/prefill context parallelism
(DCP/PCP) interleaves each scheduler block's tokens over ranks (a block covers `block_size x dcp`
tokens, each rank holding its own shard): keyed per `block_size` tokens, loads and saves would land
at the wrong positions, so it is refused. A pipeline stage of a hybrid model may hold no layer of
some KV cache group, which the scheduler cannot see: refused too. A worker whose rank cannot be
read in a world of several ranks is refused rather than taken for rank 0 (another rank's KV).
"""
from __future__ import annotations

from typing import Any

from ...errors import UnsupportedDeployment


def world(parallel: Any) -> tuple[int, int, int, int]:
    """(tensor, pipeline, decode-context, prefill-context) parallel sizes of a ParallelConfig."""
    return (int(getattr(parallel, "tensor_parallel_size", 1)), int(getattr(parallel, "pipeline_parallel_size", 1)),
            int(getattr(parallel, "decode_context_parallel_size", 1) or 1),
            int(getattr(parallel, "prefill_context_parallel_size", 1) or 1))


def check_context_parallel(dcp: int, pcp: int) -> None:
    if dcp > 1 or pcp > 1:
        raise UnsupportedDeployment(
            f"decode_context_parallel_size={dcp}, prefill_context_parallel_size={pcp}: each KV block is then split "
            "across ranks by token, which kvstore does not key; start vLLM with --decode-context-parallel-size 1 "
            "and --prefill-context-parallel-size 1 (tensor and pipeline parallelism are supported)")


def check_hybrid_pipeline(num_groups: int, pp: int) -> None:
    if num_groups > 1 and pp > 1:
        raise UnsupportedDeployment(
            f"pipeline_parallel_size={pp} with {num_groups} KV cache groups (a hybrid model): a stage may hold no "
            "layer of a group, which the scheduler cannot see; start vLLM with --disable-hybrid-kv-cache-manager "
            "or --pipeline-parallel-size 1")


def worker_ranks(tp: int, pp: int) -> tuple[int, int]:
    """(tensor rank, pipeline rank) of this worker process, from vLLM's parallel groups."""
    if tp * pp == 1:
        return 0, 0
    try:
        from vllm.distributed import get_pp_group, get_tensor_model_parallel_rank

        tp_rank, pp_rank = int(get_tensor_model_parallel_rank()), int(get_pp_group().rank_in_group)
    except Exception as exc:  # noqa: BLE001 - any failure: never guess rank 0 (another rank's KV)
        raise UnsupportedDeployment(f"cannot read this worker's tensor/pipeline rank in a world of TP={tp} x PP={pp} "
                                    f"({type(exc).__name__}: {exc}); kvstore keys each rank's KV by its rank") from exc
    if not (0 <= tp_rank < tp and 0 <= pp_rank < pp):
        raise UnsupportedDeployment(f"worker ranks TP {tp_rank}, PP {pp_rank} outside a world of TP={tp} x PP={pp}")
    return tp_rank, pp_rank
