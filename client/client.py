"""``hwr.client.connect()``: a session with hwrd, leases and publication.

A ``Client`` owns two connections: the peer socket (``<socket>.peer``: authentication, the
session's liveness, descriptor passing, and the lease hot path: ``acquire`` and ``release`` are
one request/one reply each there, see ``hwr.daemon.peer.server``) and a gRPC channel (control calls
carrying the session token), opened lazily on the first call that needs it: a client that only
acquires and releases never opens one. Closing the client, or the process exiting, ends the
session and the daemon releases every lease it still holds.

Contract:
- Every failure raises a typed ``HwrError`` (``DaemonUnavailable`` when hwrd cannot be reached,
  ``ArtifactNotFound`` for a miss, ...); nothing returns ``None``/``False`` for an error.
- ``close()`` is idempotent. Leases outlive nothing: after ``close()`` their mappings stay valid
  (views keep them alive) but the daemon no longer counts them.
- Fork: a child process inherits the parent's sockets; the client closes its copy of the peer
  socket in the child (so the parent's death still ends the parent's session) and refuses to be
  used there. Leases inherited by a child are never released by the child.
- Thread safety: calls may be made from several threads; peer-channel exchanges are serialized.

How it is built: ``Client`` is the one class users get, composed of a ``Connection`` (sockets,
session, reconnect, fork: ``hwr.client.connection``), an ``Acquirer`` (the table of open leases
and their reattach: ``hwr.client.acquisition``) and ``SessionPublications`` (the publishers this
session started: ``hwr.client.session_publications``); the control RPCs come from its bases
``AdminCalls`` (``hwr.client.admin``) and ``ChannelCalls`` (``hwr.client.channel_calls``).
``publish`` (a streaming ``Publisher`` fed from a mapping, reusing a channel's unchanged tensors)
and ``acquire_checkpoint`` (one RPC and one descriptor exchange; checkpoint leases are not
reattached) are written here. Tests and tools that need the wire reach the collaborators
(``client._connection.exchange``, ``client._acquirer.peer_acquire``). The lock order is written
in ``Connection.__init__``; the collaborators add only ``SessionPublications``' own lock, never
held while another is taken.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hwr.client.acquisition import Acquirer, PullReport
from hwr.client.admin import AdminCalls
from hwr.client.channel_calls import ChannelCalls
from hwr.client.connection import Connection, ReattachReport
from hwr.client.errors import ChannelNotFound, DaemonUnavailable, InvalidRequest, UntrustedDaemon
from hwr.client.paths import client_socket
from hwr.client.session_publications import SessionPublications
from hwr.protos.hwr.v1 import hwr_pb2 as pb

if TYPE_CHECKING:  # torch is imported only by the calls that build tensors (hwrctl never does)
    import torch

    from hwr.client.checkpoint_lease import CheckpointLease
    from hwr.client.identity import ArtifactIdentity
    from hwr.client.lease import Lease
    from hwr.client.publisher import Publisher, TensorSpec

__all__ = ["Client", "connect"]

def connect(socket: str | os.PathLike[str] | None = None, *, timeout: float = 30.0,
            client_name: str | None = None) -> Client:
    """Open a session with hwrd (socket: argument, else ``$HWR_SOCKET``, else the caller's own
    hwrd or the node's service: ``hwr.client.paths.client_socket``). Without an argument, a
    ``DaemonUnavailable`` names every place looked at and ``$HWR_SOCKET``."""
    if socket is not None:
        return Client(Path(socket), timeout=timeout, client_name=client_name)
    choice = client_socket()
    try:
        return Client(choice.path, timeout=timeout, client_name=client_name)
    except UntrustedDaemon:
        raise  # its message says what is wrong with that daemon
    except DaemonUnavailable as exc:
        raise DaemonUnavailable(f"{exc.message}; {choice.hint()}",
                                details={**exc.details, "socket": str(choice.path),
                                         "looked": [str(p) for p in choice.looked]}) from None


class Client(ChannelCalls, AdminCalls):
    """A session with hwrd (see the module contract); a context manager."""

    def __init__(self, socket_path: Path, *, timeout: float = 30.0, client_name: str | None = None) -> None:
        self._connection = Connection(socket_path, timeout=timeout, client_name=client_name)
        self._acquirer = Acquirer(self._connection)
        self._connection.reattach = self._acquirer.reattach
        self._publications = SessionPublications(self._connection)

    # the session ----------------------------------------------------------------------------
    @property
    def socket_path(self) -> Path:
        return self._connection.socket_path

    @property
    def timeout(self) -> float:
        """The bound of each exchange with hwrd unless a call says otherwise (``connect(timeout=)``)."""
        return self._connection.timeout

    @timeout.setter
    def timeout(self, value: float) -> None:
        self._connection.timeout = value

    @property
    def session_id(self) -> str:
        return self._connection.session_id

    @property
    def auto_reconnect(self) -> bool:
        """Reconnect (and reattach the open leases) after a daemon restart; default True."""
        return self._connection.auto_reconnect

    @auto_reconnect.setter
    def auto_reconnect(self, value: bool) -> None:
        self._connection.auto_reconnect = value

    @property
    def reconnects(self) -> int:
        """How many times this client opened a new session after losing one."""
        return self._connection.reconnects

    def reconnect(self, *, failed_peer: socket.socket | None = None) -> ReattachReport:
        """Open a new session and reattach open leases; returns ``{"reattached", "detached"}``.

        ``failed_peer``: the connection the caller saw fail; when another thread has replaced it
        meanwhile, nothing is done.
        """
        return self._connection.reconnect(failed_peer=failed_peer)

    # leases ---------------------------------------------------------------------------------
    def acquire(self, artifact: ArtifactIdentity | str, *, copy_on_write: bool = False,
                populate: bool = False, timeout: float | None = None, wait_for_pull: bool = True,
                on_pull: Callable[[PullReport], None] | None = None) -> Lease:
        """Lease an artifact by identity or 64-hex key; raises ``ArtifactNotFound`` on a miss.

        ``timeout`` (seconds) bounds the exchanges with hwrd (None: the connection's timeout,
        ``connect(timeout=)``); past it the acquire raises ``DeadlineExceeded`` and the
        connection is replaced (the stream is out of step). A reconnect in between (after a
        daemon restart) is bounded by the connection's timeout, not by this one.

        With a remote tier, a key being pulled (or that this acquire starts pulling) is waited
        for while the pull advances: hwrd reports progress (passed to ``on_pull``, a
        ``PullReport``; it must be quick) and ``timeout`` then bounds each silence of the
        daemon, not the pull; a pull that stalls fails with ``RemoteUnavailable`` after hwrd's
        ``remote_stall_timeout_s``, a refused one with its typed error. ``wait_for_pull=False``:
        start the pull and raise ``ArtifactNotFound`` (``details["pulling"]``) at once."""
        return self._acquirer.acquire(artifact, copy_on_write=copy_on_write, populate=populate, timeout=timeout,
                                      wait_for_pull=wait_for_pull, on_pull=on_pull)

    def acquire_channel(self, name: str, *, copy_on_write: bool = False, populate: bool = False,
                        timeout: float | None = None) -> Lease:
        """Lease the key channel ``name`` points to at this moment (``lease.key`` says which):
        one peer request, resolved and leased by hwrd in one step. ``ChannelNotFound`` when no
        such channel exists; otherwise as ``acquire`` (the lease is an ordinary lease of that
        key: a later change of the channel does not touch it; see ``watch_channel``)."""
        return self._acquirer.acquire_channel(name, copy_on_write=copy_on_write, populate=populate,
                                              timeout=timeout)

    def acquire_checkpoint(self, checkpoint_id: str, *, populate: bool = False,
                           timeout: float | None = None) -> CheckpointLease:
        """Lease the canonical tensors of a registered checkpoint (id or unique prefix): the
        ``Acquire`` RPC, then its descriptors on the peer socket (released again when that
        fails). Not reattached after a reconnect."""
        ref = pb.ArtifactRef(checkpoint=pb.CheckpointRef(checkpoint_id=checkpoint_id))
        response: pb.AcquireResponse = self._connection.call("Acquire", pb.AcquireRequest(artifact=ref), timeout)
        try:
            _reply, fds, _tail = self._connection.exchange(
                {"op": "fds", "lease_id": response.lease_id, "lease_token": response.lease_token}, want_fds=True)
        except BaseException:
            self._acquirer.release(response.lease_id)
            raise
        from hwr.client.checkpoint_lease import CheckpointLease

        return CheckpointLease(lease_id=response.lease_id, checkpoint_id=response.key,
                               files=[(f.name, f.size) for f in response.files], fds=fds,
                               release=self._acquirer.release, populate=populate)

    # publication ----------------------------------------------------------------------------
    def publisher(self, identity: ArtifactIdentity, specs: Sequence[TensorSpec], *,
                  wait_timeout: float = 600.0, verify: bool = False,
                  format_metadata: Mapping[str, Any] | None = None, channel: str | None = None,
                  durable: bool = True, reuse_base: str | None = None,
                  reuse: Mapping[str, str] | None = None) -> Publisher:
        """Start a streaming publication (see ``hwr.client.publisher``; ``channel``/``durable``
        as for ``publish``). ``reuse_base`` (a key) and ``reuse`` (tensor name -> its digest in
        that artifact's manifest): tensors hwrd takes from that artifact; ``Publisher.reused``
        says which it does, and ``write`` skips them."""
        return self._publications.publisher(identity, specs, wait_timeout=wait_timeout, verify=verify,
                                            format_metadata=format_metadata, channel=channel, durable=durable,
                                            reuse_base=reuse_base, reuse=reuse)

    def publish(self, identity: ArtifactIdentity, tensors: Mapping[str, torch.Tensor], *,
                channel: str | None = None, durable: bool = True, reuse_unchanged: bool = True,
                buffers: Sequence[str] = (), wait_timeout: float = 600.0, verify: bool = False) -> str:
        """Publish a mapping of CPU tensors; returns the key (also when it already existed).

        ``channel``: point that channel at the artifact atomically as part of the commit (or,
        when the artifact is already present, at the begin's answer); needs only the publish
        role. ``durable=False``: no fsync; at hwrd's next start the artifact is gone and a
        channel pointing to it falls back to its last durable key. With a channel and
        ``reuse_unchanged`` (the default), tensors byte-equal to the channel's current revision
        are not written again: hwrd takes them from that revision (``hwr.client.revision_diff``,
        ``hwr.daemon.store.reuse``); the result is the same artifact either way."""
        if not tensors:
            raise InvalidRequest("nothing to publish")
        base = None
        if channel is not None and reuse_unchanged:
            try:
                base = self.acquire_channel(channel)
            except ChannelNotFound:
                base = None
        try:
            reuse: dict[str, str] = {}
            if base is not None:
                from hwr.client.revision_diff import unchanged

                digests = {t.name: t.sha256 for t in base.manifest.tensors}
                reuse = {name: digests[name] for name in unchanged(tensors, base)}
            from hwr.client.publisher import specs_for

            with self.publisher(identity, specs_for(dict(tensors), buffers), wait_timeout=wait_timeout,
                                verify=verify, channel=channel, durable=durable,
                                reuse_base=base.key if base is not None and reuse else None, reuse=reuse) as pub:
                if pub.staged:
                    for name in pub.write_order(tensors):
                        pub.write(name, tensors[name])
                return pub.commit()
        finally:
            if base is not None:
                base.close()

    # lifecycle ------------------------------------------------------------------------------
    def close(self) -> None:
        """End the session (the daemon releases its leases); idempotent."""
        self._connection.close()
        if self._connection.owned_here:
            # After the session's end, which aborted them in hwrd: their staging descriptors are
            # useless now, and hwrd reclaims a discarded staging only once nobody holds it.
            self._publications.abandon_unfinished()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __reduce__(self) -> object:
        raise TypeError("a Client is bound to this process's session and cannot be pickled")

    def __repr__(self) -> str:
        return f"Client(socket={str(self.socket_path)!r}, closed={self._connection.closed})"
