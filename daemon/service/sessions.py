"""Sessions and leases: the daemon's in-memory registry.

A session is born when a client connects to the peer socket and dies when that connection
closes (process exit, SIGKILL, explicit close). Every lease and publication belongs to exactly
one session and ends with it.

Lease states (enforced here)::

    (none) --acquire--> HELD --release | session end--> RELEASED   (terminal, at most once)

Contract: methods are called from the daemon's event loop thread only (no locks); ids and tokens
are unguessable (``secrets``); tokens are compared in constant time. The table only: granting,
releasing and journaling a lease is ``hwr.daemon.service.leasing.Leasing``'s (nothing else calls
``add_lease``/``release``/``close_session``). Limit: the registry is not
persistent, so a daemon restart ends every session (clients reconnect and re-acquire).
"""

from __future__ import annotations

import hmac
import secrets
import time
from collections import Counter
from dataclasses import dataclass, field

from hwr.client.errors import InvalidRequest, PermissionDeniedError, SessionInvalid
from hwr.daemon.system.peercred import PeerCred

__all__ = ["LeaseRecord", "Registry", "Session"]


@dataclass(frozen=True)
class LeaseRecord:
    lease_id: str
    token: str
    key: str
    session_id: str
    pid: int
    uid: int
    client_name: str
    acquired_at: float


@dataclass
class Session:
    session_id: str
    token: str
    cred: PeerCred
    started_at: float
    client_name: str = ""
    client_version: str = ""
    leases: dict[str, LeaseRecord] = field(default_factory=dict)
    publications: set[str] = field(default_factory=set)
    closed: bool = False


class Registry:
    """Sessions by id and token, leases by id, lease counts by artifact key."""

    def __init__(self, *, max_leases_per_session: int = 4096, max_leases_per_uid: int = 65536) -> None:
        self._sessions: dict[str, Session] = {}
        self._by_token: dict[str, Session] = {}
        self._leases: dict[str, LeaseRecord] = {}
        self._per_key: Counter[str] = Counter()
        self._per_uid: Counter[int] = Counter()
        self.max_leases_per_session = max_leases_per_session
        # One uid's leases over all its sessions: every lease costs the daemon memory and a
        # lease-journal record, so one uid's sessions may not hold without bound.
        self.max_leases_per_uid = max_leases_per_uid
        self.leases_granted = 0
        self.leases_released = 0

    # sessions -----------------------------------------------------------------------------
    def open_session(self, cred: PeerCred) -> Session:
        session = Session(secrets.token_hex(8), secrets.token_hex(24), cred, time.time())
        self._sessions[session.session_id] = session
        self._by_token[session.token] = session
        return session

    def session_for_token(self, token: str | None) -> Session:
        if not token:
            raise SessionInvalid("missing session token (connect through hwr.client.connect)")
        session = self._by_token.get(token)
        if session is None or session.closed or not hmac.compare_digest(session.token, token):
            raise SessionInvalid("unknown or ended session; reconnect")
        return session

    def close_session(self, session: Session) -> list[LeaseRecord]:
        """End a session and every lease it holds; idempotent. Returns the leases released."""
        if session.closed:
            return []
        session.closed = True
        self._sessions.pop(session.session_id, None)
        self._by_token.pop(session.token, None)
        released = [self._drop(lease) for lease in list(session.leases.values())]
        session.leases.clear()
        return released

    def sessions(self) -> list[Session]:
        return list(self._sessions.values())

    # leases -------------------------------------------------------------------------------
    def add_lease(self, session: Session, key: str) -> LeaseRecord:
        if session.closed:
            raise SessionInvalid("session ended")
        if len(session.leases) >= self.max_leases_per_session:
            raise InvalidRequest(
                "too many leases in one session",
                details={"limit": self.max_leases_per_session},
            )
        if self._per_uid[session.cred.uid] >= self.max_leases_per_uid:
            raise InvalidRequest(
                f"uid {session.cred.uid} holds {self.max_leases_per_uid} leases, the most hwrd allows one uid; "
                "release some",
                details={"limit": self.max_leases_per_uid, "reason": "LEASES_PER_UID"},
            )
        lease = LeaseRecord(
            lease_id=secrets.token_hex(8),
            token=secrets.token_hex(24),
            key=key,
            session_id=session.session_id,
            pid=session.cred.pid,
            uid=session.cred.uid,
            client_name=session.client_name,
            acquired_at=time.time(),
        )
        session.leases[lease.lease_id] = lease
        self._leases[lease.lease_id] = lease
        self._per_key[key] += 1
        self._per_uid[lease.uid] += 1
        self.leases_granted += 1
        return lease

    def lease_for_fds(self, session: Session, lease_id: str, token: str) -> LeaseRecord:
        """The lease whose descriptors the session's own peer connection asks for."""
        lease = session.leases.get(lease_id)
        if lease is None or not hmac.compare_digest(lease.token, token):
            raise PermissionDeniedError("no such lease in the caller's session")
        return lease

    def release(self, session: Session, lease_id: str) -> bool:
        """Release one lease of ``session``; False if ``session`` already released it."""
        lease = session.leases.pop(lease_id, None)
        if lease is None:
            if lease_id in self._leases:
                raise PermissionDeniedError("the lease belongs to another session")
            return False
        self._drop(lease)
        return True

    def _drop(self, lease: LeaseRecord) -> LeaseRecord:
        self._leases.pop(lease.lease_id, None)
        self._per_key[lease.key] -= 1
        if self._per_key[lease.key] <= 0:
            del self._per_key[lease.key]
        self._per_uid[lease.uid] -= 1
        if self._per_uid[lease.uid] <= 0:
            del self._per_uid[lease.uid]
        self.leases_released += 1
        return lease

    def leases(self) -> list[LeaseRecord]:
        return list(self._leases.values())

    def lease_count(self, key: str | None = None) -> int:
        return len(self._leases) if key is None else self._per_key.get(key, 0)
