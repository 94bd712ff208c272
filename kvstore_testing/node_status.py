"""A daemon's own report, as tests read it: Admin.GetNodeStatus (open without the admin token),
with its tiers (name, capacity_bytes, used_bytes, blocks) and every counter it keeps."""
from __future__ import annotations

import grpc

from kvstore.admin.v1 import admin_pb2, admin_pb2_grpc


def node_status(address: str, timeout: float = 5.0) -> admin_pb2.NodeStatus:
    """The report of the daemon whose gRPC (admin) port is `address` (host:port)."""
    with grpc.insecure_channel(address) as channel:
        return admin_pb2_grpc.AdminStub(channel).GetNodeStatus(admin_pb2.NodeStatusRequest(), timeout=timeout)


def node_counters(address: str, timeout: float = 5.0) -> dict[str, float]:
    return dict(node_status(address, timeout).counters)
