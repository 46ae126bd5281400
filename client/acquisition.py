"""Leases from hwrd: acquire on the peer socket, and reattach after a reconnect.

An ``Acquirer`` turns an identity, key or channel name into a ``Lease`` (one peer request and one
reply: the lease id, the manifest and the payload descriptors, see ``hwr.daemon.peer.server``),
and keeps the table of open leases that a reconnect reattaches. Checkpoint leases
(``Client.acquire_checkpoint``) are not in that table: they are never reattached.

Two per-process manifest caches make a repeated lease of one artifact cheap: ``_MANIFESTS``
(key -> digest and parsed manifest: the request says which manifest this process holds, and the
daemon then sends no manifest bytes) and ``_parse_manifest`` (a manifest's bytes name it, so it
is validated once per process).

Reattach contract: after the daemon restarted, ``reattach`` re-acquires the key of every open
lease on the new session. A lease keeps its mappings (they are mappings of immutable files and
stay valid whatever the daemon does) and is rebound to the new lease id when the daemon hands
out the *same files* (same dev:inode); otherwise (evicted and republished meanwhile, or denied)
it is detached: still readable, no longer counted by the daemon (which still sees its mappings
in the mappings scan). A closed lease is not reattached.

Waiting for a pull: when hwrd has a remote tier and the key is being pulled (or the acquire
starts the pull), the daemon answers the ``acquire`` with interim progress frames (every
``progress_ms``) until the lease or the pull's typed error; the acquire waits as long as they
come, so its timeout bounds each silence of the daemon, not the pull. hwrd itself ends a pull
that stops receiving bytes (its ``remote_stall_timeout_s``) and fails every waiter with
``RemoteUnavailable``. ``wait_for_pull=False`` starts the pull and misses at once
(``ArtifactNotFound`` with ``details["pulling"]``), leaving the pull running for the next start.

Thread safety: the open-lease table has its own lock, a leaf (never held while talking to hwrd
or while taking another lock): callers add to it (``acquire``); ``reattach`` runs under the
connection's reconnect lock (one at a time), reads a copy and pops from it; the watcher's
``any_open`` reads a copy. Limits: the manifest cache is cleared whole when it passes 256 keys,
and a clear racing an acquire that said it held the manifest leaves that acquire's reply without
a manifest (``DaemonUnavailable``, which ``acquire`` answers as a broken channel: it reconnects
and asks again).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hwr.client.channels import check_channel_name
from hwr.client.errors import DaemonUnavailable, DeadlineExceeded, HwrError, InvalidRequest, ManifestCorrupt
from hwr.client.identity import ArtifactIdentity, is_key
from hwr.client.manifest import Manifest
from hwr.client.wire import close_fds

if TYPE_CHECKING:  # the lease modules import torch: only the calls that build tensors load them
    from hwr.client.connection import Connection, ReattachReport
    from hwr.client.lease import Lease

__all__ = ["Acquirer", "PullReport"]


@dataclass(frozen=True)
class PullReport:
    """hwrd's report on the pull an acquire waits for (``acquire(on_pull=...)``)."""

    key: str
    remote: str
    phase: str  # documents | admission | download | commit
    done_bytes: int
    total_bytes: int

    @classmethod
    def from_frame(cls, frame: dict[str, Any]) -> PullReport:
        def number(name: str) -> int:
            value = frame.get(name, 0)
            return value if isinstance(value, int) and value >= 0 else 0

        return cls(str(frame.get("key", ""))[:64], str(frame.get("remote", ""))[:512],
                   str(frame.get("phase", ""))[:32], number("done_bytes"), number("total_bytes"))

    @property
    def fraction(self) -> float:
        return self.done_bytes / self.total_bytes if self.total_bytes else 0.0

#: key -> (sha256 of the manifest bytes the daemon sent, parsed manifest): lets ``acquire`` tell the
#: daemon which manifest this process already holds, so the daemon sends it only once per process.
_MANIFESTS: dict[str, tuple[str, Manifest]] = {}


@functools.lru_cache(maxsize=32)
def _parse_manifest(data: bytes) -> Manifest:
    """Strictly parse a manifest once per process: a manifest is immutable, its bytes name it.

    Repeated leases of the same artifact (every restart of a pipeline in a long-lived worker,
    the latency benchmarks) then skip the O(tensors) validation. Errors are not cached.
    """
    return Manifest.from_json(data)


class Acquirer:
    """Acquires and releases the leases of one connection, and reattaches them after a reconnect."""

    def __init__(self, connection: Connection) -> None:
        self._connection = connection
        #: Open leases with the (dev, inode) of their files: what ``reattach`` compares.
        self._open_leases: weakref.WeakKeyDictionary[Lease, tuple[tuple[int, int], ...]] = (
            weakref.WeakKeyDictionary())
        self._table_lock = threading.Lock()  # guards _open_leases (a leaf: see the module docstring)
        #: channel -> the key it pointed to at this client's last acquire through it (a hint only:
        #: the request then says which manifest this process holds).
        self._channel_keys: dict[str, str] = {}

    def peer_acquire(self, key: str, identity: bytes | None = None, deadline: float | None = None, *,
                     channel: str | None = None, wait_for_pull: bool = True,
                     on_pull: Callable[[PullReport], None] | None = None,
                     ) -> tuple[str, str, Manifest, list[int]]:
        """The peer socket's ``acquire`` of ``key`` (sent as ``identity``, its canonical bytes,
        when given; or of the key ``channel`` points to, then ``key`` is the one it pointed to
        last, or "") within ``deadline`` (``time.monotonic()``; None: the connection's timeout;
        while hwrd reports a pull of the key, the deadline bounds each silence instead, see the
        module docstring): (lease id, key, manifest, descriptors). A reply for another artifact
        than the one asked for (its key; through a channel, whatever key it names; or its
        manifest's identity, or manifest bytes that do not hash to the digest sent with them) is
        ``ManifestCorrupt``: the lease is released and its descriptors closed."""
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise DeadlineExceeded("the acquire's deadline passed before hwrd was asked")
        request: dict[str, Any] = {"op": "acquire", "pull": "wait" if wait_for_pull else "fallback"}
        if channel is not None:
            request["channel"] = channel
        elif identity is not None:
            request["identity"] = identity.decode()
        else:
            request["key"] = key
        cached = _MANIFESTS.get(key)
        if cached is not None:  # the daemon then sends no manifest bytes
            request["have"] = cached[0]
        silence = left if left is not None else self._connection.timeout
        request["progress_ms"] = int(max(100, min(1000, silence * 250)))  # 4 frames per silence bound

        def pending(frame: dict[str, Any]) -> None:
            if on_pull is not None:
                with contextlib.suppress(Exception):  # the caller's report must not break the stream
                    on_pull(PullReport.from_frame(frame))

        reply, fds, tail = self._connection.exchange(request, want_fds=True, timeout=left, on_pending=pending)
        try:
            try:
                lease_id, got_key, digest = (str(reply["lease_id"]), str(reply["key"]),
                                             str(reply["manifest_sha256"]))
            except KeyError:
                raise DaemonUnavailable("malformed acquire reply from hwrd") from None
            if channel is None and got_key != key:
                raise ManifestCorrupt(f"hwrd answered an acquire of {key[:16]} with artifact {got_key[:16]}",
                                      details={"key": key, "reply_key": got_key[:64]})
            if tail:
                manifest = _parse_manifest(tail)
                if manifest.key != got_key or hashlib.sha256(tail).hexdigest() != digest:
                    raise ManifestCorrupt(f"hwrd answered an acquire of {got_key[:16]} with the manifest of "
                                          f"artifact {manifest.key[:16]}", details={"key": got_key[:64]})
                if len(_MANIFESTS) > 256:
                    _MANIFESTS.clear()
                _MANIFESTS[got_key] = (digest, manifest)
            else:
                cached = _MANIFESTS.get(got_key)
                if cached is None or cached[0] != digest:
                    raise DaemonUnavailable("hwrd omitted a manifest this process does not hold")
                manifest = cached[1]
        except BaseException:
            close_fds(fds)
            if "lease_id" in reply:
                with contextlib.suppress(HwrError):
                    self._connection.exchange({"op": "release", "lease_id": str(reply["lease_id"])},
                                              want_fds=False)
            raise
        return lease_id, got_key, manifest, fds

    def acquire(self, artifact: ArtifactIdentity | str, *, copy_on_write: bool = False,
                populate: bool = False, timeout: float | None = None, wait_for_pull: bool = True,
                on_pull: Callable[[PullReport], None] | None = None) -> Lease:
        """Lease an artifact by identity or 64-hex key (``Client.acquire`` documents the contract)."""
        if isinstance(artifact, ArtifactIdentity):
            identity = artifact.canonical_bytes
            key = hashlib.sha256(identity).hexdigest()  # = artifact.key
        elif isinstance(artifact, str) and is_key(artifact):
            key, identity = artifact, None
        else:
            raise InvalidRequest("acquire takes an ArtifactIdentity or a 64-hex key")
        deadline = None if timeout is None else time.monotonic() + timeout
        lease_id, key, manifest, fds = self._connection.with_reconnect(
            lambda: self.peer_acquire(key, identity, deadline, wait_for_pull=wait_for_pull, on_pull=on_pull),
            deadline)
        return self._lease(lease_id, key, manifest, fds, copy_on_write=copy_on_write, populate=populate)

    def _lease(self, lease_id: str, key: str, manifest: Manifest, fds: list[int], *, copy_on_write: bool,
               populate: bool) -> Lease:
        from hwr.client.lease import Lease

        # Lease owns the descriptors from here (closes them, and releases the lease on failure).
        lease = Lease(lease_id=lease_id, key=key, manifest=manifest, fds=fds,
                      release=self.release, copy_on_write=copy_on_write, populate=populate)
        with self._table_lock:
            self._open_leases[lease] = lease.file_ids
        self._connection.start_watcher(self.any_open)
        return lease

    def acquire_channel(self, name: str, *, copy_on_write: bool = False, populate: bool = False,
                        timeout: float | None = None) -> Lease:
        """Lease the key channel ``name`` points to now (``Client.acquire_channel``)."""
        check_channel_name(name)
        deadline = None if timeout is None else time.monotonic() + timeout
        last = self._channel_keys.get(name, "")  # its manifest is likely the one hwrd would send
        lease_id, key, manifest, fds = self._connection.with_reconnect(
            lambda: self.peer_acquire(last, None, deadline, channel=name), deadline)
        if len(self._channel_keys) > 256:
            self._channel_keys.clear()
        self._channel_keys[name] = key
        return self._lease(lease_id, key, manifest, fds, copy_on_write=copy_on_write, populate=populate)

    def release(self, lease_id: str) -> None:
        """Release ``lease_id``; nothing once the connection is closed or in a forked child (the
        session's end released it, or it is the parent's)."""
        if not self._connection.active:
            return
        self._connection.exchange({"op": "release", "lease_id": lease_id}, want_fds=False)

    def any_open(self) -> bool:
        """Whether a lease of this table is still open (the reconnect watcher runs while so)."""
        with self._table_lock:
            leases = list(self._open_leases)
        return any(not lease.closed for lease in leases)

    def reattach(self) -> ReattachReport:
        """Re-acquire every open lease on the connection's new session (see the module contract)."""
        reattached, detached = 0, []
        with self._table_lock:
            table = list(self._open_leases.items())
        for lease, files in table:
            if lease.closed:
                continue
            try:
                lease_id, _key, _manifest, fds = self.peer_acquire(lease.key)
            except HwrError:
                detached.append(lease.key)
                self._forget(lease)
                continue
            try:
                same = tuple((st.st_dev, st.st_ino) for st in map(os.fstat, fds)) == files
            finally:
                close_fds(fds)
            if same and lease.rebind(lease_id):
                reattached += 1
                continue
            # Other files, or the application closed the lease while it was being reattached
            # (its close released the old id): the new one is not wanted.
            with contextlib.suppress(HwrError):
                self._connection.exchange({"op": "release", "lease_id": lease_id}, want_fds=False)
            self._forget(lease)
            if not same:
                detached.append(lease.key)
        return {"reattached": reattached, "detached": detached}

    def _forget(self, lease: Lease) -> None:
        with self._table_lock:
            self._open_leases.pop(lease, None)
