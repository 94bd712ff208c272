"""The peer network of a local etcd cluster (kvstore_testing.etcd.EtcdCluster), in a process of its own:
one TCP relay per member, listening on the peer URL that member advertises and relaying to the port
it really listens on, so that a member can be cut off from the others while its clients still
reach it — a network partition, on loopback, without root.

    python -m kvstore_testing.etcd_proxy '[{"name": "etcd-0", "listen": 41001, "target": 41002}, ...]'

Every connection between members passes a relay: the one in front of the member dialled. Who dialled
is read from /proc (the connecting socket's inode in /proc/net/tcp, found among the members' open
descriptors), so each connection is known as (from, to). Commands, one per line on stdin, each
answered with one line on stdout ("ok" or "error: ..."):

    pids NAME=PID ...     the members' processes (again after a restart)
    partition NAME        NAME's connections to and from other members stop moving bytes (neither
                          side's are read: the senders' writes stall, as over a cut link); new ones
                          are accepted and left silent
    heal [NAME]           the partition ends: the stalled connections are closed, members dial again
    quit

Connections of unknown origin (not a member's) are relayed unless their target is partitioned.
"""
from __future__ import annotations

import asyncio
import json
import os
import socket
import sys

LOOPBACK = "127.0.0.1"


def _inode_of(local_port: int, remote_port: int) -> str | None:
    """The inode of the socket 127.0.0.1:local_port -> 127.0.0.1:remote_port (/proc/net/tcp)."""
    want_local, want_remote = f":{local_port:04X}", f":{remote_port:04X}"
    try:
        with open("/proc/net/tcp") as f:
            next(f)
            for line in f:
                fields = line.split()
                if fields[1].endswith(want_local) and fields[2].endswith(want_remote):
                    return fields[9]
    except OSError:
        return None
    return None


def _owner(inode: str, pids: dict[str, int]) -> str | None:
    target = f"socket:[{inode}]"
    for name, pid in pids.items():
        fd_dir = f"/proc/{pid}/fd"
        try:
            for fd in os.listdir(fd_dir):
                try:
                    if os.readlink(f"{fd_dir}/{fd}") == target:
                        return name
                except OSError:
                    continue
        except OSError:
            continue
    return None


class Link:
    """One relayed connection: `source` (a member's name, or None) dialled `target`."""

    def __init__(self, source: str | None, target: str, down: asyncio.StreamWriter) -> None:
        self.source, self.target, self.down = source, target, down
        self.up: asyncio.StreamWriter | None = None
        self.flowing = asyncio.Event()
        self.tasks: list[asyncio.Task] = []
        self.closed = False

    def close(self) -> None:
        self.closed = True
        self.flowing.set()  # wakes an accept left silent; it sees `closed` and ends
        for task in self.tasks:
            task.cancel()
        for writer in (self.down, self.up):
            if writer is not None:
                writer.transport.abort()


class Relays:
    def __init__(self, members: list[dict]) -> None:
        self.members = {m["name"]: m for m in members}
        self.pids: dict[str, int] = {}
        self.cut: set[str] = set()
        self.links: set[Link] = set()

    def isolated(self, link: Link) -> bool:
        return link.target in self.cut or (link.source is not None and link.source in self.cut)

    async def serve(self) -> None:
        servers = []
        for name, member in self.members.items():
            servers.append(await asyncio.start_server(
                lambda r, w, n=name: self.accept(n, r, w), LOOPBACK, member["listen"], reuse_address=True))
        print("ready", flush=True)
        await self.commands()
        for server in servers:
            server.close()
        for link in list(self.links):
            link.close()

    async def accept(self, target: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        inode = _inode_of(peer[1], self.members[target]["listen"]) if peer else None
        source = _owner(inode, self.pids) if inode else None
        link = Link(source, target, writer)
        self.links.add(link)
        try:
            sock = writer.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if not self.isolated(link):
                link.flowing.set()
            await link.flowing.wait()  # a partitioned link is accepted and left silent
            if link.closed:
                return
            up_reader, link.up = await asyncio.wait_for(
                asyncio.open_connection(LOOPBACK, self.members[target]["target"]), 5)
            link.tasks = [asyncio.ensure_future(self.pump(link, reader, link.up)),
                          asyncio.ensure_future(self.pump(link, up_reader, writer))]
            await asyncio.wait(link.tasks, return_when=asyncio.FIRST_COMPLETED)
        except (OSError, asyncio.TimeoutError, asyncio.CancelledError):
            pass
        finally:
            link.close()
            self.links.discard(link)

    @staticmethod
    async def pump(link: Link, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while not link.closed:
                await link.flowing.wait()  # stalled while partitioned: nothing read, the sender's window fills
                data = await reader.read(1 << 16)
                if not data or link.closed:
                    return
                await link.flowing.wait()
                writer.write(data)
                await writer.drain()
        except OSError:
            return

    async def commands(self) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        while True:
            line = (await reader.readline()).decode().strip()
            if not line or line == "quit":
                return
            word, _, rest = line.partition(" ")
            try:
                answer = self.command(word, rest.split())
            except (KeyError, ValueError) as exc:
                answer = f"error: {exc}"
            print(answer, flush=True)

    def command(self, word: str, args: list[str]) -> str:
        if word == "pids":
            for item in args:
                name, _, pid = item.partition("=")
                if name not in self.members:
                    raise KeyError(f"no member {name}")
                self.pids[name] = int(pid)
            return "ok"
        if word == "partition":
            for name in args:
                if name not in self.members:
                    raise KeyError(f"no member {name}")
                self.cut.add(name)
            for link in self.links:
                if self.isolated(link):
                    link.flowing.clear()
            return "ok"
        if word == "heal":
            names = set(args) if args else set(self.cut)
            self.cut -= names
            for link in list(self.links):
                if not link.flowing.is_set() and not self.isolated(link):
                    link.close()  # dial again: a connection stalled this long is not worth saving
                    self.links.discard(link)
            return "ok"
        raise ValueError(f"unknown command {word!r}")


def main() -> int:
    members = json.loads(sys.argv[1])
    asyncio.run(Relays(members).serve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
