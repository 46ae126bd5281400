"""The peer tier: a node serves its committed artifacts to the fleet's other nodes and pulls from them.

Pieces, all on hwrd's event loop except the data plane:

- ``AgentProcess``: hwrd's NIXL transfer process (``hwr.daemon.fleet.peer_agent``), started at
  daemon start when ``fleet_peer_serve`` or ``fleet_peer_fetch`` is on; hwrd itself never
  imports NIXL. A request is one frame on its stdin, the reply one frame on its stdout.
- ``Holders`` (discovery): a node that serves records each committed key it holds in the
  fleet's remote as ``PREFIX/holders/<key>/<node>.json`` (``{"node", "address", "expires_at"}``,
  rewritten every ``fleet_peer_holder_ttl_s / 3`` seconds, removed at a clean stop); readers
  ignore a record past its ``expires_at``, so a dead node stops being asked within one TTL (its
  stale record may stay in the remote: it is skipped, and overwritten if the node comes back).
  Wall clocks of the nodes must agree within the TTL.
- ``PeerServer``: the control connections (TCP on ``fleet_peer_listen``). After the membership
  proofs (``hwr.daemon.fleet.peer_wire``) a peer may ``open`` a key: only a committed, not
  denied artifact of this node's store; its payload files are exposed read-only by the
  transfer process (the same immutable files leases map) and their addresses sent back with
  the agent's metadata and the serving cap. Under a cap the peer asks a ``grant`` for every
  chunk before it reads it: grants come from one token bucket of
  ``fleet_peer_serve_max_bytes_per_s`` for all of this node's serving, which is how serving is
  capped. Without a cap it reads at once and reports each chunk after (``served``, no reply),
  which saves a round trip per chunk.

Bound on the node's own work: serving costs hwrd's event loop one small frame per chunk
(``peer_agent.CHUNK`` bytes, so at most ``cap / CHUNK`` frames a second, a few hundred at 1
GB/s) and no payload byte: the bytes move between the transfer processes and the NICs, never
through hwrd. Acquires never wait for serving; what serving takes from them is memory bandwidth
and NIC time, capped by ``fleet_peer_serve_max_bytes_per_s``.

Limits: grants are cooperative. A member that reads without asking can read the exposed files
at the link's speed while its connection is open; it is a member (it holds the secret), and
every other guarantee holds (it can read only committed artifacts it asked for, never write).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import os
import secrets
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hwr.client.errors import ConfigError, HwrError
from hwr.client.identity import is_key
from hwr.daemon.fleet import peer_wire
from hwr.daemon.fleet.remote import RemoteStore
from hwr.daemon.system.config import parse_address

if TYPE_CHECKING:
    from hwr.daemon.service.catalog import Catalog
    from hwr.daemon.system.config import DaemonConfig

__all__ = ["AgentProcess", "Holder", "Holders", "PeerCounters", "PeerServer", "Peers", "parse_address"]

log = logging.getLogger("hwrd.peers")


class AgentError(HwrError):
    """The transfer process failed a request or is gone."""

    code = "REMOTE_UNAVAILABLE"


class AgentProcess:
    """hwrd's end of the transfer process (the module docstring of ``peer_agent`` lists requests)."""

    def __init__(self, python: str, name: str, env: dict[str, str] | None = None) -> None:
        self.python = python or sys.executable
        self.name = name
        self.env = env
        self.proc: asyncio.subprocess.Process | None = None
        self.metadata = b""
        self._next = 0
        self._waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._reader: asyncio.Task[None] | None = None
        self.rss_bytes = 0

    async def start(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            self.python, "-m", "hwr.daemon.fleet.peer_agent", self.name, stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, env={"NIXL_LOG_LEVEL": "WARN", **os.environ, **(self.env or {})},
            close_fds=True)
        self._reader = asyncio.get_running_loop().create_task(self._read())
        try:
            hello = await asyncio.wait_for(self.request("hello"), 60)
        except (AgentError, TimeoutError) as exc:
            await self.stop()
            raise ConfigError(f"the peer tier's transfer process ({self.python} -m hwr.daemon.fleet.peer_agent) did "
                              f"not start: {exc} (install hwr[peers], or name an interpreter that has nixl-cu12 "
                              "in fleet_peer_python)", details={"key": "fleet_peer_python"}) from None
        self.metadata = base64.b64decode(hello["metadata"])

    async def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        error = "the transfer process exited"
        try:
            while True:
                message = await peer_wire.read_frame(self.proc.stdout)
                if "fatal" in message:
                    error = str(message["fatal"])
                    break
                future = self._waiting.pop(message.get("id"), None)  # type: ignore[arg-type]
                if future is not None and not future.done():
                    future.set_result(message)
        except (asyncio.IncompleteReadError, peer_wire.FrameError, ConnectionError):
            pass
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(AgentError(f"peer transfer process: {error}"))
        self._waiting.clear()

    async def request(self, op: str, **fields: Any) -> dict[str, Any]:
        """The reply to one request; ``AgentError`` when it failed or the process is gone."""
        if self.proc is None or self.proc.stdin is None or self._reader is None or self._reader.done():
            raise AgentError("peer transfer process is not running")
        self._next += 1
        rid = self._next
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiting[rid] = future
        try:
            self.proc.stdin.write(peer_wire.encode({"id": rid, "op": op, **fields}))
            await self.proc.stdin.drain()
            reply = await future
        except asyncio.CancelledError:
            self._waiting.pop(rid, None)
            if op == "read":
                with contextlib.suppress(Exception):  # give the buffer back
                    self.proc.stdin.write(peer_wire.encode({"id": -rid, "op": "abort", "target": rid}))
            raise
        except (ConnectionError, BrokenPipeError) as exc:
            self._waiting.pop(rid, None)
            raise AgentError(f"peer transfer process: {exc}") from None
        if "error" in reply:
            raise AgentError(f"peer transfer process: {reply['error']}")
        return reply

    def memory(self) -> int:
        """The transfer process's resident bytes (0 when unknown)."""
        if self.proc is None:
            return 0
        try:
            with open(f"/proc/{self.proc.pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        self.rss_bytes = int(line.split()[1]) * 1024
        except OSError:
            pass
        return self.rss_bytes

    async def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            await asyncio.wait_for(self.proc.wait(), 5)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(BaseException):
                await self._reader


@dataclass
class PeerCounters:
    """What ``hwrctl status`` and the metrics show about the peer tier."""

    served_bytes: int = 0
    served_chunks: int = 0
    serving_peers: dict[str, float] = field(default_factory=dict)  # node -> when its connection opened
    refused: int = 0  # control connections that failed the membership proof
    fetched_bytes: int = 0  # payload bytes a pull got from peers
    fallback_bytes: int = 0  # payload bytes a pull with peers got from the store instead
    peer_pulls: int = 0
    lying_peers: int = 0  # peers dropped from a pull because their bytes failed verification
    failed_peers: int = 0  # peers dropped from a pull because they failed or stalled
    active: dict[str, dict[str, Any]] = field(default_factory=dict)  # key -> live pull state (status)


class TokenBucket:
    """``rate`` bytes a second (0: unlimited), bursts of one second's worth."""

    def __init__(self, rate: int) -> None:
        self.rate = rate
        self.tokens = float(rate)
        self.at = time.monotonic()
        self.lock = asyncio.Lock()

    async def take(self, n: int) -> None:
        if self.rate <= 0:
            return
        async with self.lock:  # grants are handed out in arrival order
            while True:
                now = time.monotonic()
                self.tokens = min(float(max(self.rate, n)), self.tokens + (now - self.at) * self.rate)
                self.at = now
                if self.tokens >= n:
                    self.tokens -= n
                    return
                await asyncio.sleep((n - self.tokens) / self.rate)


@dataclass(frozen=True)
class Holder:
    node: str
    address: str
    expires_at: float


class Holders:
    """Discovery through the fleet's remote (see the module docstring)."""

    def __init__(self, remote: RemoteStore, node: str, address: str, ttl: float) -> None:
        self.remote = remote
        self.node = node
        self.address = address
        self.ttl = ttl
        self.recorded: set[str] = set()

    def _name(self, key: str, node: str | None = None) -> str:
        obj = self.remote.location.object_name(key, "x")  # PREFIX/artifacts/<key>/x
        head = obj[:obj.rindex(f"artifacts/{key}/")]
        return f"{head}holders/{key}/" + (f"{node}.json" if node else "")

    def record(self, key: str) -> None:
        body = {"node": self.node, "address": self.address, "expires_at": time.time() + self.ttl}
        self.remote.put_bytes(self._name(key, self.node), json.dumps(body).encode())
        self.recorded.add(key)

    def forget(self, key: str) -> None:
        self.remote.delete(self._name(key, self.node))
        self.recorded.discard(key)

    def find(self, key: str) -> list[Holder]:
        """Live holders of ``key`` other than this node, soonest-expiring last."""
        found = []
        now = time.time()
        for name in self.remote.list_names(self._name(key)):
            if not name.endswith(".json"):
                continue
            try:
                doc = json.loads(self.remote.get_bytes(self._name(key) + name, 4096) or b"")
                holder = Holder(str(doc["node"]), str(doc["address"]), float(doc["expires_at"]))
            except (ValueError, KeyError, TypeError, HwrError):
                continue  # a malformed record is skipped, never trusted
            if holder.node != self.node and holder.expires_at > now and holder.node + ".json" == name:
                found.append(holder)
        return sorted(found, key=lambda h: -h.expires_at)


class PeerServer:
    """The control connections of this node's serving (see the module docstring)."""

    def __init__(self, agent: AgentProcess, catalog: Catalog, secret: bytes, counters: PeerCounters,
                 cap_bytes_per_s: int, node: str) -> None:
        self.agent = agent
        self.catalog = catalog
        self.secret = secret
        self.counters = counters
        self.bucket = TokenBucket(cap_bytes_per_s)
        self.node = node
        self.server: asyncio.Server | None = None
        self.handshake_timeout = 10.0
        self.idle_timeout = 120.0
        #: Control connections at once (members and not); past it new ones are closed at once.
        self.max_connections = 256
        self._conns: set[asyncio.Task[None]] = set()

    async def start(self, host: str, port: int) -> None:
        self.server = await asyncio.start_server(self._serve, host, port, limit=peer_wire.MAX_FRAME + 8)

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
        for task in list(self._conns):
            task.cancel()
        for task in list(self._conns):
            with contextlib.suppress(BaseException):
                await task

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        if len(self._conns) >= self.max_connections:  # before any proof: a flood costs a close each
            writer.close()
            return
        self._conns.add(task)
        exposed: list[str] = []
        peer = "?"
        try:
            challenge = secrets.token_hex(16)
            await peer_wire.write_frame(writer, {"challenge": challenge, "node": self.node})
            hello = await asyncio.wait_for(peer_wire.read_frame(reader), self.handshake_timeout)
            nonce, peer = str(hello.get("nonce", "")), str(hello.get("node", "?"))[:128]
            if len(nonce) < 32 or not peer_wire.same(hello.get("proof"),
                                                     peer_wire.ask_proof(self.secret, challenge, nonce, peer)):
                self.counters.refused += 1
                log.warning("peer connection from %s refused: not a member of this fleet",
                            writer.get_extra_info("peername"))
                await peer_wire.write_frame(writer, {"error": "not a member of this fleet"})
                return
            await peer_wire.write_frame(writer, {"proof": peer_wire.serve_proof(self.secret, challenge, nonce)})
            self.counters.serving_peers[peer] = time.time()
            while True:
                message = await asyncio.wait_for(peer_wire.read_frame(reader), self.idle_timeout)
                if "open" in message:
                    reply = await self._open(str(message["open"]), exposed)
                    await peer_wire.write_frame(writer, reply)
                elif "served" in message:  # without a cap: counted after the read, no reply
                    self.counters.served_bytes += int(message["served"])
                    self.counters.served_chunks += 1
                elif "grant" in message:
                    n = int(message["grant"])
                    await self.bucket.take(n)
                    self.counters.served_bytes += n
                    self.counters.served_chunks += 1
                    await peer_wire.write_frame(writer, {"granted": n})
                else:
                    return
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError, peer_wire.FrameError, ValueError,
                TypeError):
            pass
        finally:
            self.counters.serving_peers.pop(peer, None)
            for path in exposed:
                with contextlib.suppress(HwrError):
                    await self.agent.request("release", path=path)
            writer.close()
            self._conns.discard(task)

    async def _open(self, key: str, exposed: list[str]) -> dict[str, Any]:
        if not is_key(key) or self.catalog.deny_reason(key) is not None:
            return {"error": "not served"}
        try:
            record = await asyncio.to_thread(self.catalog.record_blocking, key)
        except HwrError:
            return {"error": "not here"}
        files = []
        metadata = ""
        for entry in record.manifest.files:
            path = str(record.path / entry.name)
            try:
                reply = await self.agent.request("expose", path=path)
            except HwrError as exc:
                return {"error": f"cannot expose {entry.name}: {exc.message}"}
            exposed.append(path)
            if int(reply["size"]) != entry.size:
                return {"error": f"{entry.name} is not the committed size"}
            files.append({"name": entry.name, "size": entry.size, "addr": int(reply["addr"])})
            metadata = str(reply["metadata"])
        return {"files": files, "metadata": metadata, "cap": self.bucket.rate}


class Peers:
    """The peer tier of one daemon (built by ``hwr.daemon.fleet.tier.Fleet`` when enabled)."""

    def __init__(self, config: DaemonConfig, remote: RemoteStore, catalog: Catalog) -> None:
        self.config = config
        self.node = config.fleet_peer_node_id or os.uname().nodename
        self.secret = peer_wire.load_secret(config.fleet_peer_secret_file)
        self.serve = config.fleet_peer_serve
        self.fetch = config.fleet_peer_fetch
        self.listen = parse_address(config.fleet_peer_listen, "fleet_peer_listen") if self.serve else None
        self.address = config.fleet_peer_advertise or config.fleet_peer_listen
        self.counters = PeerCounters()
        env = {"UCX_TLS": config.fleet_peer_ucx_tls} if config.fleet_peer_ucx_tls else {}
        self.agent = AgentProcess(config.fleet_peer_python, f"hwr-{self.node}-{os.getpid()}", env)
        self.holders = Holders(remote, self.node, self.address, config.fleet_peer_holder_ttl_s)
        self.catalog = catalog
        self.server: PeerServer | None = None
        self._refresh: asyncio.Task[None] | None = None
        self.connect_timeout = 5.0
        self.chunk_timeout = max(5.0, config.remote_stall_timeout_s / 4)

    @staticmethod
    def enabled(config: DaemonConfig) -> bool:
        return bool(config.fleet_peer_serve or config.fleet_peer_fetch)

    async def start(self) -> None:
        await self.agent.start()
        if self.listen is not None:
            self.server = PeerServer(self.agent, self.catalog, self.secret, self.counters,
                                     self.config.fleet_peer_serve_max_bytes_per_s, self.node)
            await self.server.start(*self.listen)
            self._refresh = asyncio.get_running_loop().create_task(self._refresher())
        log.info("peer tier: node %s, serving %s, fetching %s, transfer process %d KiB",
                 self.node, self.address if self.serve else "off", "on" if self.fetch else "off",
                 self.agent.memory() // 1024)

    async def stop(self) -> None:
        if self._refresh is not None:
            self._refresh.cancel()
            with contextlib.suppress(BaseException):
                await self._refresh
            for key in list(self.holders.recorded):
                with contextlib.suppress(HwrError, OSError):
                    await asyncio.to_thread(self.holders.forget, key)
        if self.server is not None:
            await self.server.stop()
        await self.agent.stop()

    def committed(self, key: str) -> None:
        """A key became committed here (published or pulled): announce it now."""
        if self.serve:
            task = asyncio.get_running_loop().create_task(self._record([key]))
            task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def _record(self, keys: list[str]) -> None:
        for key in keys:
            try:
                await asyncio.to_thread(self.holders.record, key)
            except HwrError as exc:
                log.warning("peer tier: cannot record %s as held here: %s", key[:16], exc.message)
                return

    async def _refresher(self) -> None:
        period = max(0.5, self.config.fleet_peer_holder_ttl_s / 3)
        while True:
            keys = sorted(await asyncio.to_thread(self._local_keys))
            await self._record(keys)
            gone = self.holders.recorded - set(keys)
            for key in gone:
                with contextlib.suppress(HwrError):
                    await asyncio.to_thread(self.holders.forget, key)
            await asyncio.sleep(period)

    def _local_keys(self) -> list[str]:
        return [r.key for r in self.catalog.records_now() if self.catalog.deny_reason(r.key) is None]

    def status(self) -> dict[str, Any]:
        c = self.counters
        return {"node": self.node, "address": self.address if self.serve else "", "serve": self.serve,
                "fetch": self.fetch, "served_bytes": c.served_bytes, "serving_peers": sorted(c.serving_peers),
                "fetched_bytes": c.fetched_bytes, "fallback_bytes": c.fallback_bytes, "refused": c.refused,
                "lying_peers": c.lying_peers, "failed_peers": c.failed_peers, "peer_pulls": c.peer_pulls,
                "cap_bytes_per_s": self.config.fleet_peer_serve_max_bytes_per_s,
                "agent_rss_bytes": self.agent.memory(), "pulls": list(c.active.values())}
