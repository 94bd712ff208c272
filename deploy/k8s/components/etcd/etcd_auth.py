#!/usr/bin/env python3
"""Turn on etcd's authentication for one kvstore cluster, idempotently. The kvstore-etcd-auth Job
runs it against the in-cluster etcd after every apply; run it by hand against an etcd of your own
(with --ca/--cert/--key for TLS) to give it the same users.

What it makes, and makes exactly (anything else those roles and users hold is revoked):

- user `root`, etcd's administrator (role root); only this program holds its password;
- role and user `kvstore` (--store-user): read and write on /kvstore/<cluster>/, for the store
  daemons, the only writers of the index;
- role and user `kvstore-reader` (--reader-user): read only on /kvstore/<cluster>/, for the
  engines and the gateway, which follow the index and must not be able to change it;
- authentication on: from then on etcd refuses every request that names no user.

It then checks the result as each user: the reader reads and is refused a write, the store user
reads, a request without a user is refused. Passwords come from the environment
(ETCD_ROOT_PASSWORD, ETCD_STORE_PASSWORD, ETCD_READER_PASSWORD) and are set on every run, so
changing a Secret and running it again rotates the store's or the reader's password. Root's
password is checked, never changed: once authentication is on, change it with etcdctl first.

    python etcd_auth.py --endpoints kvstore-etcd:2379 --cluster default [--wait 300]

Exit status: 0 done, 1 etcd refused or did not answer within --wait, 2 bad arguments.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time
from dataclasses import dataclass

import grpc
from aetcd import rpc

CALL_TIMEOUT = 10.0
ROOT = "root"
CHECK_KEY = ".etcd-auth-check"  # a key the reader tries to write (and must be refused)


class Refused(Exception):
    """etcd answered, and not as this program needs: one line for the operator."""


@dataclass(frozen=True)
class Grant:
    kind: int  # rpc.Permission.READ / WRITE / READWRITE
    key: bytes
    range_end: bytes


def prefix_end(prefix: bytes) -> bytes:
    """The range end that covers every key starting with `prefix` (etcd's prefix convention)."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"


class Etcd:
    """One gRPC channel to one etcd endpoint, with the token of the user logged in (if any)."""

    def __init__(self, endpoint: str, credentials: grpc.ChannelCredentials | None) -> None:
        self.channel = (grpc.secure_channel(endpoint, credentials) if credentials is not None
                        else grpc.insecure_channel(endpoint))
        self.auth = rpc.AuthStub(self.channel)
        self.kv = rpc.KVStub(self.channel)
        self.token: str | None = None

    def call(self, method, request):
        metadata = (("token", self.token),) if self.token else ()
        return method(request, timeout=CALL_TIMEOUT, metadata=metadata)

    def login(self, user: str, password: str) -> None:
        self.token = self.auth.Authenticate(rpc.AuthenticateRequest(name=user, password=password),
                                            timeout=CALL_TIMEOUT).token

    def close(self) -> None:
        self.channel.close()


def _details(exc: grpc.RpcError) -> str:
    return exc.details() or str(exc.code())


def connect(endpoints: list[str], credentials, root_password: str, wait: float) -> tuple[Etcd, bool]:
    """A connection logged in as root (auth on) or anonymous (auth off, the first run), and whether
    authentication is on. Waits up to `wait` seconds for etcd to answer (it may still be forming)."""
    deadline = time.monotonic() + wait
    pause, last = 0.5, "no answer"
    while True:
        for endpoint in endpoints:
            etcd = Etcd(endpoint, credentials)
            try:
                etcd.login(ROOT, root_password)
                return etcd, True
            except grpc.RpcError as exc:
                text = _details(exc)
                if "authentication is not enabled" in text:
                    return etcd, False
                etcd.close()
                if "invalid user ID or password" in text or "authentication failed" in text:
                    raise Refused(f"{endpoint}: etcd refuses root's password (authentication is on, and "
                                  "ETCD_ROOT_PASSWORD is not root's: change root's password in etcd first)") from None
                last = f"{endpoint}: {text}"
        if time.monotonic() + pause > deadline:
            raise Refused(f"etcd did not answer within {wait:g} s ({last})")
        time.sleep(pause)
        pause = min(pause * 2, 5.0)


def ensure_role(etcd: Etcd, name: str, grants: list[Grant]) -> None:
    try:
        etcd.call(etcd.auth.RoleAdd, rpc.AuthRoleAddRequest(name=name))
    except grpc.RpcError as exc:
        if "role name already exists" not in _details(exc):
            raise
    if name == ROOT:
        return  # etcd's root role has every permission; it holds no ranges of its own
    held = etcd.call(etcd.auth.RoleGet, rpc.AuthRoleGetRequest(role=name)).perm
    have = {Grant(p.permType, p.key, p.range_end) for p in held}
    for grant in have - set(grants):
        etcd.call(etcd.auth.RoleRevokePermission,
                  rpc.AuthRoleRevokePermissionRequest(role=name, key=grant.key, range_end=grant.range_end))
    for grant in grants:
        if grant not in have:
            etcd.call(etcd.auth.RoleGrantPermission, rpc.AuthRoleGrantPermissionRequest(
                name=name, perm=rpc.Permission(permType=grant.kind, key=grant.key, range_end=grant.range_end)))


def ensure_user(etcd: Etcd, name: str, password: str | None, roles: list[str]) -> None:
    """The user with exactly `roles`; its password set to `password` (None: left as it is)."""
    try:
        etcd.call(etcd.auth.UserAdd, rpc.AuthUserAddRequest(name=name, password=password or ""))
    except grpc.RpcError as exc:
        if "user name already exists" not in _details(exc):
            raise
        if password is not None:
            etcd.call(etcd.auth.UserChangePassword, rpc.AuthUserChangePasswordRequest(name=name, password=password))
    held = set(etcd.call(etcd.auth.UserGet, rpc.AuthUserGetRequest(name=name)).roles)
    for role in held - set(roles):
        etcd.call(etcd.auth.UserRevokeRole, rpc.AuthUserRevokeRoleRequest(name=name, role=role))
    for role in roles:
        if role not in held:
            etcd.call(etcd.auth.UserGrantRole, rpc.AuthUserGrantRoleRequest(user=name, role=role))


def verify(endpoint: str, credentials, prefix: bytes, users: dict[str, str], reader: str) -> None:
    """As each user: the reader reads and may not write, the store user reads, nobody unnamed reads."""
    end = prefix_end(prefix)
    for user, password in users.items():
        etcd = Etcd(endpoint, credentials)
        try:
            etcd.login(user, password)
            etcd.call(etcd.kv.Range, rpc.RangeRequest(key=prefix, range_end=end, limit=1, keys_only=True))
            if user == reader:
                try:
                    etcd.call(etcd.kv.Put, rpc.PutRequest(key=prefix + CHECK_KEY.encode(), value=b"x"))
                except grpc.RpcError as exc:
                    if "permission denied" not in _details(exc):
                        raise
                else:
                    raise Refused(f"the reader {user!r} could write {prefix.decode()}: its role is not read-only")
        finally:
            etcd.close()
    anonymous = Etcd(endpoint, credentials)
    try:
        anonymous.call(anonymous.kv.Range, rpc.RangeRequest(key=prefix, range_end=end, limit=1, keys_only=True))
    except grpc.RpcError:
        pass  # refused, as it must be
    else:
        raise Refused("etcd still answers requests that name no user: authentication is not on")
    finally:
        anonymous.close()


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="etcd_auth.py", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--endpoints", required=True, help="HOST:PORT[,HOST:PORT...] of etcd")
    parser.add_argument("--cluster", required=True, help="the kvstore cluster name (keys /kvstore/<cluster>/)")
    parser.add_argument("--store-user", default="kvstore")
    parser.add_argument("--reader-user", default="kvstore-reader")
    parser.add_argument("--ca", help="PEM of the CA that signed etcd's certificate (TLS)")
    parser.add_argument("--cert", help="client certificate PEM (etcd's --client-cert-auth)")
    parser.add_argument("--key", help="client key PEM")
    parser.add_argument("--wait", type=float, default=300.0, help="seconds to wait for etcd to answer")
    args = parser.parse_args(argv)
    if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", args.cluster):
        parser.error(f"--cluster {args.cluster!r}: 1-64 characters of A-Z a-z 0-9 _ . -")
    if len({args.store_user, args.reader_user, ROOT}) != 3:
        parser.error("--store-user, --reader-user and root must be three different users")
    if (args.cert is None) != (args.key is None):
        parser.error("--cert and --key go together")
    for name in ("ETCD_ROOT_PASSWORD", "ETCD_STORE_PASSWORD", "ETCD_READER_PASSWORD"):
        if len(os.environ.get(name, "")) < 16:
            parser.error(f"{name} must hold a password of at least 16 characters")
    return args


def main(argv: list[str]) -> int:
    args = parse(argv)
    credentials = None
    if args.ca or args.cert:
        def read(path):
            if path is None:
                return None
            with open(path, "rb") as f:
                return f.read()
        credentials = grpc.ssl_channel_credentials(read(args.ca), read(args.key), read(args.cert))
    endpoints = [e.strip() for e in args.endpoints.split(",") if e.strip()]
    prefix = f"/kvstore/{args.cluster}/".encode()
    passwords = {ROOT: os.environ["ETCD_ROOT_PASSWORD"], args.store_user: os.environ["ETCD_STORE_PASSWORD"],
                 args.reader_user: os.environ["ETCD_READER_PASSWORD"]}
    try:
        etcd, enabled = connect(endpoints, credentials, passwords[ROOT], args.wait)
        try:
            ensure_role(etcd, ROOT, [])
            ensure_user(etcd, ROOT, None if enabled else passwords[ROOT], [ROOT])
            ensure_role(etcd, args.store_user, [Grant(rpc.Permission.READWRITE, prefix, prefix_end(prefix))])
            ensure_user(etcd, args.store_user, passwords[args.store_user], [args.store_user])
            ensure_role(etcd, args.reader_user, [Grant(rpc.Permission.READ, prefix, prefix_end(prefix))])
            ensure_user(etcd, args.reader_user, passwords[args.reader_user], [args.reader_user])
            if not enabled:
                etcd.call(etcd.auth.AuthEnable, rpc.AuthEnableRequest())
        finally:
            etcd.close()
        verify(endpoints[0], credentials, prefix, {u: p for u, p in passwords.items() if u != ROOT}, args.reader_user)
    except Refused as exc:
        print(f"etcd_auth.py: {exc}", file=sys.stderr)
        return 1
    except grpc.RpcError as exc:
        print(f"etcd_auth.py: etcd refused: {_details(exc)}", file=sys.stderr)
        return 1
    print(f"etcd authentication on for cluster {args.cluster!r}: {args.store_user} reads and writes "
          f"{prefix.decode()}, {args.reader_user} reads it, nobody else", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
