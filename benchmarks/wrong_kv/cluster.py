"""The store side of the wrong-KV benchmark: a real etcd, `kvstore serve` daemons in processes of
their own, and the places a fault is injected: a daemon's DRAM arena (its shared-memory file,
opened through /proc), its NVMe tier file, the block records in etcd, and a relay on the TCP path
to a daemon that runs as if on another host."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Coroutine

from kvstore.index.records import BlockRecord, Layout
from kvstore.metadata.base import Compare, Delete, Put
from kvstore.integrity import block_digest
from kvstore.metadata import open_metadata
from kvstore_testing import processes
from kvstore_testing.etcd import EtcdServer

ROOT = Path(__file__).resolve().parents[2]
REMOTE_HOST = "wrong-kv-other-host"  # KVSTORE_HOST_ID of a daemon clients must reach over TCP


@dataclass(frozen=True)
class Held:
    """One published copy of a block: its holder, record, lease and etcd key and value."""

    node: str
    record: BlockRecord
    lease: int
    key: bytes
    value: bytes


@dataclass
class Daemon:
    name: str
    proc: subprocess.Popen
    dram: int  # bytes
    disk_dir: str | None
    remote: bool
    arena_fd: str = ""  # /proc/PID/fd/N of its DRAM arena (a memfd)
    tier_fd: str = ""  # /proc/PID/fd/N of its NVMe tier file


class Etcd:
    """Synchronous access to the metadata service (one event loop on a thread of its own)."""

    def __init__(self, url: str) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="wrong-kv-etcd", daemon=True)
        self._thread.start()
        self.meta = open_metadata(url)

    def call(self, coro: Coroutine) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(30)

    def blocks(self, layout: Layout, fingerprints: list[str]) -> tuple[dict[tuple[str, bytes], dict[str, Held]], int]:
        """Every published block record of `fingerprints`: (fingerprint, hash) -> node -> Held, and
        the revision they were read at."""
        out: dict[tuple[str, bytes], dict[str, Held]] = {}
        revision = 0
        for fp in fingerprints:
            kvs, revision = self.call(self.meta.range(layout.blocks_prefix(fp)))
            for kv in kvs:
                _, block_hex, node = kv.key.decode().rsplit("/", 2)
                out.setdefault((fp, bytes.fromhex(block_hex)), {})[node] = Held(
                    node, BlockRecord.decode(kv.value), kv.lease, kv.key, kv.value)
        return out, revision

    def revision(self) -> int:
        """The metadata service's revision now (what a mirror must have seen to know everything
        written so far)."""
        _, revision = self.call(self.meta.range("/kvstore/wrong-kv-revision-probe/"))
        return revision

    def put(self, key: bytes | str, value: bytes, lease: int = 0) -> int:
        return self.call(self.meta.put(key, value, lease))

    def delete(self, key: bytes | str) -> bool:
        return self.call(self.meta.delete(key))

    def get(self, key: bytes | str) -> Any:
        return self.call(self.meta.get(key))

    def put_if_absent(self, key: bytes, value: bytes, lease: int) -> bool:
        return self.call(self.meta.txn([Compare(key, "version", "==", 0)], [Put(key, value, lease)])).succeeded

    def delete_if(self, key: bytes, value: bytes) -> bool:
        """Delete `key` if it still holds `value` (not if someone wrote it since)."""
        return self.call(self.meta.txn([Compare(key, "value", "==", value)], [Delete(key)])).succeeded

    def revoke(self, lease: int) -> None:
        self.call(self.meta.lease_revoke(lease))

    def close(self) -> None:
        try:
            self.call(self.meta.close())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)


class Cluster:
    """etcd and the daemons of one cluster name; every daemon is a `kvstore serve` process."""

    def __init__(self, workdir: str) -> None:
        self.workdir = workdir
        self.name = "wkv" + uuid.uuid4().hex[:8]
        self.layout = Layout(self.name)
        self.secret = uuid.uuid4().hex + uuid.uuid4().hex
        self.secret_file = os.path.join(workdir, "secret")
        with open(self.secret_file, "w") as f:
            f.write(self.secret)
        os.chmod(self.secret_file, 0o600)
        self.server = EtcdServer(os.path.join(workdir, "etcd")).start()
        self.url = self.server.url
        self.etcd = Etcd(self.url)
        self.daemons: dict[str, Daemon] = {}

    def spawn(self, name: str, dram: int, disk: int = 0, remote: bool = False, lease_ttl: int = 10) -> Daemon:
        """A daemon named `name`; `disk` bytes of NVMe tier (none: DRAM only); `remote`: it says it
        runs on another host, so clients reach it over TCP (never its shared memory)."""
        disk_dir = os.path.join(self.workdir, f"nvme-{name}") if disk else None
        cmd = [sys.executable, "-m", "kvstore.cli", "serve", "--node", name, "--metadata", self.url,
               "--cluster", self.name, "--dram", str(dram), "--secret-file", self.secret_file,
               "--admin-token-file", os.path.join(self.workdir, "admin-token"), "--lease-ttl", str(lease_ttl),
               "--timeout", "2", "--no-promote", "--log-level", "warning"]
        if disk_dir:
            cmd += ["--disk-dir", disk_dir, "--disk-size", str(disk)]
        env = dict(os.environ)
        if remote:
            env["KVSTORE_HOST_ID"] = REMOTE_HOST
        with open(os.path.join(self.workdir, f"{name}.log"), "a") as log:
            proc = processes.spawn(cmd, stdout=subprocess.PIPE, stderr=log, text=True, cwd=ROOT, env=env)
        line = proc.stdout.readline()
        if not line:
            processes.stop(proc)
            raise RuntimeError(f"daemon {name} did not start (see {self.workdir}/{name}.log)")
        json.loads(line)
        daemon = Daemon(name, proc, dram, disk_dir, remote)
        self._find_files(daemon)
        self.daemons[name] = daemon
        return daemon

    @staticmethod
    def _find_files(daemon: Daemon) -> None:
        """The daemon's DRAM arena (the memfd of its DRAM tier's size) and its NVMe tier file."""
        fds = f"/proc/{daemon.proc.pid}/fd"
        tier = os.path.join(daemon.disk_dir, f"{daemon.name}.tier") if daemon.disk_dir else None
        for fd in sorted(os.listdir(fds), key=int):
            path = os.path.join(fds, fd)
            try:
                target = os.readlink(path)
                size = os.stat(path).st_size
            except OSError:
                continue
            if target.startswith(f"/memfd:kvstore-{daemon.name}") and size == daemon.dram and not daemon.arena_fd:
                daemon.arena_fd = path
            elif tier and target.startswith(tier) and not daemon.tier_fd:
                daemon.tier_fd = path
        if not daemon.arena_fd or (tier and not daemon.tier_fd):
            raise RuntimeError(f"daemon {daemon.name}: its DRAM arena or NVMe tier file was not found in {fds}")

    def stop(self, name: str) -> None:
        """A graceful stop: the daemon leaves the index."""
        daemon = self.daemons.pop(name)
        processes.stop(daemon.proc, grace=20)

    def kill(self, name: str) -> Daemon:
        daemon = self.daemons.pop(name)
        daemon.proc.send_signal(signal.SIGKILL)
        processes.stop(daemon.proc, grace=5)
        return daemon

    def close(self) -> None:
        for daemon in list(self.daemons.values()):
            processes.kill(daemon.proc)
        self.daemons.clear()
        try:
            self.etcd.close()
        finally:
            self.server.cleanup()

    # --- the bytes of a stored block --------------------------------------------------------------
    def _file(self, node: str, record: BlockRecord) -> str:
        daemon = self.daemons[node]
        return daemon.arena_fd if record.tier == "dram" else daemon.tier_fd

    def read_slot(self, node: str, record: BlockRecord) -> bytes:
        fd = os.open(self._file(node, record), os.O_RDONLY)
        try:
            return os.pread(fd, record.span, record.offset)
        finally:
            os.close(fd)

    def write_slot(self, node: str, record: BlockRecord, data: bytes, at: int = 0) -> None:
        fd = os.open(self._file(node, record), os.O_WRONLY)
        try:
            os.pwrite(fd, data, record.offset + at)
            if record.tier == "nvme":
                os.fsync(fd)  # readers use O_DIRECT: the bytes must be on the file, not only in the page cache
        finally:
            os.close(fd)

    @staticmethod
    def intact(block_hash: bytes, record: BlockRecord, data: bytes) -> bool:
        return not record.codec and block_digest(block_hash, data) == record.digest
