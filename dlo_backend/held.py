"""The revisions a backend holds: the one passes run on, and closed ones not released yet.

A ``revision.Revision`` is released by ``HeldRevisions.release``: its host memory is
unregistered, its arenas unmapped, then its lease closed. A revision whose host memory could
not be unregistered keeps its lease open (unmapping registered memory is undefined behaviour)
and stays here, retired, until ``release_all`` (the teardown's steps 5 and 6) tries again.

Thread-safe: an update thread discards revisions it prepared while the compute thread switches
and the teardown releases; each release runs alone.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from hwr.client.carrier import HostLease
from hwr.dlo_backend.registration import HostRegistration
from hwr.dlo_backend.revision import Revision
from hwr.dlo_backend.shards import ShardSource

__all__ = ["HeldRevisions"]

# The backend's logger: an operator filters one name for everything the offload backend reports.
_log = logging.getLogger("hwr.dlo_backend.backend")


class HeldRevisions:
    """``running``: the revision passes run on (``None`` before TAKE_LEASE); plus the retired ones."""

    def __init__(self) -> None:
        self.running: Revision | None = None
        self._retired: list[Revision] = []
        self._lock = threading.Lock()

    @property
    def key(self) -> str | None:
        """The running revision's lease key (``None``: the module's own tensors, or none yet)."""
        return None if self.running is None else self.running.key

    @property
    def lease(self) -> HostLease | None:
        return None if self.running is None else self.running.lease

    @property
    def registration(self) -> HostRegistration | None:
        return None if self.running is None else self.running.registration

    @property
    def shards(self) -> ShardSource | None:
        return None if self.running is None else self.running.shards

    def release(self, revision: Revision, errors: list[str]) -> None:
        """Close ``revision``; one whose host memory stays registered keeps its lease, for a retry.

        Its failures are appended to ``errors``. The running revision is not changed: the caller
        releases it only once no pass can read it.
        """
        with self._lock:
            failures = revision.close()
            if failures:
                errors.extend(failures)
                self._retired.append(revision)
                _log.error("host memory still registered; keeping its lease open: %s", failures)

    def release_all(self, pending: Sequence[Revision], errors: list[str]) -> None:
        """Release the running revision, ``pending`` (an update never applied) and every retired one
        (the teardown's steps 5 and 6); those still registered stay retired."""
        with self._lock:
            held = ([] if self.running is None else [self.running]) + list(pending) + self._retired
            self._retired = []
        for revision in held:
            self.release(revision, errors)
