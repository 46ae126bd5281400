"""hwrd assembled: every object built with its collaborators, then started and stopped in order.

``Daemon`` is wiring only: it builds the store, the node service's collaborators (the read API
``Catalog``, ``Capacity``, ``Pinning``, ``Leasing``, ``Publishing``, the scrubber and the
housekeeping tick, over the pins, the lease holds, the recency of use and the mapping scan), the
fleet tier, the checkpoint registry and the two transports, hands each its collaborators in its
constructor, and runs the start and stop order below (the node service's background tasks:
housekeeping, pin restore, scrub). No handler reaches through it: the transports get
``Leasing``/``PublicationFrames`` and ``RpcCollaborators``, and the reload
(``hwr.daemon.app.reload``) swaps ``config`` and ``roles`` here, which the handlers read through
this object typed as ``Settings`` (those two only).

Start order: check the socket directory (``fsguard.socket_dir_problem``) -> open the store (takes
the root's lock, recovers staging, validates artifacts) -> the node service -> the fleet tier ->
checkpoints -> bind the peer channel -> bind gRPC (health SERVING last). Stop order (SIGTERM):
health NOT_SERVING -> stop accepting peers -> gRPC ``stop(grace)`` lets in-flight RPCs finish ->
close peer connections (ends sessions, aborts staged publications) -> fleet -> node service ->
close the store (drops the lock). A publication in COMMITTING during shutdown finishes inside the
grace period or is left as staging, which the next start reclaims: the store is consistent at every
step.

Socket activation (``hwr.daemon.system.activation``): sockets inherited from systemd replace the
binds of the peer channel and/or gRPC (gRPC then listens on a private ``<socket>.grpc`` behind a
relay); inherited paths are never unlinked. Metrics (``hwr.daemon.app.exposition``) start last,
when configured.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Coroutine
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from hwr import __version__
from hwr.client.errors import HwrError
from hwr.client.paths import peer_path
from hwr.daemon.app.exposition import exposition
from hwr.daemon.checkpoints.registry import Checkpoints
from hwr.daemon.fleet.tier import Fleet
from hwr.daemon.peer.channel import PeerServer
from hwr.daemon.peer.limits import PeerLimits
from hwr.daemon.peer.publication_frames import PublicationFrames
from hwr.daemon.policy.capacity import CapacityPolicy
from hwr.daemon.rpc.collaborators import RpcCollaborators
from hwr.daemon.rpc.decode import add_servicer
from hwr.daemon.rpc.servicer import Servicer
from hwr.daemon.service.capacity import Capacity
from hwr.daemon.service.catalog import Catalog
from hwr.daemon.service.channels import Channels
from hwr.daemon.service.evictor import EvictionMarks
from hwr.daemon.service.housekeeping import Housekeeping
from hwr.daemon.service.lease_journal import LeaseHolds, LeaseJournal
from hwr.daemon.service.leasing import Leasing
from hwr.daemon.service.mapping_scan import MappingScan
from hwr.daemon.service.pinning import Pinning, PinSet, Residency
from hwr.daemon.service.publishing import Publishing
from hwr.daemon.service.recency import AccessTimes, Recency
from hwr.daemon.service.roles import OPERATOR, Roles, roles_from
from hwr.daemon.service.scrubber import Scrubber
from hwr.daemon.service.sessions import Registry, Session
from hwr.daemon.store.root import Store
from hwr.daemon.store.writer_bounds import MemfdStagings
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
        # Swapped by a SIGHUP reload; the handlers read them through ``self`` typed as Settings.
        self.config: DaemonConfig = config
        self.roles: Roles = roles_from(config)
        self.inherited = inherited or Assignment()
        self.metrics = Instruments()
        self.socket_path = Path(config.socket)
        self.registry = Registry(max_leases_per_session=config.max_leases_per_session,
                                 max_leases_per_uid=config.max_leases_per_uid)
        # Built by start(), in this order; stop() closes whichever exist (the order above).
        self._store: Store | None = None
        self._catalog: Catalog | None = None
        self._capacity: Capacity | None = None
        self._pinning: Pinning | None = None
        self._lease_holds: LeaseHolds | None = None
        self._recency: Recency | None = None
        self._tasks: list[asyncio.Task[None]] = []  # the node service's: housekeeping, pin restore, scrub
        self._publications: Publishing | None = None
        self._fleet: Fleet | None = None
        self._checkpoints: Checkpoints | None = None
        self._channels: Channels | None = None
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
        config = self.config
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
        pins = PinSet.open(root)
        marks = EvictionMarks()  # an acquire (or pin) of a key an eviction round marked waits for it
        catalog = Catalog(store, marks, pins=pins, on_verification_failure=self.metrics.count_verification_failure)
        self._catalog = catalog
        lease_holds = LeaseHolds(LeaseJournal.open(root / "leases.journal"))
        self._lease_holds = lease_holds
        recency = Recency(AccessTimes(root / "access.json"), catalog)
        self._recency = recency
        capacity = Capacity(config, store, catalog, self.registry, marks=marks, pins=pins, holds=lease_holds,
                            recency=recency, scan=MappingScan(lease_holds))
        self._capacity = capacity
        capacity.evictor.on_evict = self.metrics.count_eviction
        self.registry.observers.append(capacity.on_lease)
        pinning = Pinning(catalog, pins, Residency(config.mlock_budget_bytes))
        self._pinning = pinning
        publications = Publishing(store, catalog, capacity=capacity, commit_threads=config.commit_threads,
                                    on_phase=self.metrics.observe_publication_phase, on_commit=self._committed)
        publications.memfd_staging = MemfdStagings(config.memfd_staging_max_bytes)
        self._publications = publications
        channels = await asyncio.to_thread(Channels.open, root, catalog.is_volatile, catalog.lookup_settled)
        self._channels = channels
        capacity.evictor.protected = channels.protects  # a channel's keys are never evicted
        publications.channels = channels
        publications.is_operator = lambda session: self.roles.grants(session.cred, OPERATOR)  # after reloads too
        self._start_tasks(Housekeeping(config, store, lease_holds, recency).run(publications))
        if pins.keys():
            self._start_tasks(pinning.restore())
        if config.scrub_bandwidth_mib_s > 0:
            self._start_tasks(Scrubber(config, catalog).run())
        fleet = Fleet.open(config, catalog, publications)
        self._fleet = fleet
        if fleet is not None:
            await fleet.start()
        catalog.fetcher = fleet
        checkpoints = Checkpoints(root / "checkpoints")
        self._checkpoints = checkpoints
        await asyncio.to_thread(checkpoints.open)
        leasing = Leasing(catalog, self.registry, journal=lease_holds.journal, checkpoints=checkpoints,
                          on_acquire=self.metrics.observe_acquire, settings=self)
        for path in self._owned_socket_paths():
            socket_files.claim(path)  # a path another live hwrd serves is refused, never taken over
        self._peer = PeerServer(
            peer_path(self.socket_path), limits=PeerLimits.from_config(config),
            registry=self.registry, allow=lambda: self._allow, on_session_end=self._on_session_end,
            mode=config.socket_mode, listen_sock=self.inherited.peer, leasing=leasing,
            publishing=PublicationFrames(publications, self), channels=channels,
        )
        await self._peer.start()
        if self.inherited.peer is None:
            self._bound.append(socket_files.bound(peer_path(self.socket_path)))
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", GRPC_MAX_MESSAGE_BYTES),
                                          ("grpc.max_concurrent_streams", GRPC_MAX_STREAMS_PER_CONNECTION)])
        servicer = Servicer(RpcCollaborators(
            settings=self, registry=self.registry, catalog=catalog, leasing=leasing,
            publications=publications, capacity=capacity, pinning=pinning, checkpoints=checkpoints,
            fleet=fleet, metrics=self.metrics, socket_path=self.socket_path, started=self._started,
            channels=channels))
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
        self._relay = GrpcRelay(listen, grpc_path, admit=self.grpc_peers.admit)
        await self._relay.start()
        if config.metrics_listen:
            self._metrics_server = MetricsServer(config.metrics_listen, self._scrape)
            await self._metrics_server.start()
        await self._health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        await self._health.set("", health_pb2.HealthCheckResponse.SERVING)
        log.info("hwrd %s serving root=%s socket=%s", __version__, config.root, self.socket_path)

    async def stop(self, grace: float | None = None) -> None:
        grace = self.config.shutdown_grace_s if grace is None else grace
        await self._health.enter_graceful_shutdown()
        if self._relay is not None:
            await self._relay.stop_accepting()
        if self._peer is not None:
            await self._peer.stop_accepting()
        if self._channels is not None:
            self._channels.close()  # end the watch streams: gRPC's grace would wait for them
        if self._grpc is not None:
            await self._grpc.stop(grace)
        if self._relay is not None:
            await self._relay.close()
        if self._peer is not None:
            await self._peer.close()
        if self._metrics_server is not None:
            await self._metrics_server.close()
        if self._fleet is not None:
            await self._fleet.stop()
        await self._stop_node_service()
        if self._store is not None:
            await asyncio.to_thread(self._store.close)
        if self._checkpoints is not None:
            self._checkpoints.close()
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

    def _start_tasks(self, work: Coroutine[object, object, None]) -> None:
        self._tasks.append(asyncio.get_running_loop().create_task(work))

    async def _stop_node_service(self) -> None:
        """Stop the node service's tasks, then save the access times, close the lease journal,
        release resident pins and wait for the deletions of retired bytes handed over."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._recency is not None:
            self._recency.access.flush()
        if self._lease_holds is not None:
            self._lease_holds.close()
        if self._pinning is not None:
            await self._pinning.close()
        if self._capacity is not None:
            self._capacity.close()

    def _owned_socket_paths(self) -> list[Path]:
        """Socket paths this process binds (and unlinks at exit while they are still its own,
        ``hwr.daemon.system.socket_files``): never the ones systemd passed in."""
        paths = [private_grpc_path(self.socket_path)]
        if self.inherited.grpc is None:
            paths.append(self.socket_path)
        if self.inherited.peer is None:
            paths.append(peer_path(self.socket_path))
        return paths

    @property
    def metrics_address(self) -> str | None:
        return self._metrics_server.address if self._metrics_server is not None else None

    def status_line(self) -> str:
        """One line for sd_notify STATUS= (systemctl status shows it)."""
        artifacts = len(self._catalog.artifacts_now()) if self._catalog is not None else 0
        return (f"serving: {artifacts} artifacts, {self.registry.lease_count()} leases, "
                f"{len(self.registry.sessions())} sessions")

    def set_capacity(self, config: DaemonConfig) -> None:
        """Apply new capacity limits (SIGHUP); reservations already granted stay granted."""
        if self._capacity is not None:
            self._capacity.policy = CapacityPolicy(
                config.store_limit_bytes, config.artifact_limit_bytes, config.min_free_bytes)

    def set_allow_list(self, allow_uids: tuple[int, ...], allow_gids: tuple[int, ...]) -> None:
        """Swap the allow-list atomically; existing sessions and leases are kept."""
        self._allow = daemon_allow_list(allow_uids, allow_gids)

    # callbacks wired into the parts ---------------------------------------------------------
    def _scrape(self) -> bytes:
        # The metrics server starts after every part exists.
        assert self._catalog is not None and self._publications is not None
        return exposition(catalog=self._catalog, registry=self.registry, publications=self._publications,
                          metrics=self.metrics, fleet=self._fleet, channels=self._channels)

    def _committed(self, key: str) -> None:
        # Push after publish (pulls excluded); a non-durable revision stays on this node: it is
        # gone at the next start, and superseded within seconds anyway.
        if self._fleet is not None and not (self._catalog is not None and self._catalog.is_volatile(key)):
            self._fleet.committed(key)

    async def _on_session_end(self, session: Session) -> None:
        released = self.registry.close_session(session)
        if self._channels is not None:
            self._channels.session_ended(session.session_id)
        aborted = 0
        if self._publications is not None:
            try:
                aborted = await self._publications.abort_session(session)
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
