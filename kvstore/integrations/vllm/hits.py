"""Where each request's cached prompt tokens came from, as the engine's answer reports them.

vLLM counts a request's cached tokens once, when it is first scheduled: its own prefix cache
(device) plus what the connector loads (`PrefillStats`); that sum is the `cached_tokens` of its
`usage.prompt_tokens_details`. The connector records the same two numbers at the same moment, with
its part split by tier (host: blocks the pool holds in DRAM; disk: blocks only an NVMe tier holds;
p2p: a P/D hand-off), and returns them in the finished request's `kv_transfer_params` under
HITS_KEY, so a gateway can report the split of exactly the number vLLM reports.
"""
from __future__ import annotations

from ...hits import HITS_KEY, TIERS  # the report's contract, shared with the gateway

__all__ = ["HITS_KEY", "TIERS", "RequestHits"]


class RequestHits:
    """Per request id: device tokens, then the connector's tokens by tier, fixed at first admission."""

    def __init__(self) -> None:
        self._local: dict[str, int] = {}  # vLLM's own prefix-cache hit at the latest lookup
        self._hits: dict[str, dict[str, int]] = {}

    def looked_up(self, request_id: str, local_tokens: int) -> None:
        if request_id not in self._hits:
            self._local[request_id] = local_tokens

    def admitted(self, request_id: str, preempted: bool) -> None:
        """The request got its blocks: the lookup that counts is the last one (vLLM's too). A
        resumed request keeps its first count, as vLLM's statistics do."""
        local = self._local.pop(request_id, 0)
        if request_id not in self._hits and not preempted:
            self._hits[request_id] = {"device": local}

    def sources(self, request_id: str, by_tier: dict[str, int]) -> None:
        hits = self._hits.get(request_id)
        if hits is not None:
            for tier, tokens in by_tier.items():
                hits[tier] = hits.get(tier, 0) + tokens

    def finished(self, request_id: str) -> dict[str, int] | None:
        self._local.pop(request_id, None)
        hits = self._hits.pop(request_id, None)
        return None if hits is None else {tier: int(hits.get(tier, 0)) for tier in TIERS}
