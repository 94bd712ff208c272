"""The per-tier hit report a kvstore connector returns with each finished request, in its
`kv_transfer_params` under HITS_KEY: how many of the request's cached prompt tokens came from each
tier. The connector writes it (kvstore.integrations.vllm.hits) and a gateway reads it
(conductor.gateway.usage): the contract lives here, below both."""
from __future__ import annotations

HITS_KEY = "kvstore_hits"
# device: the engine's own prefix cache; host: blocks the pool holds in DRAM; disk: blocks only an
# NVMe tier holds; p2p: a P/D hand-off
TIERS = ("device", "host", "disk", "p2p")
