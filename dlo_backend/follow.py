"""Following an hwrd channel: every new revision it points to reaches the offload handle.

``ChannelFollower`` runs one daemon thread per handle::

    watch = client.watch_channel(name)         # coalesced: the newest state, never a queue
    loop: update = watch.wait(poll)            # ChannelUpdate(name, key, generation) or None
          key not pending, not running alone ->   lease = client.acquire(key)
                                               handle.update(lease)   # switch at the next pass

- A key the handle has pending, or runs with nothing pending, is skipped, so the watch's first
  answer (the channel's state when the watch starts) costs nothing when the handle started on
  it. The running key while another is pending (the channel went back: a rollback) is handed
  to ``update``, which cancels the pending revision and releases its lease.
- A revision refused by the contract check (``RevisionMismatch``) is recorded
  (``last_error``; the handle's ``revision_status()`` has it too) and the handle keeps its
  revision; following goes on. A key evicted before it could be acquired (it was superseded
  meanwhile) is skipped: the watch then reports the newer key.
- When the watch ends (``wait`` raises: the session died, e.g. hwrd restarted), the follower
  takes a new watch, retrying every ``retry_s`` until hwrd answers again; the client's own
  reconnect reattaches the open leases, and the mappings the passes read never go away.

The follower owns no lease: ``update`` hands each one to the backend, which releases the old
one once no pass uses it. ``close`` stops the thread (within about ``poll_s``) and is idempotent;
the offload handle closes its follower before it closes the backend.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Mapping
from typing import Any, Protocol

from hwr.client.carrier import HostLease
from hwr.client.errors import HwrError
from hwr.dlo_backend.switch import RevisionStatus, detached

__all__ = ["ChannelClient", "ChannelFollower", "Updatable"]

_log = logging.getLogger(__name__)


class _Update(Protocol):
    @property
    def key(self) -> str: ...


class _Watch(Protocol):
    def wait(self, timeout: float | None = None) -> _Update | None: ...

    def close(self) -> None: ...


class ChannelClient(Protocol):
    """What the follower needs of ``hwr.client.Client``."""

    def watch_channel(self, name: str) -> _Watch: ...

    def acquire(self, artifact: str, **kwargs: Any) -> HostLease: ...


class Updatable(Protocol):
    """What the follower needs of the offload backend."""

    def update(self, lease: HostLease) -> None: ...

    def revision_status(self) -> RevisionStatus: ...


class ChannelFollower:
    """Feeds ``target`` every revision channel ``channel`` points to (see the module docstring)."""

    def __init__(
        self,
        target: Updatable,
        client: ChannelClient,
        channel: str,
        *,
        acquire_options: Mapping[str, Any] | None = None,
        poll_s: float = 0.1,
        retry_s: float = 0.2,
    ) -> None:
        self.channel = channel
        self._target, self._client = target, client
        self._acquire_options = dict(acquire_options or {})
        self._poll_s, self._retry_s = poll_s, retry_s
        self._stop = threading.Event()
        self.last_error: HwrError | None = None
        self.watches = 0  # watches taken (more than one: the session was replaced)
        self.updates = 0  # leases handed to the backend (refused ones included)
        self._thread = threading.Thread(target=self._run, name=f"hwr-dlo-follow-{channel}", daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def close(self, timeout: float = 10.0) -> None:
        """Stop following (idempotent); a lease being handed over still reaches the backend."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
            if self._thread.is_alive():
                _log.warning("channel follower of %r did not stop within %.1f s", self.channel, timeout)

    def __enter__(self) -> ChannelFollower:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "following" if self.running else "stopped"
        return f"ChannelFollower(channel={self.channel!r}, {state}, updates={self.updates})"

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                watch = self._client.watch_channel(self.channel)
            except HwrError as exc:  # hwrd restarting, or the channel not there yet
                self._note(exc)
                self._stop.wait(self._retry_s)
                continue
            except Exception as exc:  # a bug must not end following silently
                _log.exception("watching channel %r failed", self.channel)
                self._stop.wait(self._retry_s)
                self._note(HwrError(f"watching channel {self.channel!r} failed: {exc}"))
                continue
            self.watches += 1
            try:
                self._follow(watch)
            finally:
                with contextlib.suppress(Exception):
                    watch.close()

    def _follow(self, watch: _Watch) -> None:
        while not self._stop.is_set():
            try:
                update = watch.wait(self._poll_s)
            except HwrError as exc:  # the watch ended with its session: take a new one
                self._note(exc)
                return
            if update is not None and not self._stop.is_set():
                self._take(update.key)

    def _take(self, key: str) -> None:
        status = self._target.revision_status()
        if key == status.pending or (key == status.key and status.pending is None):
            return
        # A key equal to the running one while another is pending is a rollback: it goes to
        # ``update``, which drops the pending revision (released, evictable) and keeps running.
        try:
            lease = self._client.acquire(key, **self._acquire_options)
        except HwrError as exc:  # evicted once superseded, or hwrd going away: the watch goes on
            self._note(exc)
            return
        self.updates += 1
        try:
            self._target.update(lease)
        except HwrError as exc:  # refused: the backend keeps its revision and closed the lease
            self._note(exc)

    def _note(self, error: HwrError) -> None:
        self.last_error = detached(error)
        _log.info("channel %r: %s", self.channel, error)
