"""hwrd assembled: the store, the session registry, publications, the peer channel and gRPC.

Start order: open the store (takes the root's lock, recovers staging, validates artifacts) ->
bind the peer channel -> bind gRPC (health SERVING last). Stop order (SIGTERM): health
NOT_SERVING -> stop accepting peers -> gRPC ``stop(grace)`` lets in-flight RPCs finish -> close
peer connections (ends sessions, aborts staged publications) -> close the store (drops the lock).
A publication in COMMITTING during shutdown finishes inside the grace period or is left as
staging, which the next start reclaims: the store is consistent at every step.

Socket activation (``hwr.daemon.system.activation``): sockets inherited from systemd replace the binds
of the peer channel and/or gRPC (gRPC then listens on a private ``<socket>.grpc`` behind a relay);
inherited paths are never unlinked. Metrics (``hwr.daemon.system.metrics``) start last, when configured.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from hwr import __version__
from hwr.client.errors import (
    ArtifactNotFound,
    ChecksumMismatch,
    HwrError,
    ManifestCorrupt,
    ManifestIncompatible,
    StoreLocked,
)
from hwr.client.paths import peer_path
from hwr.daemon.peer.channel import PeerServer
from hwr.daemon.peer.limits import PeerLimits
from hwr.daemon.peer.publish import PeerPublishing
from hwr.daemon.rpc.decode import add_servicer
from hwr.daemon.rpc.remote import remote_status
from hwr.daemon.rpc.servicer import Servicer, prefix_match
from hwr.daemon.service.publications import Publications
from hwr.daemon.service.sessions import Registry, Session
from hwr.daemon.system.activation import Assignment, GrpcRelay, private_grpc_path
from hwr.daemon.system.config import DaemonConfig
from hwr.daemon.system.metrics import Instruments, MetricsServer, exposition
from hwr.daemon.system.peercred import AllowList, daemon_allow_list
from hwr.protos.hwr.v1 import hwr_pb2 as pb
from hwr.protos.hwr.v1 import hwr_pb2_grpc

__all__ = ["Daemon"]

log = logging.getLogger("hwrd")
SERVICE_NAME = "hwr.v1.HostWeightRuntime"
#: Lease keys of checkpoint leases (hwr.daemon.rpc.checkpoints) are this prefix + checkpoint id.
CHECKPOINT_LEASE_PREFIX = "checkpoint:"


class Daemon:
    def __init__(self, config: DaemonConfig, *, inherited: Assignment | None = None) -> None:
        self.config = config
        self.inherited = inherited or Assignment()
        self.metrics = Instruments()
        self._metrics_server: MetricsServer | None = None
        self._relay: GrpcRelay | None = None
        self.socket_path = Path(config.socket)
        self.registry = Registry(max_leases_per_session=config.max_leases_per_session)
        self.store: Any = None
        self.store_service: Any = None  # hwr.daemon.service.store_service.StoreService
        self.publications: Publications
        self.checkpoints: Any = None  # hwr.daemon.checkpoints.registry.Checkpoints, opened in start()
        self.fleet: Any = None  # hwr.daemon.fleet.tier.Fleet when a remote tier is configured
        self._allow: AllowList = daemon_allow_list(config.allow_uids, config.allow_gids)
        from hwr.daemon.service.roles import roles_from

        self.roles = roles_from(config)  # publish/operator roles (hwr.daemon.service.roles); swapped on reload
        from hwr.daemon.service.leasing import Leasing

        self.leasing = Leasing(self)  # acquire/release for gRPC and the peer channel
        self._grpc: grpc.aio.Server | None = None
        self._peer: PeerServer | None = None
        self._health = health.aio.HealthServicer()
        self._started = time.monotonic()

    # lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        from hwr.daemon.store.root import Store

        adoption = None
        if self.config.adopt:  # a root written by vLLM-Omni 0.30's in-process store
            from hwr.daemon.store import adoption as adopt

            adoption = await asyncio.to_thread(adopt.prepare, Path(self.config.root))
        self.store = await asyncio.to_thread(Store.open, Path(self.config.root))
        if adoption is not None:
            await asyncio.to_thread(adopt.finish, self.store, adoption)
        from hwr.daemon.service.store_service import StoreService

        self.store_service = StoreService(self.config, self.store, self.registry)
        self.store_service.on_evict = self.metrics.count_eviction
        self.publications = Publications(self.store, gate=self.store_service,
                                         commit_threads=self.config.commit_threads,
                                         on_phase=self.metrics.observe_publication_phase,
                                         on_commit=self._committed)
        from hwr.daemon.system.memfd_staging import MemfdStagings

        self.publications.memfd_staging = MemfdStagings(self.config.memfd_staging_max_bytes)
        await self.store_service.start(self.publications)
        from hwr.daemon.fleet.tier import Fleet

        self.fleet = Fleet.open(self.config, self.store, self.publications)
        if self.fleet is not None:
            await self.fleet.start()
        from hwr.daemon.checkpoints.registry import Checkpoints

        self.checkpoints = Checkpoints(Path(self.config.root) / "checkpoints")
        await asyncio.to_thread(self.checkpoints.open)
        _prepare_socket_dir(self.socket_path)
        for path in self._owned_socket_paths():
            _claim_socket_path(path)
        self._peer = PeerServer(
            peer_path(self.socket_path), limits=PeerLimits.from_config(self.config),
            registry=self.registry, allow=lambda: self._allow,
            open_lease_fds=self._open_lease_fds, open_staging_fds=self._open_staging_fds,
            on_session_end=self._on_session_end, mode=self.config.socket_mode,
            listen_sock=self.inherited.peer, leasing=self.leasing,
            publishing=PeerPublishing(self.publications, self._open_staging_fds, roles=lambda: self.roles),
        )
        await self._peer.start()
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20)])
        add_servicer(hwr_pb2_grpc.add_HostWeightRuntimeServicer_to_server, Servicer(self), server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        grpc_path = self._grpc_bind_path()
        if server.add_insecure_port(f"unix:{grpc_path}") == 0:
            raise OSError(f"cannot bind {grpc_path}")
        await server.start()
        # The private path behind the relay is for the daemon's user only; clients use the unit's.
        os.chmod(grpc_path, 0o600 if self.inherited.grpc is not None else self.config.socket_mode)
        self._grpc = server
        if self.inherited.grpc is not None:
            self._relay = GrpcRelay(self.inherited.grpc, grpc_path)
            await self._relay.start()
        if self.config.metrics_listen:
            self._metrics_server = MetricsServer(self.config.metrics_listen, lambda: exposition(self))
            await self._metrics_server.start()
        await self._health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        await self._health.set("", health_pb2.HealthCheckResponse.SERVING)
        log.info("hwrd %s serving root=%s socket=%s", __version__, self.config.root, self.socket_path)

    async def stop(self, grace: float | None = None) -> None:
        grace = self.config.shutdown_grace_s if grace is None else grace
        await self._health.enter_graceful_shutdown()
        if self._relay is not None:
            await self._relay.stop_accepting()
        if self._peer is not None:
            await self._peer.stop_accepting()
        if self._grpc is not None:
            await self._grpc.stop(grace)
        if self._relay is not None:
            await self._relay.close()
        if self._peer is not None:
            await self._peer.close()
        if self._metrics_server is not None:
            await self._metrics_server.close()
        if self.fleet is not None:
            await self.fleet.stop()
        if self.store_service is not None:
            await self.store_service.stop()
        if self.store is not None:
            await asyncio.to_thread(self.store.close)
        if self.checkpoints is not None:
            self.checkpoints.close()
        for path in self._owned_socket_paths():
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        log.info("hwrd stopped")

    def _grpc_bind_path(self) -> Path:
        return private_grpc_path(self.socket_path) if self.inherited.grpc is not None else self.socket_path

    def _owned_socket_paths(self) -> list[Path]:
        """Socket paths this process binds (and unlinks): never the ones systemd passed in."""
        paths = [self._grpc_bind_path()]
        if self.inherited.peer is None:
            paths.append(peer_path(self.socket_path))
        return paths

    @property
    def metrics_address(self) -> str | None:
        return self._metrics_server.address if self._metrics_server is not None else None

    def status_line(self) -> str:
        """One line for sd_notify STATUS= (systemctl status shows it)."""
        return (f"serving: {len(self.store.artifacts())} artifacts, {self.registry.lease_count()} leases, "
                f"{len(self.registry.sessions())} sessions")

    def set_capacity(self, config: DaemonConfig) -> None:
        """Apply new capacity limits (SIGHUP); reservations already granted stay granted."""
        from hwr.daemon.policy.capacity import CapacityPolicy

        self.store_service.policy = CapacityPolicy(
            config.store_limit_bytes, config.artifact_limit_bytes, config.min_free_bytes)

    def set_allow_list(self, allow_uids: tuple[int, ...], allow_gids: tuple[int, ...]) -> None:
        """Swap the allow-list atomically; existing sessions and leases are kept."""
        self._allow = daemon_allow_list(allow_uids, allow_gids)

    # domain helpers used by the servicer ---------------------------------------------------
    async def lookup(self, key: str) -> Any:
        try:
            return await self.store_service.lookup(key)  # waits while the key is being evicted
        except ArtifactNotFound:
            if self.fleet is None:
                raise
            await self.fleet.pull_on_miss(key)  # a miss here: pull it from the remote tier, then
            return await self.store_service.lookup(key)  # the eviction gate again (see its docstring)
        except (ManifestCorrupt, ManifestIncompatible, ChecksumMismatch) as exc:
            self.metrics.count_verification_failure(exc.code)
            raise

    def _committed(self, key: str) -> None:
        if self.fleet is not None:
            self.fleet.committed(key)  # push after publish (pulls excluded)

    def manifest_bytes(self, record: Any) -> bytes:
        return self.leasing.manifest(record)[0]  # one cache for gRPC and the peer channel

    def metrics_acquire(self, seconds: float) -> None:
        self.metrics.observe_acquire(seconds)

    async def artifact_infos(self, include_denied: bool = False) -> list[pb.ArtifactInfo]:
        records = await asyncio.to_thread(self.store.artifacts)
        infos = [self.artifact_info(record) for record in records]
        if include_denied:  # inspected from disk (not cached): denied artifacts are few
            denied = await asyncio.to_thread(self.store.denied_records)
            infos += [self.artifact_info(r) if r is not None else self.denied_info(k) for k, r in denied]
        return infos

    def denied_info(self, key: str) -> pb.ArtifactInfo:
        """The listing entry of a denied key whose directory is gone (quarantined)."""
        return pb.ArtifactInfo(key=key, state=pb.ARTIFACT_STATE_DENIED, deny_reason=self.store.deny_reason(key) or "",
                               leases=self.registry.lease_count(key))

    def artifact_info(self, record: Any) -> pb.ArtifactInfo:
        """One artifact's listing entry; in memory only (the deny state is a dict lookup: no
        thread hop, which per artifact queued in the default executor under load)."""
        manifest = record.manifest
        identity = manifest.identity
        reason = self.store.deny_reason(record.key)
        return pb.ArtifactInfo(
            key=record.key, size_bytes=record.size_bytes, deny_reason=reason or "",
            state=pb.ARTIFACT_STATE_DENIED if reason is not None else pb.ARTIFACT_STATE_READY,
            leases=self.registry.lease_count(record.key), model_id=identity.source.model_id,
            component=identity.component.name, dtype=identity.representation.dtype,
            tensor_count=len(manifest.tensors), created_at=record.created_at,
            content_sha256=manifest.artifact_content_sha256,
        )

    async def resolve_prefix(self, prefix: str) -> str:
        """A full key among the listed artifacts and the denied ones (``hwrctl show``)."""
        records = await asyncio.to_thread(self.store.artifacts)
        denied = await asyncio.to_thread(self.store.denied_keys)
        return prefix_match(prefix, sorted({r.key for r in records} | set(denied)))

    async def record_any_state(self, key: str) -> Any:
        """The record of ``key``, ready or denied; None for a denied key whose directory is gone."""
        for record in await asyncio.to_thread(self.store.artifacts):
            if record.key == key:
                return record
        for denied, record in await asyncio.to_thread(self.store.denied_records):
            if denied == key:
                return record
        raise ArtifactNotFound("no artifact with that key", details={"key": key})

    async def status(self) -> pb.GetStatusResponse:
        records = await asyncio.to_thread(self.store.artifacts)
        return pb.GetStatusResponse(
            version=__version__, root=str(self.config.root), socket=str(self.socket_path),
            artifacts=len(records), leases=self.registry.lease_count(),
            sessions=len(self.registry.sessions()), publications=len(self.publications.active()),
            store_bytes=sum(r.size_bytes for r in records), uptime_s=time.monotonic() - self._started,
            pid=os.getpid(), remote=await remote_status(self),
        )

    # peer-channel callbacks ----------------------------------------------------------------
    def _open_lease_fds(self, session: Session, lease_id: str, token: str) -> list[int]:
        lease = self.registry.lease_for_fds(session, lease_id, token)
        if lease.key.startswith(CHECKPOINT_LEASE_PREFIX):
            return self.checkpoints.open_fds(self.checkpoints.get(lease.key[len(CHECKPOINT_LEASE_PREFIX):]))
        record = self.store_service.lookup_now(lease.key) or self.store.lookup(lease.key)
        return self.leasing.payload_fds(record)

    def _open_staging_fds(self, session: Session, publication_id: str, token: str) -> list[int]:
        from hwr.daemon.service.roles import PUBLISH

        self.roles.require(session.cred, PUBLISH, "open staging descriptors")
        pub = self.publications.staged_publication(session, publication_id, token)
        memfds = self.publications.memfd_staging
        if memfds is not None and memfds.eligible(pub.staging):  # sealed: cannot grow at all
            return memfds.descriptors(pub.publication_id, pub.staging)
        fds: list[int] = []
        try:
            for path in self.publications.staging_paths(session, publication_id, token):
                fds.append(os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC))
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return fds

    async def _on_session_end(self, session: Session) -> None:
        released = self.registry.close_session(session)
        try:
            aborted = await self.publications.abort_session(session)
        except HwrError as exc:
            log.warning("aborting publications of session %s failed: %s", session.session_id, exc)
            aborted = 0
        log.debug("session %s (pid %d) ended: %d leases released, %d publications aborted",
                  session.session_id, session.cred.pid, len(released), aborted)


def _prepare_socket_dir(path: Path) -> None:
    parent = path.parent
    if not parent.exists():
        parent.mkdir(parents=True, mode=0o755)


def _claim_socket_path(path: Path) -> None:
    """Remove a stale socket file; refuse when a live server still answers on it."""
    if not path.exists() and not path.is_symlink():
        return
    if not path.is_socket():
        raise StoreLocked(f"{path} exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(0.5)
        probe.connect(str(path))
    except OSError:
        path.unlink()
        return
    finally:
        probe.close()
    raise StoreLocked(f"another daemon is serving on {path}")
