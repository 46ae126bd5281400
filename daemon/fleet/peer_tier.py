"""The peer tier: a node serves its committed artifacts to the fleet's other nodes and pulls from them.

Pieces, all on hwrd's event loop except the data plane:

- ``AgentProcess``: hwrd's NIXL transfer process (``hwr.daemon.fleet.peer_agent``), started at
  daemon start when ``fleet_peer_serve`` or ``fleet_peer_fetch`` is on; hwrd itself never
  imports NIXL. A request is one frame on its stdin, the reply one frame on its stdout.
- ``Holders`` (discovery): a node that serves records each committed key it holds in the
  fleet's remote as ``PREFIX/holders/<key>/<node>.json`` (``{"node", "address", "recorded_at",
  "expires_at"}``,
  rewritten every ``fleet_peer_holder_ttl_s / 3`` seconds, removed at a clean stop); readers
  ignore a record past its ``expires_at``, so a dead node stops being asked within one TTL (its
  stale record may stay in the remote: it is skipped, and overwritten if the node comes back).
  Wall clocks of the nodes must agree within the TTL. ``hwrctl peers`` lists the records. A node
  that is itself pulling a key records it as a *partial* holder (``"partial": true`` and
  ``"since"``, when its pull began) while it pulls; the commit rewrites the record as a full one.
- Restarts: when the transfer process dies, hwrd logs it and starts a new one after a backoff
  (``RESTART_MIN_S`` doubling to ``RESTART_MAX_S``; back to the minimum once one ran
  ``RESTART_RESET_S``). Meanwhile every request to it fails at once (``AgentError``): a pull
  drops the peers it was reading from and takes their chunks from the store (the pull itself
  goes on, verified as always), new pulls go to the store, and the control connections that
  were serving are closed (their exposures died with the process; their peers fall back the
  same way). ``hwrctl status`` counts the restarts.
- ``Partial`` (the swarm): what a pulling node has verified so far. Its staging files are
  exposed read-only like committed ones, and a peer that opened the key asks ``have`` for the
  verified ranges (request and reply on the control connection; nothing is pushed or relayed).
  A range is added only after its bytes passed the manifest's digest (a tensor's SHA-256, the
  header byte for byte, a whole file's SHA-256) and withdrawn before a repair rewrites it.
  Every read of a staging range needs a ``grant`` and is reported ``done`` after, so that at
  the end of the pull (the commit refuses a staging file mapped elsewhere) the node can refuse
  new grants (``reopen``: the reader stops reading it, and finds the committed artifact here
  through the listing), wait for the reads in flight, and unmap its staging files
  (``Peers.release_partial``).
- ``PeerControlServer``: the control connections (TCP on ``fleet_peer_listen``). After the membership
  proofs (``hwr.daemon.fleet.peer_wire``) a peer may ``open`` a key: a committed, not denied
  artifact of this node's store, or one this node is pulling (``Partial``); its payload files
  are exposed read-only by the transfer process (the same immutable files leases map) and their addresses sent back with
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
import collections
import contextlib
import json
import logging
import os
import secrets
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hwr.client.errors import ConfigError, HwrError
from hwr.client.identity import is_key
from hwr.daemon.fleet import peer_wire
from hwr.daemon.fleet.remote import RemoteStore
from hwr.daemon.system.config import in_networks, parse_address, peer_networks

if TYPE_CHECKING:
    from hwr.daemon.service.catalog import Catalog
    from hwr.daemon.system.config import DaemonConfig

__all__ = [
    "RESTART_MAX_S",
    "RESTART_MIN_S",
    "RESTART_RESET_S",
    "AgentGone",
    "AgentProcess",
    "Holder",
    "Holders",
    "Partial",
    "PeerControlServer",
    "PeerCounters",
    "Peers",
    "parse_address",
]

log = logging.getLogger("hwrd.peers")

#: The first restart of a dead transfer process waits this long; each further one twice the last.
RESTART_MIN_S = 0.5
RESTART_MAX_S = 30.0
#: A transfer process that ran this long before it died is restarted after ``RESTART_MIN_S`` again.
RESTART_RESET_S = 60.0


class AgentError(HwrError):
    """The transfer process failed a request or is gone."""

    code = "REMOTE_UNAVAILABLE"


class AgentGone(AgentError):
    """The transfer process is not running (it died, or has not been started again yet): no
    peer is to blame for a request that fails with it."""


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
                future.set_exception(AgentGone(f"peer transfer process: {error}"))
        self._waiting.clear()

    async def request(self, op: str, **fields: Any) -> dict[str, Any]:
        """The reply to one request; ``AgentError`` when it failed or the process is gone."""
        if self.proc is None or self.proc.stdin is None or self._reader is None or self._reader.done():
            raise AgentGone("peer transfer process is not running")
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
            raise AgentGone(f"peer transfer process: {exc}") from None
        if "error" in reply:
            raise AgentError(f"peer transfer process: {reply['error']}")
        return reply

    @property
    def pid(self) -> int:
        """The transfer process's pid while it runs, else 0."""
        if self.proc is None or self.proc.returncode is not None:
            return 0
        return self.proc.pid

    def memory(self) -> int:
        """The transfer process's resident bytes (0 when unknown or not running)."""
        if not self.pid:
            return 0
        try:
            with open(f"/proc/{self.pid}/status") as f:
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
    staging_served_bytes: int = 0  # of served_bytes: verified bytes of a pull still in progress here
    serving_peers: dict[str, float] = field(default_factory=dict)  # node -> when its connection opened
    refused: int = 0  # control connections that failed the membership proof or came from outside fleet_peer_networks
    fetched_bytes: int = 0  # payload bytes a pull got from peers
    partial_fetched_bytes: int = 0  # of fetched_bytes: from peers that were still pulling
    fallback_bytes: int = 0  # payload bytes a pull with peers got from the store instead
    peer_pulls: int = 0
    lying_peers: int = 0  # peers dropped from a pull because their bytes failed verification
    failed_peers: int = 0  # peers dropped from a pull because they failed or stalled
    agent_restarts: int = 0  # the transfer process died and was started again
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
    """One holder record (``recorded_at`` is 0 for a record whose writer did not say)."""

    node: str
    address: str
    expires_at: float
    recorded_at: float = 0.0
    partial: bool = False  # still pulling: serves only the ranges it has verified
    since: float = 0.0  # a partial holder's pull began then (orders the swarm's chain)


class Partial:
    """A key this node is pulling: its staging files and the ranges verified so far.

    ``add`` is called from hashing threads, ``ranges`` from the event loop: a lock guards the
    lists. Ranges are merged and sorted per file.
    """

    def __init__(self, files: dict[str, tuple[str, int]], since: float) -> None:
        self.files = files  # name -> (staging path, size)
        self.since = since
        self.closing = False  # the pull ended: no new grants, the staging is being unmapped
        self.inflight = 0  # granted staging reads not yet reported done
        self._have: dict[str, list[tuple[int, int]]] = {name: [] for name in files}
        self._lock = threading.Lock()

    def add(self, name: str, start: int, end: int) -> None:
        with self._lock:
            merged: list[tuple[int, int]] = []
            for s, e in sorted([*self._have[name], (start, end)]):
                if merged and s <= merged[-1][1]:
                    merged[-1] = (merged[-1][0], max(merged[-1][1], e))
                else:
                    merged.append((s, e))
            self._have[name] = merged

    def withdraw(self, name: str) -> None:
        """Nothing of ``name`` is served until it is verified again (a repair rewrites it)."""
        with self._lock:
            self._have[name] = []

    def ranges(self) -> dict[str, list[list[int]]]:
        with self._lock:
            return {name: [[s, e] for s, e in have] for name, have in self._have.items()}

    def verified_bytes(self) -> int:
        return sum(e - s for have in self.ranges().values() for s, e in have)


class Holders:
    """Discovery through the fleet's remote (see the module docstring)."""

    def __init__(self, remote: RemoteStore, node: str, address: str, ttl: float,
                 networks: tuple[Any, ...] = ()) -> None:
        self.remote = remote
        self.node = node
        self.address = address
        self.ttl = ttl
        self.networks = networks  # fleet_peer_networks: holders at an address outside are not asked
        self.recorded: set[str] = set()

    def _name(self, key: str, node: str | None = None) -> str:
        obj = self.remote.location.object_name(key, "x")  # PREFIX/artifacts/<key>/x
        head = obj[:obj.rindex(f"artifacts/{key}/")]
        return f"{head}holders/{key}/" + (f"{node}.json" if node else "")

    def record(self, key: str, since: float | None = None) -> None:
        """Record this node as a holder of ``key``; a partial one (still pulling) with ``since``."""
        now = time.time()
        body: dict[str, Any] = {"node": self.node, "address": self.address, "recorded_at": now,
                                "expires_at": now + self.ttl}
        if since is not None:
            body.update(partial=True, since=since)
        self.remote.put_bytes(self._name(key, self.node), json.dumps(body).encode())
        self.recorded.add(key)

    def forget(self, key: str) -> None:
        self.remote.delete(self._name(key, self.node))
        self.recorded.discard(key)

    def records(self, key: str) -> list[Holder]:
        """Every well-formed holder record of ``key``, expired ones and this node's included,
        in the order of the node names. A malformed record, or one whose ``node`` is not its
        object's name, is skipped (never trusted); ``HwrError`` when the remote fails."""
        found = []
        for name in self.remote.list_names(self._name(key)):
            if not name.endswith(".json"):
                continue
            try:
                doc = json.loads(self.remote.get_bytes(self._name(key) + name, 4096) or b"")
                holder = Holder(str(doc["node"]), str(doc["address"]), float(doc["expires_at"]),
                                float(doc.get("recorded_at", 0.0)), bool(doc.get("partial", False)),
                                float(doc.get("since", 0.0)))
            except (ValueError, KeyError, TypeError, AttributeError, HwrError):
                continue  # a malformed record is skipped, never trusted
            if holder.node + ".json" == name:
                found.append(holder)
        return found

    def find(self, key: str) -> list[Holder]:
        """Live holders of ``key`` other than this node, soonest-expiring last (with
        ``networks``, only those whose address is a name or lies in one of them)."""
        now = time.time()
        found = [h for h in self.records(key) if h.node != self.node and h.expires_at > now
                 and (not self.networks or in_networks(h.address.rpartition(":")[0], self.networks) is not False)]
        return sorted(found, key=lambda h: -h.expires_at)


class PeerControlServer:
    """The control connections of this node's serving (see the module docstring)."""

    def __init__(self, agent: AgentProcess, catalog: Catalog, secret: bytes, counters: PeerCounters,
                 cap_bytes_per_s: int, node: str, networks: tuple[Any, ...] = (),
                 partial: dict[str, Partial] | None = None) -> None:
        self.networks = networks  # fleet_peer_networks: connections from elsewhere are closed unanswered
        self.agent = agent
        self.partial = partial if partial is not None else {}
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
        await self.drop_connections()

    async def drop_connections(self) -> None:
        """Close every control connection (at stop, and when the transfer process died: what
        they exposed died with it, so their peers must reconnect or fall back)."""
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
        if self.networks:
            address = writer.get_extra_info("peername")
            if not address or not in_networks(str(address[0]), self.networks):
                self.counters.refused += 1
                log.warning("peer connection from %s refused: outside fleet_peer_networks", address)
                writer.close()
                return
        self._conns.add(task)
        exposed: list[str] = []
        peer = "?"
        opened: list[Partial | None] = [None]  # a key still being pulled here, when this connection opened one
        granted: collections.deque[Partial] = collections.deque()  # staging reads not yet reported done
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
                    key = str(message["open"])
                    reply = await self._open(key, exposed)
                    opened[0] = self.partial.get(key) if reply.get("partial") else None
                    await peer_wire.write_frame(writer, reply)
                elif "have" in message:
                    await peer_wire.write_frame(writer, self._have(str(message["have"])))
                elif "served" in message:  # without a cap: counted after the read, no reply
                    self._count(int(message["served"]), False)
                elif "done" in message:  # a staging read ended (no reply)
                    if granted:
                        granted.popleft().inflight -= 1
                elif "grant" in message:
                    n = int(message["grant"])
                    partial = opened[0]
                    if partial is not None:
                        if partial.closing:
                            await peer_wire.write_frame(writer, {"reopen": True})
                            continue
                        partial.inflight += 1
                        granted.append(partial)
                    await self.bucket.take(n)
                    self._count(n, partial is not None)
                    await peer_wire.write_frame(writer, {"granted": n})
                else:
                    return
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError, peer_wire.FrameError, ValueError,
                TypeError):
            pass
        finally:
            for partial in granted:  # reads the peer never reported end with its connection
                partial.inflight -= 1
            self.counters.serving_peers.pop(peer, None)
            for path in exposed:
                with contextlib.suppress(HwrError):
                    await self.agent.request("release", path=path)
            writer.close()
            self._conns.discard(task)

    def _count(self, n: int, staging: bool) -> None:
        self.counters.served_bytes += n
        self.counters.served_chunks += 1
        if staging:
            self.counters.staging_served_bytes += n

    def _have(self, key: str) -> dict[str, Any]:
        """The verified ranges of a key being pulled here; ``reopen`` once that pull ended (the
        staging this connection opened is unmapped: even a committed key must be opened anew)."""
        partial = self.partial.get(key)
        if partial is None or partial.closing:
            return {"reopen": True}
        return {"have": partial.ranges()}

    async def _open(self, key: str, exposed: list[str]) -> dict[str, Any]:
        if not is_key(key) or self.catalog.deny_reason(key) is not None:
            return {"error": "not served"}
        partial = self.partial.get(key)
        try:
            record = await asyncio.to_thread(self.catalog.record_blocking, key)
        except HwrError:
            if partial is None or partial.closing:
                return {"error": "not here"}
            return await self._open_partial(partial, exposed)
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

    async def _open_partial(self, partial: Partial, exposed: list[str]) -> dict[str, Any]:
        """A pull in progress here: its staging files (allocated at their full size, written only
        by this node's transfer process and store copies) exposed read-only; the peer reads only
        the ranges ``have`` names, and verifies them itself."""
        files = []
        metadata = ""
        for name, (path, size) in partial.files.items():
            try:
                reply = await self.agent.request("expose", path=path)
            except HwrError as exc:
                return {"error": f"cannot expose {name}: {exc.message}"}
            exposed.append(path)
            if int(reply["size"]) != size:
                return {"error": f"{name} is not the planned size"}
            files.append({"name": name, "size": size, "addr": int(reply["addr"])})
            metadata = str(reply["metadata"])
        return {"files": files, "metadata": metadata, "cap": self.bucket.rate, "partial": True,
                "have": partial.ranges()}


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
        self.networks = peer_networks(config.fleet_peer_networks)
        self.holders = Holders(remote, self.node, self.address, config.fleet_peer_holder_ttl_s, self.networks)
        self.catalog = catalog
        self.server: PeerControlServer | None = None
        self.partial: dict[str, Partial] = {}  # keys being pulled here, served while they are
        self._refresh: asyncio.Task[None] | None = None
        self._supervisor: asyncio.Task[None] | None = None
        self.connect_timeout = 5.0
        self.chunk_timeout = max(5.0, config.remote_stall_timeout_s / 4)

    @staticmethod
    def enabled(config: DaemonConfig) -> bool:
        return bool(config.fleet_peer_serve or config.fleet_peer_fetch)

    async def start(self) -> None:
        await self.agent.start()
        if self.listen is not None:
            self.server = PeerControlServer(self.agent, self.catalog, self.secret, self.counters,
                                     self.config.fleet_peer_serve_max_bytes_per_s, self.node, self.networks,
                                     self.partial)
            await self.server.start(*self.listen)
            self._refresh = asyncio.get_running_loop().create_task(self._refresher())
        self._supervisor = asyncio.get_running_loop().create_task(self._supervise())
        log.info("peer tier: node %s, serving %s, fetching %s, transfer process %d KiB",
                 self.node, self.address if self.serve else "off", "on" if self.fetch else "off",
                 self.agent.memory() // 1024)

    async def stop(self) -> None:
        if self._supervisor is not None:  # first: a transfer process ended by the stop is not restarted
            self._supervisor.cancel()
            with contextlib.suppress(BaseException):
                await self._supervisor
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

    async def _supervise(self) -> None:
        """Restart the transfer process whenever it dies (the module docstring: restarts)."""
        delay = RESTART_MIN_S
        while True:
            proc = self.agent.proc
            assert proc is not None
            pid, since = proc.pid, time.monotonic()
            status = await proc.wait()
            if time.monotonic() - since >= RESTART_RESET_S:
                delay = RESTART_MIN_S
            log.error("peer tier: the transfer process (pid %d) exited with status %d; its reads fall back to "
                      "other peers and the remote, its serving connections are closed; restarting it in %.1f s",
                      pid, status, delay)
            await self.agent.stop()  # its reader ends: every request waiting on it fails now
            if self.server is not None:
                await self.server.drop_connections()
            while True:
                await asyncio.sleep(delay)
                delay = min(delay * 2, RESTART_MAX_S)
                try:
                    await self.agent.start()
                except (ConfigError, OSError) as exc:
                    log.error("peer tier: the transfer process did not start again (%s); next try in %.1f s",
                              getattr(exc, "message", exc), delay)
                    continue
                break
            self.counters.agent_restarts += 1
            log.warning("peer tier: transfer process restarted (pid %d, %d restarts so far)", self.agent.pid,
                        self.counters.agent_restarts)

    def committed(self, key: str) -> None:
        """A key became committed here (published or pulled): announce it now."""
        self.partial.pop(key, None)
        if self.serve:
            task = asyncio.get_running_loop().create_task(self._record([key]))
            task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def begin_partial(self, key: str, partial: Partial) -> None:
        """Serve a pull in progress here (its verified ranges) and record this node as a partial holder."""
        if not self.serve:
            return
        self.partial[key] = partial
        await self._record([key])

    async def release_partial(self, key: str, partial: Partial, *, failed: bool) -> None:
        """The pull of ``key`` ended (verified, before its commit; or ``failed``): no new staging
        reads, the granted ones waited for (at most the chunk timeout), the staging unmapped in
        the transfer process. A failed pull's partial record is removed; a verified one's stays
        until the commit rewrites it (its readers meanwhile get ``reopen``)."""
        if self.partial.get(key) is not partial:
            return
        partial.closing = True
        deadline = time.monotonic() + self.chunk_timeout
        while partial.inflight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        self.partial.pop(key, None)
        log.info("peer tier: %s's staging no longer served (%d reads still granted)", key[:16], partial.inflight)
        for path, _size in partial.files.values():
            with contextlib.suppress(HwrError):
                await self.agent.request("unexpose", path=path)
        if failed:
            with contextlib.suppress(HwrError, OSError):
                await asyncio.to_thread(self.holders.forget, key)

    async def _record(self, keys: list[str]) -> None:
        for key in keys:
            partial = self.partial.get(key)
            try:
                await asyncio.to_thread(self.holders.record, key, None if partial is None else partial.since)
            except HwrError as exc:
                log.warning("peer tier: cannot record %s as held here: %s", key[:16], exc.message)
                return

    async def _refresher(self) -> None:
        period = max(0.5, self.config.fleet_peer_holder_ttl_s / 3)
        while True:
            keys = sorted(await asyncio.to_thread(self._local_keys))
            for key, partial in list(self.partial.items()):  # a pull whose commit failed leaves no staging
                if key in keys or not all(os.path.exists(p) for p, _s in partial.files.values()):
                    self.partial.pop(key, None)
                else:
                    keys.append(key)
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
                "fetched_bytes": c.fetched_bytes,
                "partial_fetched_bytes": c.partial_fetched_bytes, "staging_served_bytes": c.staging_served_bytes,
                "fallback_bytes": c.fallback_bytes, "refused": c.refused,
                "lying_peers": c.lying_peers, "failed_peers": c.failed_peers, "peer_pulls": c.peer_pulls,
                "cap_bytes_per_s": self.config.fleet_peer_serve_max_bytes_per_s,
                "agent_rss_bytes": self.agent.memory(), "pulls": list(c.active.values()),
                "agent_restarts": c.agent_restarts, "agent_pid": self.agent.pid}
