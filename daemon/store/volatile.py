"""Non-durable artifacts: committed without fsync, and removed at the store's next open.

A publication may ask not to be made durable (live weight updates: a revision that the next one
supersedes within seconds does not need to survive a restart). Its payloads, documents and
directories are then never fsynced, and an empty marker ``<root>/volatile/<key>`` says so:

- ``mark`` creates the marker and fsyncs ``volatile/`` (one small directory fsync, a few ms:
  it does not wait for the payloads' dirty pages) BEFORE the artifact is renamed into
  ``artifacts/``. So whatever a crash keeps of the rename, the marker is there too: an artifact
  whose bytes may never have reached the disk is never taken for a durable one after a host
  crash.
- At open (``drop_at_open``, before validation) every marked artifact is removed and its marker
  after it (a crash in between redoes it). Removal unlinks and never truncates: workers that map
  the revision keep valid mappings (the inode lives until they unmap it).
- A marker goes when its artifact leaves ``artifacts/`` (``clear``, under the key's lock: a
  retirement, a quarantine), and before a durable commit of the same key, fsynced then, so
  that a marker left behind can never make a later durable artifact vanish at a restart.

Thread-safe (``_lock`` is a leaf: held for the in-memory set only). Limit: a non-durable
artifact is like any other while hwrd runs (leases, eviction, verify); it is gone after a
restart even if nothing else changed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from pathlib import Path

from hwr.client.identity import is_key
from hwr.daemon.store import fileio as store_io

__all__ = ["VolatileSet"]

log = logging.getLogger("hwrd.store")


class VolatileSet:
    """The markers of ``<root>/volatile/`` (see the module docstring)."""

    def __init__(self, directory: Path) -> None:
        self._dir = directory
        self._lock = threading.Lock()
        self._keys: set[str] = set()  # empty once ``drop_at_open`` ran, which ``Store.open`` does

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def marked(self, key: str) -> bool:
        """Whether ``key``'s artifact was committed non-durably (gone at the next open)."""
        return key in self._keys

    def mark(self, key: str) -> None:
        """Create ``key``'s marker durably (before its artifact is renamed in)."""
        fd = os.open(self._dir / key, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        os.close(fd)
        store_io.fsync_dir(self._dir)
        with self._lock:
            self._keys.add(key)

    def clear(self, key: str, *, durable: bool = False) -> None:
        """Remove ``key``'s marker if there is one; ``durable``: fsync ``volatile/`` after."""
        with self._lock:
            present = key in self._keys
            self._keys.discard(key)
        if not present and not os.path.lexists(self._dir / key):
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._dir / key)
        if durable:
            store_io.fsync_dir(self._dir)


    def drop_at_open(self, artifacts: Path) -> list[str]:
        """Remove every artifact marked non-durable, then its marker (at open, before
        validation); returns their keys."""
        dropped = []
        for entry in sorted(os.listdir(self._dir)):
            if is_key(entry):
                store_io.remove_tree(artifacts / entry)  # unlink only: mappings of it stay valid
                dropped.append(entry)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._dir / entry)
        if dropped:
            store_io.fsync_dir(artifacts)
            store_io.fsync_dir(self._dir)
            log.info("removed %d non-durable artifacts at start: %s", len(dropped),
                     ",".join(k[:12] for k in dropped))
        with self._lock:
            self._keys.clear()
        return dropped
