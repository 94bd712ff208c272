"""Who may call what on a daemon's gRPC port: store clients prove they know the cluster secret
with a fresh token per call; mutating admin calls carry the admin bearer token (when either is
configured).

A control token is `KVS1 <client>.<time>.<nonce>.<mac>`, the MAC taken under a key derived for the
node being called, over the method, client, time and nonce. A token works once, for one method on
one node, within TOKEN_WINDOW_S of its time: one seen on the wire cannot be replayed.
"""
from __future__ import annotations

import collections
import hashlib
import hmac
import os
import threading
import time

import grpc

MUTATING = {"/kvstore.admin.v1.Admin/Evict", "/kvstore.admin.v1.Admin/Drain", "/kvstore.admin.v1.Admin/SetPolicy"}
CONTROL_PREFIX = "/kvstore.store.v1.StoreControl/"
TOKEN_SCHEME = "KVS1"
TOKEN_WINDOW_S = 60.0
_MAX_SEEN = 200_000  # nonces remembered per daemon (a window's worth of calls at a high rate)


def secret_path(cluster: str) -> str:
    """Where `kvstore serve` keeps a cluster's generated secret unless told otherwise."""
    return os.path.join(os.path.expanduser("~"), ".kvstore", f"{cluster}.secret")


def admin_token_path(cluster: str) -> str:
    """Where `kvstore serve` keeps a cluster's generated admin token (and `kvstore admin` looks for
    it) unless told otherwise."""
    return os.path.join(os.path.expanduser("~"), ".kvstore", f"{cluster}.admin-token")


def cluster_secret(cluster: str) -> str | None:
    """The secret a client uses when given none: KVSTORE_SECRET, else the file `kvstore serve`
    generated for this cluster (same user, same host), else None (insecure daemons only)."""
    return client_secret(cluster, None)[0]


def client_secret(cluster: str, given: str | None) -> tuple[str | None, str]:
    """The secret a client uses and where it came from, in words (for the one line that explains
    a mismatch with a node): `given` (the `secret=` argument; "" means none on purpose), else
    KVSTORE_SECRET, else the file `kvstore serve` generated for this cluster, else none."""
    if given is not None:
        return given or None, "the secret= argument" if given else "secret=\"\" (none on purpose)"
    if os.environ.get("KVSTORE_SECRET"):
        return os.environ["KVSTORE_SECRET"], "KVSTORE_SECRET"
    path = secret_path(cluster)
    try:
        with open(path) as f:
            secret = f.read().strip() or None
    except OSError:
        return None, f"none given: no secret=, no KVSTORE_SECRET, no {path}"
    return secret, f"the file {path}, left by an earlier `kvstore serve`"


def node_key(secret: bytes, node: str) -> bytes:
    """The key for calls to `node`: a token for one node proves nothing to another."""
    return hmac.new(secret, b"kvstore-store-control/" + node.encode(), hashlib.sha256).digest()


def _mac(key: bytes, method: str, client: str, stamp: str, nonce: str) -> str:
    return hmac.new(key, f"{method}|{client}|{stamp}|{nonce}".encode(), hashlib.sha256).hexdigest()


def control_token(secret: bytes, node: str, method: str, client: str, now: float | None = None) -> str:
    """A one-time token for calling `method` on `node`; never contains the secret."""
    stamp, nonce = f"{time.time() if now is None else now:.3f}", os.urandom(12).hex()
    client = client.replace(".", "_")[:64]
    return f"{TOKEN_SCHEME} {client}.{stamp}.{nonce}.{_mac(node_key(secret, node), method, client, stamp, nonce)}"


class _ClientCallDetails(collections.namedtuple(
        "_ClientCallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")),
        grpc.ClientCallDetails):
    pass


class ControlAuth(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Client side: adds a fresh control token to every call on a channel to `node`."""

    def __init__(self, secret: bytes, node: str, client: str) -> None:
        self._secret, self._node, self._client = secret, node, client

    def _details(self, details):
        metadata = [(k, v) for k, v in (details.metadata or []) if k != "authorization"]
        metadata.append(("authorization", control_token(self._secret, self._node, details.method, self._client)))
        return _ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                  getattr(details, "wait_for_ready", None), getattr(details, "compression", None))

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)


class TokenCheck:
    """Server side: accepts each valid control token once."""

    def __init__(self, secret: bytes, node: str) -> None:
        self._key = node_key(secret, node)
        self._seen: collections.OrderedDict[str, float] = collections.OrderedDict()
        self._lock = threading.Lock()

    def verify(self, token: str, method: str, now: float | None = None) -> str | None:
        """None when the token is good for this call, else why not."""
        now = time.time() if now is None else now
        scheme, _, body = token.partition(" ")
        parts = body.split(".")
        if scheme != TOKEN_SCHEME or len(parts) != 5:
            return "missing or malformed cluster token"
        client, whole, frac, nonce, mac = parts
        stamp = f"{whole}.{frac}"
        try:
            at = float(stamp)
        except ValueError:
            return "malformed cluster token"
        if not hmac.compare_digest(_mac(self._key, method, client, stamp, nonce), mac):
            return "wrong cluster token (wrong secret, node or method)"
        if abs(now - at) > TOKEN_WINDOW_S:
            return "expired cluster token (check the clocks)"
        with self._lock:
            while self._seen and (len(self._seen) >= _MAX_SEEN or next(iter(self._seen.values())) < now - 2 * TOKEN_WINDOW_S):
                self._seen.popitem(last=False)
            if mac in self._seen:
                return "replayed cluster token"
            self._seen[mac] = now
        return None


class AccessRules(grpc.ServerInterceptor):
    """StoreControl calls need the cluster's control token (when a secret is set); mutating Admin
    calls need the admin bearer token (when one is configured); everything else is open (the
    daemon listens on loopback unless told otherwise)."""

    def __init__(self, secret: bytes, admin_token: str | None, node: str) -> None:
        self._control = TokenCheck(secret, node) if secret else None
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
        if method.startswith(CONTROL_PREFIX) and self._control:
            why = self._control.verify(sent, method)
            if why is not None:
                return self._deny(continuation(details), grpc.StatusCode.UNAUTHENTICATED, why)
        if method in MUTATING and self._admin:
            if not sent:
                return self._deny(continuation(details), grpc.StatusCode.UNAUTHENTICATED,
                                  "this call changes the cluster: send the admin bearer token")
            if not hmac.compare_digest(sent, self._admin):
                return self._deny(continuation(details), grpc.StatusCode.PERMISSION_DENIED, "wrong admin token")
        return continuation(details)
