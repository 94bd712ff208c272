"""The store client: put, get and match KV blocks across a cluster's nodes.

`client.py` is the `Client` itself; beside it are the parts it is made of: where a put goes
(`placement`), slots a node leased for the next put (`leases`), where a get's bytes land and
whether they are right (`reads`), batched hit reports (`reports`), a node's gRPC channel that
closes only when idle (`channel_guard`) and the same-host node over the framed wire (`local_node`).
"""
from .client import AsyncClient, Client, PutResult

__all__ = ["AsyncClient", "Client", "PutResult"]
