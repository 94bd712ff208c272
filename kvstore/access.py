"""Who may call what on a daemon's gRPC port: store clients prove they know the cluster secret (or
their tenant's) with a fresh token per call, bound to the call's request body; admin calls that
change the cluster or list its blocks carry the admin bearer token (when one is configured).

A control token is `KVS2 <client>.<time>.<nonce>.<mac>[.<tenant>]`, the MAC taken under a key
derived for the node being called from the cluster secret (or the tenant's own secret), over the
method, tenant, client, time, nonce and a BLAKE3 hash of the serialized request. A token works
once, for one method with one request body on one node, within TOKEN_WINDOW_S of its time: one
seen on the wire can neither be replayed nor carry another request.

Tenants: a daemon given a tenants file (`load_tenants`) also takes tokens made with a tenant's
secret; such a call may only name fingerprints of that tenant (`kvstore.keys.fingerprint_tenant`),
else PERMISSION_DENIED. The cluster secret's holder is the operator, trusted with everything.

Secret files (cluster secret, admin token, tenants) are refused when group or others may read
them, or when they hold fewer than MIN_SECRET_BYTES (`read_private_file`).
"""
from __future__ import annotations

import collections
import contextvars
import hashlib
import hmac
import os
import stat
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

import blake3
import grpc

from transfer.auth import TENANT_NAME, TENANT_RULE

from .errors import InsecureFile
from .keys import fingerprint_tenant

MUTATING = {"/kvstore.admin.v1.Admin/Evict", "/kvstore.admin.v1.Admin/Drain", "/kvstore.admin.v1.Admin/SetPolicy"}
# Admin calls that answer with block hashes and digests: the admin token too. GetNodeStatus and
# ClusterStatus stay open: they carry the counters /metrics serves without authentication.
LISTING = {"/kvstore.admin.v1.Admin/ListBlocks", "/kvstore.admin.v1.Admin/Query"}
CONTROL_PREFIX = "/kvstore.store.v1.StoreControl/"
# StoreControl calls whose request names a fingerprint: a tenant may name only its own.
SCOPED = {CONTROL_PREFIX + m for m in ("Reserve", "Commit", "Put", "Touch", "Remove", "Lookup")}
TOKEN_SCHEME = "KVS2"
TOKEN_WINDOW_S = 60.0
MIN_SECRET_BYTES = 16
# Tokens remembered per daemon: every token seen inside its window is kept (forgetting one would let
# it be replayed); at this many, new tokens are refused until old ones leave the window.
_MAX_SEEN = 1_000_000
_tenant: contextvars.ContextVar[str] = contextvars.ContextVar("kvstore_tenant", default="")


def secret_path(cluster: str) -> str:
    """Where `kvstore serve` keeps a cluster's generated secret unless told otherwise."""
    return os.path.join(os.path.expanduser("~"), ".kvstore", f"{cluster}.secret")


def admin_token_path(cluster: str) -> str:
    """Where `kvstore serve` keeps a cluster's generated admin token (and `kvstore admin` looks for
    it) unless told otherwise."""
    return os.path.join(os.path.expanduser("~"), ".kvstore", f"{cluster}.admin-token")


def check_private_file(path: str, what: str) -> None:
    """Raise InsecureFile (one line saying how to fix it) when group or others have any access to
    the file at `path`: a secret others can read is no secret, one they can write is theirs."""
    mode = stat.S_IMODE(os.stat(path).st_mode)
    if mode & 0o077:
        raise InsecureFile(f"{what} file {path} is open to group or others (mode {mode:04o}): run `chmod 600 {path}`")


def ensure_private_file(path: str, what: str, how: str, announce: str | None = "kvstore serve") -> tuple[str, bool]:
    """(content, created): the file's content, or a fresh random value written to a new 0600
    file (its folder made 0700) when there is none, said on stderr as `announce` (None: quietly).
    InsecureFile (a ValueError, in one line saying how to fix it) when it exists but group or
    others may read it, or it holds under 16 bytes."""
    import secrets
    import sys
    import tempfile

    if os.path.exists(path):
        return read_private_file(path, what), False
    value = secrets.token_urlsafe(32)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, mode=0o700, exist_ok=True)
    # Written whole under a private name, then linked into place: link() fails if the path exists,
    # so of processes starting at once (a cluster's daemons) one creates it and the others read a
    # complete file, never one still empty.
    fd, staged = tempfile.mkstemp(dir=folder, prefix=".staging-", text=True)  # 0600
    try:
        with os.fdopen(fd, "w") as f:
            f.write(value + "\n")
        try:
            os.link(staged, path)
        except FileExistsError:
            return read_private_file(path, what), False
        except OSError:  # a file system without hard links: create it in place (0600)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                return read_private_file(path, what), False
            with os.fdopen(fd, "w") as f:
                f.write(value + "\n")
    finally:
        os.unlink(staged)
    if announce:
        print(f"{announce}: generated {what} in {path} (mode 0600); {how}", file=sys.stderr)
    return value, True


def read_private_file(path: str, what: str, *, check_length: bool = True) -> str:
    """The stripped content of a secret file; InsecureFile when its mode lets group or others in,
    or (`check_length`) it holds fewer than MIN_SECRET_BYTES. OSError when it cannot be read."""
    check_private_file(path, what)
    with open(path) as f:
        value = f.read().strip()
    if check_length and len(value.encode()) < MIN_SECRET_BYTES:
        raise InsecureFile(f"{what} file {path} holds {len(value.encode())} bytes, fewer than {MIN_SECRET_BYTES}: "
                           f"regenerate it (e.g. `openssl rand -base64 32 > {path}`, or delete it and let "
                           "`kvstore serve` make one)")
    return value


@dataclass(frozen=True)
class TenantLimits:
    """What one tenant may hold of a node (options on its line of the tenants file)."""

    # A share of each tier's capacity (0 < share <= 1): blocks of other tenants never make room for
    # this tenant's while it holds more, and this tenant's blocks are never evicted for another's
    # while it holds less (kvstore.daemon.store). None: no share (its blocks are evicted in order).
    capacity: float | None = None
    # Authenticated connections it may hold on each of a node's control-wire sockets (unix, TCP).
    # None: the default, an equal share (kvstore.daemon.local).
    connections: int | None = None


class Tenants(dict):
    """A tenants file: name -> secret (a dict, as every handshake and token check takes it), with
    each tenant's `limits`."""

    def __init__(self, secrets: Mapping[str, bytes] | None = None,
                 limits: Mapping[str, TenantLimits] | None = None) -> None:
        super().__init__(secrets or {})
        self.limits: dict[str, TenantLimits] = dict(limits or {})

    def capacity_share(self, name: str) -> float | None:
        limits = self.limits.get(name)
        return None if limits is None else limits.capacity

    def connections(self, name: str, total: int) -> int:
        """Connections `name` may hold of a socket's `total`: its own setting, else an equal share
        with one share left over for the cluster's own clients (a tenant's would otherwise be
        theirs to take), at least one."""
        limits = self.limits.get(name)
        if limits is not None and limits.connections is not None:
            return min(limits.connections, total)
        return max(1, total // (len(self) + 1))


MAX_TENANT_CONNECTIONS = 1 << 16


def _tenant_option(where: str, name: str, token: str) -> tuple[str, float | int]:
    key, sep, value = token.partition("=")
    if not sep or key not in ("capacity", "connections"):
        raise ValueError(f"{where}: {token[:40]!r} after the secret of tenant {name!r} is not an option "
                         "(capacity=SHARE, connections=N; a secret holds no spaces)")
    try:
        if key == "capacity":
            share = float(value[:-1]) / 100 if value.endswith("%") else float(value)
            if not 0 < share <= 1:
                raise ValueError
            return key, share
        count = int(value)
        if not 0 < count <= MAX_TENANT_CONNECTIONS:
            raise ValueError
        return key, count
    except ValueError:
        rule = "a share of each tier, 1-100% (or 0.01-1)" if key == "capacity" else \
            f"a number of connections, 1-{MAX_TENANT_CONNECTIONS}"
        raise ValueError(f"{where}: the {key} of tenant {name!r} must be {rule}, not {value[:40]!r}") from None


def load_tenants(path: str) -> Tenants:
    """A tenants file: one `NAME SECRET [capacity=SHARE] [connections=N]` per line (blank lines and
    lines starting with '#' are skipped), each secret at least MIN_SECRET_BYTES and its own, the
    capacity shares adding up to at most 100%. The file must be private (0600). InsecureFile or
    ValueError, in one line naming the file and line, when it is not right."""
    check_private_file(path, "the tenants")
    tenants: dict[str, bytes] = {}
    limits: dict[str, TenantLimits] = {}
    with open(path) as f:
        lines = f.read().splitlines()
    for number, line in enumerate(lines, 1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        parts = text.split()
        name, secret, options = parts[0], parts[1] if len(parts) > 1 else "", parts[2:]
        where = f"tenants file {path} line {number}"
        if not TENANT_NAME.fullmatch(name):
            raise ValueError(f"{where}: the tenant name must be {TENANT_RULE}, not {name[:80]!r}")
        if name in tenants:
            raise ValueError(f"{where}: tenant {name!r} is listed twice")
        if len(secret.encode()) < MIN_SECRET_BYTES:
            raise InsecureFile(f"{where}: tenant {name!r} needs a secret of at least {MIN_SECRET_BYTES} bytes "
                               "without spaces after its name (e.g. from `openssl rand -base64 32`)")
        settings = dict(_tenant_option(where, name, option) for option in options)
        tenants[name] = secret.encode()
        if settings:
            limits[name] = TenantLimits(**settings)
    secrets_ = list(tenants.values())
    if len(set(secrets_)) != len(secrets_):
        raise InsecureFile(f"tenants file {path}: two tenants share a secret (each needs its own)")
    shares = sum(limit.capacity or 0 for limit in limits.values())
    if shares > 1 + 1e-9:
        raise ValueError(f"tenants file {path}: the capacity shares add up to {shares:.0%}, more than the whole "
                         "store (at most 100%)")
    return Tenants(tenants, limits)


def cluster_secret(cluster: str) -> str | None:
    """The secret a client uses when given none: KVSTORE_SECRET, else the file `kvstore serve`
    generated for this cluster (same user, same host), else None (insecure daemons only)."""
    return client_secret(cluster, None)[0]


def client_secret(cluster: str, given: str | None) -> tuple[str | None, str]:
    """The secret a client uses and where it came from, in words (for the one line that explains
    a mismatch with a node): `given` (the `secret=` argument; "" means none on purpose), else
    KVSTORE_SECRET, else the file `kvstore serve` generated for this cluster, else none. That file,
    when it is there, must be private (InsecureFile otherwise)."""
    if given is not None:
        return given or None, "the secret= argument" if given else "secret=\"\" (none on purpose)"
    if os.environ.get("KVSTORE_SECRET"):
        return os.environ["KVSTORE_SECRET"], "KVSTORE_SECRET"
    path = secret_path(cluster)
    try:
        secret = read_private_file(path, "the cluster secret", check_length=False) or None
    except FileNotFoundError:
        return None, f"none given: no secret=, no KVSTORE_SECRET, no {path}"
    except (InsecureFile, PermissionError):
        raise
    except OSError:
        return None, f"none given: no secret=, no KVSTORE_SECRET, no readable {path}"
    return secret, f"the file {path}, left by an earlier `kvstore serve`"


def node_key(secret: bytes, node: str) -> bytes:
    """The key for calls to `node`: a token for one node proves nothing to another."""
    return hmac.new(secret, b"kvstore-store-control/" + node.encode(), hashlib.sha256).digest()


def body_hash(body: bytes) -> str:
    """What a token binds of its call's request: BLAKE3-256 of the serialized request (3x the speed
    of SHA-256 here on a 256 KiB Put)."""
    return blake3.blake3(body, max_threads=1).hexdigest()


def _mac(key: bytes, method: str, tenant: str, client: str, stamp: str, nonce: str, body: str) -> str:
    return hmac.new(key, f"{method}|{tenant}|{client}|{stamp}|{nonce}|{body}".encode(), hashlib.sha256).hexdigest()


def control_token(secret: bytes, node: str, method: str, client: str, now: float | None = None, *,
                  body: bytes = b"", tenant: str = "") -> str:
    """A one-time token for calling `method` on `node` with the serialized request `body`
    (`tenant`: `secret` is that tenant's); never contains the secret."""
    stamp, nonce = f"{time.time() if now is None else now:.3f}", os.urandom(12).hex()
    client = client.replace(".", "_").replace(" ", "_")[:64]
    mac = _mac(node_key(secret, node), method, tenant, client, stamp, nonce, body_hash(body))
    return f"{TOKEN_SCHEME} {client}.{stamp}.{nonce}.{mac}" + (f".{tenant}" if tenant else "")


class _ClientCallDetails(collections.namedtuple(
        "_ClientCallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")),
        grpc.ClientCallDetails):
    pass


class ControlAuth(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Client side: adds a fresh control token, bound to the request, to every call on a channel
    to `node` (`tenant`: as that tenant, `secret` being its own)."""

    def __init__(self, secret: bytes, node: str, client: str, tenant: str = "") -> None:
        self._secret, self._node, self._client, self._tenant = secret, node, client, tenant

    def _details(self, details, request):
        metadata = [(k, v) for k, v in (details.metadata or []) if k != "authorization"]
        # A generic method's request may already be its bytes; a message is bound as it goes on the wire.
        body = bytes(request) if isinstance(request, (bytes, bytearray, memoryview)) else request.SerializeToString()
        metadata.append(("authorization", control_token(self._secret, self._node, details.method, self._client,
                                                        body=body, tenant=self._tenant)))
        return _ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                  getattr(details, "wait_for_ready", None), getattr(details, "compression", None))

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details, request), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details, request), request)


class TokenCheck:
    """Server side: accepts each valid control token once (made with the cluster secret, or with
    the secret of one of `tenants`)."""

    def __init__(self, secret: bytes, node: str, tenants: Mapping[str, bytes] | None = None) -> None:
        self._key = node_key(secret, node)
        self._tenant_keys = {name: node_key(s, node) for name, s in (tenants or {}).items()}
        self._seen: collections.OrderedDict[str, float] = collections.OrderedDict()
        self._lock = threading.Lock()

    def verify(self, token: str, method: str, now: float | None = None, *, body: bytes = b"") -> str | None:
        """None when the token is good for this call (`body`: its serialized request), else why not."""
        return self.authenticate(token, method, now, body=body)[0]

    def authenticate(self, token: str, method: str, now: float | None = None, *, body: bytes = b""
                     ) -> tuple[str | None, str]:
        """(None, tenant) when the token is good for this call ("" : the cluster secret's holder),
        else (why not, "")."""
        now = time.time() if now is None else now
        scheme, _, rest = token.partition(" ")
        parts = rest.split(".", 5)
        if scheme == "KVS1":
            return "a control token from a client older than this node (it binds no request): upgrade the client", ""
        if scheme != TOKEN_SCHEME or len(parts) not in (5, 6):
            return "missing or malformed cluster token", ""
        client, whole, frac, nonce, mac = parts[:5]
        tenant = parts[5] if len(parts) == 6 else ""
        stamp = f"{whole}.{frac}"
        try:
            at = float(stamp)
        except ValueError:
            return "malformed cluster token", ""
        key = self._tenant_keys.get(tenant) if tenant else self._key
        if key is None or not hmac.compare_digest(_mac(key, method, tenant, client, stamp, nonce, body_hash(body)),
                                                  mac):
            return ("wrong cluster token (wrong secret, node, method or request body)" if not tenant else
                    f"wrong token for tenant {tenant[:64]!r} (no such tenant here, or a wrong secret, node, method "
                    "or request body)"), ""
        if abs(now - at) > TOKEN_WINDOW_S:
            return "expired cluster token (check the clocks)", ""
        with self._lock:
            while self._seen and next(iter(self._seen.values())) < now - 2 * TOKEN_WINDOW_S:
                self._seen.popitem(last=False)
            if mac in self._seen:
                return "replayed cluster token", ""
            if len(self._seen) >= _MAX_SEEN:
                return f"too many calls in the last {2 * TOKEN_WINDOW_S:.0f} s to remember them all: retry", ""
            self._seen[mac] = now
        return None, tenant


def current_tenant() -> str:
    """The tenant the StoreControl call being handled authenticated as ("" : the cluster secret)."""
    return _tenant.get()


def denied(tenant: str, fingerprint: str) -> str | None:
    """Why `tenant` may not name `fingerprint` (None: it may). The cluster ("") may name any."""
    if not tenant or fingerprint_tenant(fingerprint) == tenant:
        return None
    return (f"tenant {tenant!r} may only use fingerprints of its own (digests '{tenant}:...', from a "
            f"ModelFingerprint with tenant={tenant!r}), not {str(fingerprint)[:80]!r}")


class AccessRules(grpc.ServerInterceptor):
    """StoreControl calls need a control token bound to their request (when a secret is set), and
    a tenant's name only that tenant's fingerprints; mutating and block-listing Admin calls need
    the admin bearer token (when one is configured); everything else is open (the daemon listens
    on loopback unless told otherwise)."""

    def __init__(self, secret: bytes, admin_token: str | None, node: str,
                 tenants: Mapping[str, bytes] | None = None) -> None:
        self._control = TokenCheck(secret, node, tenants) if secret else None
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

    def _checked(self, handler, method: str, token: str):
        """`handler` taking the raw request: its token is checked against those bytes, then it is
        parsed and, for a tenant, its fingerprint checked, before the service sees it."""
        if handler is None or handler.request_streaming or handler.response_streaming:
            return self._deny(handler, grpc.StatusCode.UNIMPLEMENTED, "not a StoreControl call")
        parse, behaviour = handler.request_deserializer, handler.unary_unary
        control = self._control

        def unary(raw: bytes, context):
            why, tenant = control.authenticate(token, method, body=raw)
            if why is not None:
                context.abort(grpc.StatusCode.UNAUTHENTICATED, why)
            request = parse(raw) if parse is not None else raw
            if tenant and method in SCOPED:
                refused = denied(tenant, request.fingerprint)
                if refused is not None:
                    context.abort(grpc.StatusCode.PERMISSION_DENIED, refused)
            scope = _tenant.set(tenant)
            try:
                return behaviour(request, context)
            finally:
                _tenant.reset(scope)

        return grpc.unary_unary_rpc_method_handler(unary, request_deserializer=None,
                                                   response_serializer=handler.response_serializer)

    def intercept_service(self, continuation, details):
        sent = dict(details.invocation_metadata).get("authorization", "")
        method = details.method
        if method.startswith(CONTROL_PREFIX) and self._control:
            return self._checked(continuation(details), method, sent)
        if (method in MUTATING or method in LISTING) and self._admin:
            if not sent:
                what = "changes the cluster" if method in MUTATING else "lists the node's blocks"
                return self._deny(continuation(details), grpc.StatusCode.UNAUTHENTICATED,
                                  f"this call {what}: send the admin bearer token")
            if not hmac.compare_digest(sent, self._admin):
                return self._deny(continuation(details), grpc.StatusCode.PERMISSION_DENIED, "wrong admin token")
        return continuation(details)

