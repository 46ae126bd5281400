"""hwrd assembled: every object built with its collaborators, then started and stopped in order.

``Daemon`` is wiring only: it opens the store, builds the node service over it in one call
(``ServiceGraph.build``, ``hwr.daemon.app.graph``: the read API ``Catalog``, ``Capacity``,
``Pinning``, ``Leasing``, ``Publishing``, ``Channels``, the fleet tier and the checkpoint registry,
each handed its collaborators in its constructor), builds the two transports over the graph's
parts, and runs the start and stop order below (the node service's background tasks:
housekeeping, pin restore, scrub, from ``ServiceGraph.background``). No handler reaches through
it: the transports get ``Leasing``/``PublicationFrames`` and ``RpcCollaborators``. The running
configuration and roles are one ``RunningSettings`` (``Daemon.settings``), which the reload
(``hwr.daemon.app.reload``) swaps in place and the handlers read typed as ``Settings``.

Start order: check the socket directory (``fsguard.socket_dir_problem``) -> open the store (takes
the root's lock, recovers staging, validates artifacts) -> the node service with the fleet tier
and the checkpoint registry (``ServiceGraph.build``) -> its background tasks -> start the fleet
tier -> bind the peer socket -> bind gRPC (health SERVING last). Stop order (SIGTERM):
health NOT_SERVING -> stop accepting peers -> gRPC ``stop(grace)`` lets in-flight RPCs finish ->
close peer connections (ends sessions, aborts staged publications) -> fleet -> node service
(its tasks, then ``ServiceGraph.close``) -> close the store (drops the lock). A publication in
COMMITTING during shutdown finishes inside the grace period or is left as staging, which the
next start reclaims: the store is consistent at every step.

Socket activation (``hwr.daemon.system.activation``): sockets inherited from systemd replace the
binds of the peer socket and/or gRPC (gRPC then listens on a private ``<socket>.grpc`` behind a
relay); inherited paths are never unlinked. Metrics (``hwr.daemon.app.exposition``) start last,
when configured.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from hwr import __version__
from hwr.client.errors import HwrError
from hwr.client.paths import peer_path
from hwr.daemon.app.exposition import exposition
from hwr.daemon.app.graph import ServiceGraph
from hwr.daemon.peer.limits import PeerLimits
from hwr.daemon.peer.publication_frames import PublicationFrames
from hwr.daemon.peer.server import PeerServer
from hwr.daemon.policy.capacity import CapacityPolicy
from hwr.daemon.rpc.collaborators import RpcCollaborators
from hwr.daemon.rpc.decode import add_servicer
from hwr.daemon.rpc.servicer import Servicer
from hwr.daemon.service.sessions import Session
from hwr.daemon.service.settings import RunningSettings
from hwr.daemon.store.root import Store
from hwr.daemon.system import fsguard, socket_files
from hwr.daemon.system.activation import Assignment, GrpcRelay, private_grpc_path
from hwr.daemon.system.config import DaemonConfig
from hwr.daemon.system.grpc_peers import GrpcPeers
from hwr.daemon.system.metrics import Instruments, MetricsServer
from hwr.daemon.system.peercred import AllowList, daemon_allow_list
from hwr.protos.hwr.v1 import hwr_pb2_grpc

__all__ = ["Daemon"]

log = logging.getLogger("hwrd")
SERVICE_NAME = "hwr.v1.HostWeightRuntime"
#: The largest gRPC request (a publication's tensor list can be long; artifact bytes never
#: travel over gRPC) and the most calls one connection may have in flight (a client's further
#: calls wait for a free stream, HTTP/2's own flow control). With ``max_grpc_connections_per_uid``
#: they bound what one admitted uid can make hwrd buffer; a refused peer makes it buffer nothing.
GRPC_MAX_MESSAGE_BYTES = 16 << 20
GRPC_MAX_STREAMS_PER_CONNECTION = 8


class Daemon:
    def __init__(self, config: DaemonConfig, *, inherited: Assignment | None = None) -> None:
        # Swapped by a SIGHUP reload (``hwr.daemon.app.reload``); the handlers read it as Settings.
        self.settings = RunningSettings(config)
        self.inherited = inherited or Assignment()
        self.metrics = Instruments()
        self.socket_path = Path(config.socket)
        # Built by start(), in this order; stop() closes whichever exist (the order above).
        self._store: Store | None = None
        self.graph: ServiceGraph | None = None  # the node service (hwr.daemon.app.graph)
        self._tasks: list[asyncio.Task[None]] = []  # the node service's: housekeeping, pin restore, scrub
        self._allow: AllowList = daemon_allow_list(config.allow_uids, config.allow_gids)
        self._metrics_server: MetricsServer | None = None
        self._relay: GrpcRelay | None = None
        self.grpc_peers = GrpcPeers(lambda: self._allow, config.max_grpc_connections_per_uid)
        self._grpc: grpc.aio.Server | None = None
        self._peer: PeerServer | None = None
        self._health = health.aio.HealthServicer()
        self._started = time.monotonic()
        self._bound: list[socket_files.BoundSocket] = []  # socket files bound, released at stop

    # lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        config = self.settings.config
        root = Path(config.root)
        _prepare_socket_dir(self.socket_path)  # first: a directory others control is refused at once
        adoption = None
        if config.adopt:  # a root written by vLLM-Omni 0.30's in-process store
            from hwr.daemon.store import adoption as adopt

            adoption = await asyncio.to_thread(adopt.prepare, root)
        store = await asyncio.to_thread(Store.open, root)
        self._store = store
        if adoption is not None:
            await asyncio.to_thread(adopt.finish, store, adoption)
        graph = ServiceGraph.build(self.settings, store, metrics=self.metrics)
        self.graph = graph
        for work in graph.background():
            self._tasks.append(asyncio.get_running_loop().create_task(work))
        if graph.fleet is not None:
            await graph.fleet.start()
        for path in self._owned_socket_paths():
            socket_files.claim(path)  # a path another live hwrd serves is refused, never taken over
        self._peer = PeerServer(
            peer_path(self.socket_path), limits=PeerLimits.from_config(config),
            registry=graph.registry, allow=lambda: self._allow, on_session_end=self._on_session_end,
            mode=config.socket_mode, listen_sock=self.inherited.peer, leasing=graph.leasing,
            publication_frames=PublicationFrames(graph.publications, self.settings),
        )
        await self._peer.start()
        if self.inherited.peer is None:
            self._bound.append(socket_files.bound(peer_path(self.socket_path)))
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", GRPC_MAX_MESSAGE_BYTES),
                                          ("grpc.max_concurrent_streams", GRPC_MAX_STREAMS_PER_CONNECTION)])
        servicer = Servicer(RpcCollaborators(
            settings=self.settings, registry=graph.registry, catalog=graph.catalog, leasing=graph.leasing,
            publications=graph.publications, capacity=graph.capacity, pinning=graph.pinning,
            checkpoints=graph.checkpoints, fleet=graph.fleet, metrics=self.metrics, socket_path=self.socket_path,
            started=self._started, channels=graph.channels))
        add_servicer(hwr_pb2_grpc.add_HostWeightRuntimeServicer_to_server, servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        grpc_path = private_grpc_path(self.socket_path)
        if server.add_insecure_port(f"unix:{grpc_path}") == 0:
            raise OSError(f"cannot bind {grpc_path}")
        # Before start() accepts anyone (the socket file exists once bound): the private path is
        # for the daemon's user only; clients reach gRPC through the relay on ``<socket>``, which
        # judges each connection's peer credentials before reading a byte of it.
        grpc_path.chmod(0o600)
        self._bound.append(socket_files.bound(grpc_path))
        await server.start()
        self._grpc = server
        listen = self.inherited.grpc
        if listen is None:
            listen = _listen(self.socket_path, config.socket_mode)
            self._bound.append(socket_files.bound(self.socket_path))
        self._relay = GrpcRelay(listen, grpc_path, admit=self.grpc_peers.admit,
                                first_bytes_timeout_s=config.grpc_first_bytes_timeout_s)
        await self._relay.start()
        if config.metrics_listen:
            self._metrics_server = MetricsServer(config.metrics_listen, self._scrape)
            await self._metrics_server.start()
        await self._health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        await self._health.set("", health_pb2.HealthCheckResponse.SERVING)
        log.info("hwrd %s serving root=%s socket=%s", __version__, config.root, self.socket_path)

    async def stop(self, grace: float | None = None) -> None:
        grace = self.settings.config.shutdown_grace_s if grace is None else grace
        graph = self.graph
        await self._health.enter_graceful_shutdown()
        if self._relay is not None:
            await self._relay.stop_accepting()
        if self._peer is not None:
            await self._peer.stop_accepting()
        if graph is not None:
            graph.channels.close()  # end the watch streams: gRPC's grace would wait for them
        if self._grpc is not None:
            await self._grpc.stop(grace)
        if self._relay is not None:
            await self._relay.close()
        if self._peer is not None:
            await self._peer.close()
        if self._metrics_server is not None:
            await self._metrics_server.close()
        if graph is not None and graph.fleet is not None:
            await graph.fleet.stop()
        await self._stop_node_service()
        if self._store is not None:
            await asyncio.to_thread(self._store.close)
        self.release_sockets()
        log.info("hwrd stopped")

    def release_sockets(self) -> None:
        """Unlink the socket files this daemon bound that are still its own (at stop, and after
        a start that failed half-way: the process exits without serving)."""
        for ours in self._bound:  # only files still ours: another hwrd may hold the path now
            socket_files.release(ours)
        self._bound.clear()
        if self._metrics_server is not None:
            self._metrics_server.release()

    async def _stop_node_service(self) -> None:
        """Stop the node service's tasks, then close the graph (``ServiceGraph.close``)."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self.graph is not None:
            await self.graph.close()

    def _owned_socket_paths(self) -> list[Path]:
        """Socket paths this process binds (and unlinks at exit while they are still its own,
        ``hwr.daemon.system.socket_files``): never the ones systemd passed in."""
        paths = [private_grpc_path(self.socket_path)]
        if self.inherited.grpc is None:
            paths.append(self.socket_path)
        if self.inherited.peer is None:
            paths.append(peer_path(self.socket_path))
        return paths

    def status_line(self) -> str:
        """One line for sd_notify STATUS= (systemctl status shows it)."""
        graph = self.graph
        if graph is None:
            return "serving: 0 artifacts, 0 leases, 0 sessions"
        return (f"serving: {len(graph.catalog.records_now())} artifacts, {graph.registry.lease_count()} leases, "
                f"{len(graph.registry.sessions())} sessions")

    def set_capacity(self, config: DaemonConfig) -> None:
        """Apply new capacity limits (SIGHUP); reservations already granted stay granted."""
        if self.graph is not None:
            self.graph.capacity.policy = CapacityPolicy(
                config.store_limit_bytes, config.artifact_limit_bytes, config.min_free_bytes)

    def set_allow_list(self, allow_uids: tuple[int, ...], allow_gids: tuple[int, ...]) -> None:
        """Swap the allow-list atomically; existing sessions and leases are kept."""
        self._allow = daemon_allow_list(allow_uids, allow_gids)

    def set_lease_limits(self, config: DaemonConfig) -> None:
        """Apply new lease limits (SIGHUP); leases already granted stay granted."""
        if self.graph is not None:
            self.graph.registry.max_leases_per_session = config.max_leases_per_session
            self.graph.registry.max_leases_per_uid = config.max_leases_per_uid

    # callbacks wired into the parts ---------------------------------------------------------
    def _scrape(self) -> bytes:
        graph = self.graph
        assert graph is not None  # the metrics server starts after the node service exists
        return exposition(catalog=graph.catalog, registry=graph.registry, publications=graph.publications,
                          metrics=self.metrics, fleet=graph.fleet, channels=graph.channels)

    async def _on_session_end(self, session: Session) -> None:
        graph = self.graph
        assert graph is not None  # sessions exist only once the peer socket serves
        released = graph.leasing.end_session(session)
        graph.channels.session_ended(session.session_id)
        aborted = 0
        try:
            aborted = await graph.publications.abort_session(session)
        except HwrError as exc:
            log.warning("aborting publications of session %s failed: %s", session.session_id, exc)
        log.debug("session %s (pid %d) ended: %d leases released, %d publications aborted",
                  session.session_id, session.cred.pid, len(released), aborted)


def _prepare_socket_dir(path: Path) -> None:
    parent = path.parent
    if not parent.exists():
        parent.mkdir(parents=True, mode=0o755)
    fsguard.check_socket_dir(parent)


def _listen(path: Path, mode: int) -> socket.socket:
    """hwrd's own listening socket at ``path`` for the gRPC relay, at ``mode`` before it listens."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(path))
        path.chmod(mode)
        sock.listen(512)
    except BaseException:
        sock.close()
        raise
    return sock
