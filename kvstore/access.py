"""Who may call what on a daemon's gRPC port (the admin API): calls that change the cluster or
list its blocks carry the admin bearer token (when one is configured); the store operations are
not served there (the framed wire, kvstore.daemon.local, authenticates its sessions with the
cluster secret or a tenant's).

Tenants: a daemon given a tenants file (`load_tenants`) also admits wire sessions made with a
tenant's secret; such a session may only name fingerprints of that tenant (`denied`,
`kvstore.keys.fingerprint_tenant`). The cluster secret's holder is the operator, trusted with
everything.

Secret files (cluster secret, admin token, tenants) are refused when group or others may read
them, or when they hold fewer than MIN_SECRET_BYTES (`read_private_file`).
"""
from __future__ import annotations

import hmac
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass

import grpc

from transfer.auth import TENANT_NAME, TENANT_RULE

from .errors import InsecureFile
from .keys import fingerprint_tenant

MUTATING = {"/kvstore.admin.v1.Admin/Evict", "/kvstore.admin.v1.Admin/Drain", "/kvstore.admin.v1.Admin/SetPolicy"}
# Admin calls that answer with block hashes and digests: the admin token too. GetNodeStatus and
# ClusterStatus stay open: they carry the counters /metrics serves without authentication.
LISTING = {"/kvstore.admin.v1.Admin/ListBlocks", "/kvstore.admin.v1.Admin/Query"}
MIN_SECRET_BYTES = 16


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


def denied(tenant: str, fingerprint: str) -> str | None:
    """Why `tenant` may not name `fingerprint` (None: it may). The cluster ("") may name any."""
    if not tenant or fingerprint_tenant(fingerprint) == tenant:
        return None
    return (f"tenant {tenant!r} may only use fingerprints of its own (digests '{tenant}:...', from a "
            f"ModelFingerprint with tenant={tenant!r}), not {str(fingerprint)[:80]!r}")


class AccessRules(grpc.ServerInterceptor):
    """Mutating and block-listing Admin calls need the admin bearer token (when one is configured);
    everything else on the gRPC port is open (the daemon listens on loopback unless told otherwise)."""

    def __init__(self, admin_token: str | None) -> None:
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
        method = details.method
        if (method in MUTATING or method in LISTING) and self._admin:
            sent = dict(details.invocation_metadata).get("authorization", "")
            if not sent:
                what = "changes the cluster" if method in MUTATING else "lists the node's blocks"
                return self._deny(continuation(details), grpc.StatusCode.UNAUTHENTICATED,
                                  f"this call {what}: send the admin bearer token")
            if not hmac.compare_digest(sent, self._admin):
                return self._deny(continuation(details), grpc.StatusCode.PERMISSION_DENIED, "wrong admin token")
        return continuation(details)
