"""Who may call what on a daemon's gRPC port: store clients prove they know the cluster secret;
mutating admin calls carry the admin bearer token (when either is configured)."""
from __future__ import annotations

import hashlib
import hmac

import grpc

MUTATING = {"/kvstore.admin.v1.Admin/Evict", "/kvstore.admin.v1.Admin/Drain", "/kvstore.admin.v1.Admin/SetPolicy"}
CONTROL_PREFIX = "/kvstore.store.v1.StoreControl/"


def control_token(secret: bytes) -> str:
    """What store clients send: derived from the cluster secret, never the secret itself."""
    return "Bearer " + hmac.new(secret, b"kvstore-store-control", hashlib.sha256).hexdigest()


class AccessRules(grpc.ServerInterceptor):
    """StoreControl calls need the cluster's control token (when a secret is set); mutating Admin
    calls need the admin bearer token (when one is configured); everything else is open (the
    daemon listens on loopback unless told otherwise)."""

    def __init__(self, secret: bytes, admin_token: str | None) -> None:
        self._control = control_token(secret) if secret else None
        self._admin = f"Bearer {admin_token}" if admin_token else None

    @staticmethod
    def _deny(handler, code: grpc.StatusCode, message: str):
        def unary(request, context):
            context.abort(code, message)

        def stream(request, context):
            context.abort(code, message)
            yield  # pragma: no cover - never reached

        if handler is not None and handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(stream)
        return grpc.unary_unary_rpc_method_handler(unary)

    def intercept_service(self, continuation, details):
        sent = dict(details.invocation_metadata).get("authorization", "")
        method = details.method
        if method.startswith(CONTROL_PREFIX) and self._control and not hmac.compare_digest(sent, self._control):
            return self._deny(continuation(details), grpc.StatusCode.UNAUTHENTICATED, "missing or wrong cluster token")
        if method in MUTATING and self._admin:
            if not sent:
                return self._deny(continuation(details), grpc.StatusCode.UNAUTHENTICATED,
                                  "this call changes the cluster: send the admin bearer token")
            if not hmac.compare_digest(sent, self._admin):
                return self._deny(continuation(details), grpc.StatusCode.PERMISSION_DENIED, "wrong admin token")
        return continuation(details)
