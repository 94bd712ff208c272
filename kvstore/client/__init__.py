"""The store client: put, get and match KV blocks across a cluster's nodes.

`client.py` is the `Client` itself, a thin face over its parts: the put pipeline (`put_path`:
place -> reserve/lease -> write -> commit -> learn) and what it returns (`results`: a count, or one
`KeyPut` per key), the read pipeline (`read_path`: locate -> land -> read -> recheck -> report) and
one node's reads (`node_reads`), the connections to nodes (`links`), where a put goes
(`placement`), slots a node leased for the next put (`leases`), where a get's bytes land and
whether they are right (`reads`), batched hit reports (`reports`) and a node's framed control
wire, the one protocol of the store operations (`local_node`: its unix socket on this host, TCP or
TLS from elsewhere).
"""
from .client import AsyncClient, Client
from .results import KeyPut, PutResult

__all__ = ["AsyncClient", "Client", "KeyPut", "PutResult"]
