"""The peer socket: authentication, session liveness, descriptor passing, and the lease hot path.

One SOCK_STREAM Unix socket at ``<socket>.peer``. Per connection:

1. The daemon reads SO_PEERCRED and applies the allow-list; a refused peer gets one error frame
   ``{"ok": false, "code": "PERMISSION_DENIED", ...}`` and the connection is closed.
2. Otherwise it opens a session and sends ``{"ok": true, "session_id", "token", "pid", "uid"}``.
3. Requests, one at a time, each answered by one frame (state table: any request is valid in
   any order once the session is open; the session is the connection):

   ====================  ======================================  ==================================
   request op            fields                                  reply (``ok: true``)
   ====================  ======================================  ==================================
   ``hello``             ``client_name``, ``client_version``     ``session_id``, ``pid``, ``uid``,
                         (strings <= 128 chars)                  ``daemon_version`` (= OpenSession)
   ``acquire``           ``key`` (64 hex), ``identity``          ``lease_id``, ``lease_token``,
                         (canonical identity JSON as a string)   ``key``, ``manifest_sha256``,
                         or ``channel`` (a name: the key it
                         points to now);
                         optional ``have`` (a manifest sha256    ``manifest_bytes`` (N), ``count``;
                         the client holds: then N is 0)          descriptors + N raw manifest bytes
   ``release``           ``lease_id``                            ``released`` (bool)
   ``fds``               ``lease_id``, ``lease_token``           ``count``; descriptors
   ``staging_fds``       ``publication_id``, ``publication_token`` ``count``; descriptors
   ``publish_begin``     see ``hwr.daemon.peer.publication_frames``          ``outcome``, ``key``, placements;
   ``publish_commit``    (the publication RPCs on this channel)   staging descriptors when staged
   ``publish_abort``
   ``publish_file_done`` (a staging file handed over)
   ``ping``              -                                       -
   ====================  ======================================  ==================================

   ``acquire`` with a remote tier: optional ``pull`` = ``"wait"`` (wait for a pull of the key
   while it advances, with interim frames ``{"ok": true, "pending": "pull", "key", "remote",
   "phase", "done_bytes", "total_bytes"}`` every ``progress_ms`` (100..60000, default 1000)
   before the final reply; they carry no descriptors and no tail) or ``"fallback"`` (start the
   pull, miss at once: ``LOCAL_MISS`` with ``details.pulling``). Without ``pull`` the acquire
   waits too, silently (clients before this field).

   ``acquire``/``release`` are the same operations as the gRPC ``Acquire``/``Release`` RPCs (one
   implementation: ``Leasing.grant``/``release`` in ``hwr.daemon.service.leasing``; this module
   only parses the request and encodes the ``Grant``), with typed errors as error frames
   ``{"ok": false, "code", "message", "details"}`` carrying the same code, message and details
   the RPC would put in its status and trailing metadata. An ``acquire`` reply carries the
   payload descriptors (O_RDONLY, manifest file order, SCM_RIGHTS on the first byte) and, after
   the JSON frame, ``manifest_bytes`` raw bytes of manifest JSON (never size-limited by
   ``MAX_FRAME``). A request that is valid JSON but wrong (unknown op, missing or invalid field)
   gets an error frame and the connection stays usable; bytes that are not a frame end it.
4. EOF (or any protocol error) ends the session: its leases are released and its staged
   publications aborted, immediately (well within the 2 s liveness bound).

Only the connection that owns a session can fetch its descriptors: the token alone is useless
to another process. Descriptors are opened per request and closed right after sending.

Bounds per connection and per uid (sessions, descriptors in flight, partial frames, a stalled
frame's timeout): ``hwr.daemon.peer.limits``. Node-wide, sessions hold at most a quarter of
hwrd's soft ``RLIMIT_NOFILE`` (one descriptor each; ``SESSION_SHARE``), shared fairly between
uids (``hwr.daemon.policy.connection_share``): at that budget a uid holding fewer sessions than
the biggest holder less one gets in by ending that holder's least recently active session (its
client reconnects and reattaches its leases, as after a daemon restart); any other newcomer gets
``DAEMON_UNAVAILABLE`` (``details.reason = "SESSIONS_BUDGET"``, retryable). So however many uids
hold sessions, they cannot take the last descriptors from an innocent client. One connection's
reading, ordering and replies: ``hwr.daemon.peer.connection``; this module accepts, greets and
dispatches requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import resource
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hwr import __version__
from hwr.client.errors import DaemonUnavailable, HwrError, InvalidRequest, PermissionDeniedError
from hwr.client.wire import MAX_FRAME, error_frame, send_frame
from hwr.daemon.peer.connection import LATER, Later, PeerConnection, Served
from hwr.daemon.peer.limits import Ledger, PeerLimits
from hwr.daemon.policy.connection_share import connection_budget, share_verdict
from hwr.daemon.service.sessions import Registry, Session
from hwr.daemon.system.accepting import Acceptor, cancel_and_wait
from hwr.daemon.system.peercred import AllowList, peer_allowed, read_peercred

if TYPE_CHECKING:
    from hwr.daemon.peer.publication_frames import PublicationFrames
    from hwr.daemon.service.leasing import ArtifactRef, Grant, Leasing

__all__ = ["PeerServer"]

log = logging.getLogger("hwrd.peer")

_PUBLISH_OPS = {"publish_begin": "begin", "publish_commit": "commit", "publish_abort": "abort"}
#: The share of the soft open-files limit that sessions (one descriptor each) may hold, and the
#: fewest the budget allows.
SESSION_SHARE = 0.25
MIN_SESSION_BUDGET = 64


class PeerServer:
    """The peer socket's server (see the module docstring).

    Connections are ``asyncio.Protocol`` objects: a request whose work is synchronous (every
    operation except an ``acquire`` that must wait for validation or an eviction round) is
    parsed, served and answered inside ``data_received``, with the reply sent by one direct
    ``sendmsg`` on the socket (descriptors and all) -- no task, future or reader registration per
    request. Anything else pauses reading, runs in a task, and resumes; requests on one
    connection are always answered in order.
    """

    def __init__(
        self,
        path: Path,
        *,
        registry: Registry,
        allow: Callable[[], AllowList],
        on_session_end: Callable[[Session], Awaitable[None]],
        mode: int = 0o660,
        listen_sock: socket.socket | None = None,
        leasing: Leasing | None = None,
        publication_frames: PublicationFrames | None = None,
        limits: PeerLimits | None = None,
    ) -> None:
        self.path = path
        self._registry = registry
        self._allow = allow
        self._on_session_end = on_session_end
        self._leasing = leasing  # acquire/release/lease descriptors; None: refused
        self._publication_frames = publication_frames  # publish_* and staging descriptors; None: refused
        self._mode = mode
        self._sock = listen_sock
        self._task: asyncio.Task[None] | None = None
        self._acceptor: Acceptor | None = None
        self._conns: set[PeerConnection] = set()
        self._sessions_of: dict[int, set[PeerConnection]] = {}  # the connections with a session, by uid
        self.ledger = Ledger(limits or PeerLimits())
        self.shed = 0  # sessions ended to make room for another uid

    async def start(self) -> None:
        if self._sock is None:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.bind(str(self.path))
            os.chmod(self.path, self._mode)
            sock.listen(512)
            self._sock = sock
        self._sock.setblocking(False)
        self._acceptor = Acceptor(self._sock, "peer socket", refuse=_refuse)
        self._task = asyncio.get_running_loop().create_task(self._accept_loop())

    async def stop_accepting(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)
        if self._acceptor is not None:
            self._acceptor.close()
            self._acceptor = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    async def close(self) -> None:
        await self.stop_accepting()
        conns = list(self._conns)
        for conn in conns:
            conn.abort()
        if conns:
            await asyncio.gather(*(conn.ended for conn in conns), return_exceptions=True)

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._acceptor is not None
        while True:
            sock = await self._acceptor.accept()
            conn = PeerConnection(self, sock, loop)
            self._conns.add(conn)
            conn.ended.add_done_callback(lambda _f, c=conn: self._conns.discard(c))
            try:
                await loop.connect_accepted_socket(lambda c=conn: c, sock)
            except OSError as exc:
                log.debug("peer connection failed at setup: %s", exc)
                sock.close()
                conn.connection_lost(exc)

    # ---------------------------------------------------------------- request handling
    def session_budget(self) -> int:
        """Sessions hwrd holds at most, node-wide (see the module docstring)."""
        return connection_budget(_soft_nofile(), 1, SESSION_SHARE, MIN_SESSION_BUDGET)

    def _session_gone(self, conn: PeerConnection) -> None:
        """``conn``'s session ended (its connection was lost)."""
        assert conn.session is not None
        uid = conn.session.cred.uid
        mine = self._sessions_of.get(uid)
        if mine is not None:
            mine.discard(conn)
            if not mine:
                del self._sessions_of[uid]
        if not conn.shed:  # a shed one left the ledger when it was shed
            self.ledger.session_closed(uid)

    def _greet(self, sock: socket.socket,
               conn: PeerConnection | None = None) -> tuple[Session | None, dict[str, Any]]:
        cred = read_peercred(sock)
        if not peer_allowed(cred, self._allow()):
            log.warning("refused peer pid=%d uid=%d gid=%d", cred.pid, cred.uid, cred.gid)
            return None, error_frame(PermissionDeniedError(f"uid {cred.uid} is not on hwrd's allow-list"))
        if not self.ledger.session_allowed(cred.uid):
            limit = self.ledger.limits.max_sessions_per_uid
            log.warning("refused peer pid=%d uid=%d: it has %d sessions open (max_sessions_per_uid)",
                        cred.pid, cred.uid, limit)
            return None, error_frame(DaemonUnavailable(
                f"uid {cred.uid} has {limit} sessions open, the most hwrd allows one uid; close some",
                details={"reason": "SESSIONS_PER_UID", "limit": limit}))
        budget = self.session_budget()
        verdict = share_verdict(self.ledger.sessions_by_uid, cred.uid, budget)
        if not verdict.admit:
            log.warning("refused peer pid=%d uid=%d: hwrd holds %d sessions, its budget, and this uid holds as "
                        "many as any other", cred.pid, cred.uid, budget)
            return None, error_frame(DaemonUnavailable(
                f"hwrd holds {budget} sessions, the most its open-files limit allows, and uid {cred.uid} holds as "
                "many as any other uid; retry later", details={"reason": "SESSIONS_BUDGET", "limit": budget}))
        if verdict.shed_uid is not None:
            self._shed_one(verdict.shed_uid, cred.uid, budget)
        session = self._registry.open_session(cred)
        self.ledger.session_opened(cred.uid)
        if conn is not None:
            self._sessions_of.setdefault(cred.uid, set()).add(conn)
        return session, {"ok": True, "session_id": session.session_id, "token": session.token,
                         "pid": cred.pid, "uid": cred.uid}

    def _shed_one(self, uid: int, newcomer: int, budget: int) -> None:
        """End the least recently active session of ``uid`` (it holds the most) for ``newcomer``."""
        candidates = [c for c in self._sessions_of.get(uid, ()) if not c.shed and not c.closed]
        if not candidates:
            return
        victim = min(candidates, key=lambda c: c.last_active)
        victim.shed = True
        self.ledger.session_closed(uid)  # now: the connection ends in a later step of the loop
        self.shed += 1
        log.warning("ended the least recently active session of uid %d (it holds the most) to admit uid %d: "
                    "hwrd holds %d sessions, its budget", uid, newcomer, budget)
        victim.abort()

    def handle_now(self, session: Session, req: dict[str, Any]) -> Served | Later:
        """(reply, fds, tail) for a request served synchronously, or ``LATER``; every failure
        becomes an error frame (``_failure_frame``) and the connection stays usable."""
        op = req.get("op")
        try:
            if op == "acquire":
                if self._leasing is None:
                    return LATER  # refused there
                key = self._leasing.key_for(_artifact_ref(req))
                now = self._leasing.grant_now(session, key, have=_have(req))
                if now is None:
                    return LATER
                return _granted(now)
            if op in _PUBLISH_OPS:
                return LATER
            reply, fds = self._serve_now(session, op, req)
            return reply, fds, b""
        except Exception as exc:
            return _failure_frame(op, exc), [], b""

    async def handle_later(self, session: Session, req: dict[str, Any],
                            notify: Callable[[dict[str, Any]], bool] | None = None,
                            ) -> Served:
        """A request that awaits (a publication op, or an ``acquire`` that must validate, wait out
        an eviction round or wait for a pull); every failure becomes an error frame
        (``_failure_frame``). ``notify(frame)`` sends an interim frame; False once the
        connection is gone."""
        op = req.get("op")
        try:
            if op in _PUBLISH_OPS:
                if self._publication_frames is None:
                    raise PermissionDeniedError(f"peer operation {op!r} is not served here")
                reply, fds = await getattr(self._publication_frames, _PUBLISH_OPS[op])(session, req)
                return reply, fds, b""
            if self._leasing is None:
                raise PermissionDeniedError("peer operation 'acquire' is not served here")
            key = self._leasing.key_for(_artifact_ref(req))
            pull = req.get("pull")
            if pull not in (None, "wait", "fallback"):
                raise InvalidRequest("pull must be 'wait' or 'fallback'", details={"field": "pull"})
            acquiring = asyncio.ensure_future(
                self._leasing.grant(session, key, have=_have(req), wait=pull != "fallback"))
            if pull == "wait" and notify is not None:
                await self._report_pull(acquiring, key, _progress_interval(req), notify)
            return _granted(await acquiring)
        except Exception as exc:
            return _failure_frame(op, exc), [], b""

    async def _report_pull(self, acquiring: asyncio.Future[Any], key: str, interval: float,
                           notify: Callable[[dict[str, Any]], bool]) -> None:
        """Until ``acquiring`` is done: every ``interval``, an interim frame while a pull of
        ``key`` runs. The connection gone, the acquire is cancelled (not the pull: other waiters
        and the next start want it)."""
        assert self._leasing is not None
        while not acquiring.done():
            await asyncio.wait({acquiring}, timeout=interval)
            if acquiring.done():
                return
            progress = self._leasing.pulling(key)
            if progress is None:
                continue  # validating or waiting out an eviction round: short, no report
            if not notify({"ok": True, "pending": "pull", "key": key, "remote": progress.remote,
                           "phase": progress.phase, "done_bytes": progress.done_bytes,
                           "total_bytes": progress.total_bytes}):
                acquiring.cancel()
                with contextlib.suppress(BaseException):
                    await acquiring
                raise DaemonUnavailable("the acquiring client went away")

    def _serve_now(self, session: Session, op: object, req: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        """``hello``, ``release``, ``ping``, ``fds``, ``staging_fds`` (module docstring); an
        unknown op is refused. Raises typed errors (the caller makes them frames)."""
        if op == "ping":
            return {"ok": True}, []
        if op == "hello":
            name, version = req.get("client_name", ""), req.get("client_version", "")
            if not isinstance(name, str) or not isinstance(version, str) or len(name) > 128 \
                    or len(version) > 128:
                raise InvalidRequest("client_name/client_version must be strings of at most 128 characters")
            session.client_name, session.client_version = name, version
            return {"ok": True, "session_id": session.session_id, "pid": session.cred.pid,
                    "uid": session.cred.uid, "daemon_version": __version__}, []
        if op in ("release", "fds"):
            if self._leasing is None:
                raise PermissionDeniedError(f"peer operation {op!r} is not served here")
            if op == "fds":
                fds = self._leasing.lease_fds(session, _str(req, "lease_id"), _str(req, "lease_token"))
                return {"ok": True, "count": len(fds)}, fds
            lease_id = req.get("lease_id")
            if not isinstance(lease_id, str):
                raise InvalidRequest("lease_id is required")
            return {"ok": True, "released": self._leasing.release(session, lease_id)}, []
        if op == "publish_file_done":
            if self._publication_frames is None:
                raise PermissionDeniedError(f"peer operation {op!r} is not served here")
            return self._publication_frames.file_done(session, req), []
        if op == "staging_fds":
            if self._publication_frames is None:
                raise PermissionDeniedError(f"peer operation {op!r} is not served here")
            frames = self._publication_frames
            fds = frames.staging_fds(session, _str(req, "publication_id"), _str(req, "publication_token"))
            return {"ok": True, "count": len(fds)}, fds
        raise PermissionDeniedError(f"unknown peer operation {str(op)[:40]!r}")


def _artifact_ref(req: dict[str, Any]) -> ArtifactRef:
    """The acquire's reference, decoded (``Leasing.key_for`` resolves it; a channel to the key it
    points to now, in the same loop step as the lease)."""
    from hwr.client.channels import check_channel_name
    from hwr.daemon.service.leasing import ArtifactRef

    channel = req.get("channel")
    if channel is not None:
        return ArtifactRef(channel=check_channel_name(channel))
    key, identity = req.get("key"), req.get("identity")
    if identity is not None:
        if not isinstance(identity, str) or len(identity) > MAX_FRAME:
            raise InvalidRequest("identity must be canonical identity JSON text", details={"field": "identity"})
        return ArtifactRef(identity_json=identity.encode())
    if key is not None and not isinstance(key, str):
        raise InvalidRequest("key must be 64 lowercase hex digits", details={"field": "artifact.key"})
    return ArtifactRef(key=key)


def _have(req: dict[str, Any]) -> str | None:
    """The manifest digest the client holds (anything else never matches one)."""
    have = req.get("have")
    return have if isinstance(have, str) else None


def _granted(grant: Grant) -> Served:
    """An ``acquire`` reply: the frame, the descriptors, the manifest tail (module docstring)."""
    return ({"ok": True, "lease_id": grant.lease_id, "lease_token": grant.token, "key": grant.key,
             "manifest_sha256": grant.manifest_sha256, "manifest_bytes": len(grant.manifest),
             "count": len(grant.fds)}, grant.fds, grant.manifest)


def _progress_interval(req: dict[str, Any]) -> float:
    value = req.get("progress_ms", 1000)
    if isinstance(value, bool) or not isinstance(value, int) or not 100 <= value <= 60000:
        raise InvalidRequest("progress_ms must be an integer in [100, 60000]", details={"field": "progress_ms"})
    return value / 1000


def _str(req: dict[str, Any], name: str) -> str:
    value = req.get(name)
    if not isinstance(value, str) or not value or len(value) > 256:
        raise PermissionDeniedError(f"peer request field {name!r} is missing or invalid")
    return value


def _refuse(sock: socket.socket) -> None:
    """The greeting of a connection accepted with the spare descriptor while the daemon has
    none left (``hwr.daemon.system.accepting``): a typed, retryable error instead of a timeout."""
    sock.settimeout(1.0)
    send_frame(sock, error_frame(DaemonUnavailable(
        "hwrd has no file descriptor left for a new session (too many open connections); retry later",
        details={"reason": "EMFILE"})))


def _failure_frame(op: object, exc: Exception) -> dict[str, Any]:
    """The error frame of a request that failed: a typed error as it is; an OS error (out of
    descriptors or memory: the host's state, not a bug) with its errno and a warning, no
    traceback; anything else is a bug, logged with one. The request fails, not the session."""
    if isinstance(exc, HwrError):
        return error_frame(exc)
    name = str(op)[:40]
    if isinstance(exc, OSError):
        log.warning("peer operation %s failed: %s", name, exc)
        return error_frame(HwrError(f"peer operation {name} failed: {exc.strerror or exc}",
                                    details={"errno": errno.errorcode.get(exc.errno or 0, str(exc.errno))}))
    log.error("internal error in peer operation %s", name, exc_info=exc)
    return error_frame(HwrError(f"internal error in peer operation {name}"))


def _soft_nofile() -> int:
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return soft if soft != resource.RLIM_INFINITY else 1 << 20
