"""The publications one client session started: each ``Publisher`` wired to the connection, and
the staged ones the session's end aborts (``Client.publisher``/``Client.publish`` use it).

``SessionPublications`` starts each ``Publisher`` (``hwr.client.publisher``) on one connection, wiring
it to the peer socket (small publications: one round trip to stage, one to commit) and to the
RPCs, and keeps the staged ones not yet finished: the session's end aborts them in the daemon,
so ``abandon_unfinished`` drops their staging descriptors when the client closes.

Contract: a ``publish_begin`` on the peer socket is retried once after a reconnect (it does not
belong to the old session); commit and abort are never retried. A publication in flight when
the daemon restarts is lost: its commit fails, publish again.

Thread safety: ``_lock`` guards the set of staged publications and the count of ``publisher()``
calls between their start and their begin's answer; it is never held while talking to hwrd
(a ``Publisher`` is built outside it) and no other lock is taken under it.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the publisher imports torch: only the calls that publish load it
    from hwr.client.connection import Connection
    from hwr.client.identity import ArtifactIdentity
    from hwr.client.publisher import Publisher, TensorSpec

__all__ = ["SessionPublications"]


class SessionPublications:
    """The publications of one connection (see the module contract)."""

    def __init__(self, connection: Connection) -> None:
        self._connection = connection
        self._lock = threading.Lock()
        # Staged publications not yet committed or aborted (see ``peer_begin_may_wait``).
        self._staged: weakref.WeakSet[Publisher] = weakref.WeakSet()
        self._beginning = 0  # publisher() calls between their start and their begin's answer

    def publisher(self, identity: ArtifactIdentity, specs: Sequence[TensorSpec], *,
                  wait_timeout: float = 600.0, verify: bool = False,
                  format_metadata: Mapping[str, Any] | None = None, channel: str | None = None,
                  durable: bool = True, reuse_base: str | None = None,
                  reuse: Mapping[str, str] | None = None) -> Publisher:
        """Start a streaming publication (see ``hwr.client.publisher``)."""
        connection = self._connection

        def staging_fds(publication_id: str, token: str) -> list[int]:
            _reply, fds, _tail = connection.exchange(
                {"op": "staging_fds", "publication_id": publication_id, "publication_token": token},
                want_fds=True)
            return fds

        def hand_over(publication_id: str, token: str, index: int) -> None:
            connection.exchange({"op": "publish_file_done", "publication_id": publication_id,
                                 "publication_token": token, "file_index": index}, want_fds=False)

        def peer(request: dict[str, Any], timeout: float | None = None) -> tuple[dict[str, Any], list[int]]:
            reply, fds, _tail = connection.exchange(request, want_fds=True, timeout=timeout)
            return reply, fds

        def peer_begin(request: dict[str, Any], timeout: float | None = None) -> tuple[dict[str, Any], list[int]]:
            if request.get("op") != "publish_begin":
                return peer(request, timeout)  # commit/abort belong to the current session: never retried
            return connection.with_reconnect(lambda: peer(request))

        from hwr.client.publisher import Publisher

        with self._lock:
            self._beginning += 1
        try:
            pub = Publisher(identity=identity, specs=specs, call=connection.call, staging_fds=staging_fds,
                            wait_timeout=wait_timeout, verify=verify, call_timeout=connection.timeout,
                            format_metadata=format_metadata, peer=peer_begin,
                            peer_may_wait=self.peer_begin_may_wait, channel=channel, durable=durable,
                            hand_over=hand_over, reuse_base=reuse_base, reuse=reuse)
            if pub.staged:
                with self._lock:
                    self._staged.add(pub)
        finally:
            with self._lock:
                self._beginning -= 1
        return pub

    def peer_begin_may_wait(self) -> bool:
        """Whether a peer ``publish_begin`` may wait in the daemon (for another publisher of the
        identity, or for room). It holds this client's peer connection while it waits, and the
        commit of another publication of this client needs that connection: when that other
        publication is the build (or holds the room) the begin waits for, the wait could only
        end at its timeout. So while any other publication of this client is beginning, or
        staged and not finished, a begin does not wait on the peer socket; it waits through
        the RPC instead (no connection held)."""
        with self._lock:
            return self._beginning <= 1 and all(p.finished for p in self._staged)

    def abandon_unfinished(self) -> None:
        """Drop the staging descriptors of the unfinished publications (the session has ended,
        which aborts them in hwrd; hwrd reclaims a discarded staging only once nobody holds it)."""
        with self._lock:
            unfinished = [p for p in self._staged if not p.finished]
        for pub in unfinished:
            pub.abandon()
