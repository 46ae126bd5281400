"""Pinning: artifacts exempt from eviction whose pages the daemon keeps resident.

``Pinning`` is the service operation (pin, unpin, restore residency at start) over two adapters
in this module: ``PinSet`` and ``Residency``.

``PinSet`` persists the pinned keys in ``<root>/pins.json`` (``{"schema_version": 1, "pins":
[...]}``, rewritten atomically: temp file, fsync, rename, directory fsync), so pins survive
restarts. ``Residency`` keeps each pinned artifact's payloads mapped in the daemon
(``MAP_SHARED|MAP_POPULATE``: the page cache is filled and the page tables built) and, while the
configured ``mlock_budget_bytes`` allows, ``mlock``-ed so the kernel cannot reclaim them.

``PinSet`` changes membership in memory (``add``/``discard``: the eviction rounds, which run on
the daemon's event loop, see a change at once) and persists with ``save`` (in a worker thread;
saves are serialized and each writes the set as it is then, so the last save to finish holds
every change made before it started).

Contract: ``pin`` is idempotent and reports ``locked`` or ``prefaulted`` (budget exhausted,
``mlock`` refused by ``RLIMIT_MEMLOCK``/missing ``CAP_IPC_LOCK``, or a budget of 0). Limits:
``prefaulted`` pages are resident right after pinning but the kernel may reclaim them under
memory pressure (they come back at the next touch); residency is re-established at daemon start
in the background. ``Pinning`` runs on the daemon's event loop; the pins file and the residency's system calls run in
worker threads. Records and payload descriptors come from the read API
(``hwr.daemon.service.catalog``). A pin takes effect on the loop right after ``Catalog.record_settled``'s
final check, which waits out an eviction round that marked the key, so no later round can choose
a pinned key.

Lock order: ``_lock`` (an ``asyncio.Lock``, loop) serializes the residency's ``hold``/``drop``
(``Residency`` has no lock of its own), held across the worker thread that runs them; under it
only ``Catalog.open_payloads``. ``PinSet.save`` serializes itself (a ``threading.Lock`` in the
worker thread) and is never called under ``_lock``. The capacity lock (``Capacity.lock``) is never
taken under ``_lock``, nor ``_lock`` under it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import errno
import logging
import mmap
import os
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hwr.client.errors import HwrError
from hwr.client.identity import canonical_json, is_key
from hwr.daemon.store import fileio as store_io

if TYPE_CHECKING:
    from hwr.daemon.service.catalog import Catalog
    from hwr.daemon.store.inspection import ArtifactRecord

__all__ = ["PinSet", "Pinning", "Residency"]

log = logging.getLogger("hwrd.store")

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.munlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
MAP_FAILED = ctypes.c_void_p(-1).value


class PinSet:
    def __init__(self, path: Path, keys: set[str]) -> None:
        self.path = path
        self._keys = keys
        self._save_lock = threading.Lock()

    @classmethod
    def open(cls, root: Path) -> PinSet:
        path = root / "pins.json"
        keys: set[str] = set()
        try:
            raw = store_io.read_state_file(path)
            if raw is not None:
                document = store_io.parse_json(raw)
                keys = {k for k in document.get("pins", []) if is_key(k)}  # type: ignore[union-attr]
        except (OSError, ValueError, AttributeError, TypeError):
            keys = set()  # unreadable (or not a regular file: never read): start unpinned rather than refuse to serve
        return cls(path, keys)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def keys(self) -> set[str]:
        return set(self._keys)

    def add(self, key: str) -> bool:
        """Pin ``key`` in memory; False when it already was. Persist with ``save``."""
        if key in self._keys:
            return False
        self._keys.add(key)
        return True

    def discard(self, key: str) -> bool:
        """Unpin ``key`` in memory; False when it was not pinned. Persist with ``save``."""
        if key not in self._keys:
            return False
        self._keys.discard(key)
        return True

    def save(self) -> None:
        """Write the set atomically (temp file, fsync, rename, directory fsync); blocking."""
        with self._save_lock:
            document = canonical_json({"schema_version": 1, "pins": sorted(self._keys)})
            tmp = self.path.with_name(f".pins.{uuid.uuid4().hex}.tmp")
            store_io.write_new_file(tmp, document, mode=0o600)
            store_io.rename(tmp, self.path)
            store_io.fsync_dir(self.path.parent)


@dataclass
class _Mapped:
    address: int
    size: int
    locked: bool


class Residency:
    """The daemon's own mappings of pinned artifacts (call from one thread at a time)."""

    def __init__(self, mlock_budget_bytes: int) -> None:
        self.budget = mlock_budget_bytes
        self._maps: dict[str, list[_Mapped]] = {}

    @property
    def locked_bytes(self) -> int:
        return sum(m.size for maps in self._maps.values() for m in maps if m.locked)

    def hold(self, key: str, fds: list[int]) -> str:
        """Map (and lock within budget) the given payload descriptors; returns the residency."""
        if key in self._maps:
            return "locked" if all(m.locked for m in self._maps[key]) else "prefaulted"
        maps: list[_Mapped] = []
        try:
            for fd in fds:
                size = os.fstat(fd).st_size
                if size == 0:
                    continue
                address = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                                     fd, 0)
                if address in (None, MAP_FAILED):
                    code = ctypes.get_errno()
                    raise OSError(code, os.strerror(code))
                maps.append(_Mapped(address, size, False))
            total = sum(m.size for m in maps)
            if self.budget and self.locked_bytes + total <= self.budget:
                for m in maps:
                    if _libc.mlock(m.address, m.size) != 0:
                        if ctypes.get_errno() not in (errno.EPERM, errno.ENOMEM, errno.EAGAIN):
                            raise OSError(ctypes.get_errno(), "mlock")
                        break
                    m.locked = True
                if not all(m.locked for m in maps):
                    for m in maps:
                        if m.locked:
                            _libc.munlock(m.address, m.size)
                            m.locked = False
        except BaseException:
            for m in maps:
                _libc.munmap(m.address, m.size)
            raise
        self._maps[key] = maps
        return "locked" if maps and all(m.locked for m in maps) else "prefaulted"

    def locked(self, key: str) -> int:
        return sum(m.size for m in self._maps.get(key, ()) if m.locked)

    def drop(self, key: str) -> None:
        for m in self._maps.pop(key, []):
            if m.locked:
                _libc.munlock(m.address, m.size)
            _libc.munmap(m.address, m.size)

    def close(self) -> None:
        for key in list(self._maps):
            self.drop(key)


class Pinning:
    """Pin, unpin and keep pinned artifacts resident (see the module contract)."""

    def __init__(self, catalog: Catalog, pins: PinSet, residency: Residency) -> None:
        self.catalog = catalog
        self.pins = pins
        self.residency = residency
        self._lock = asyncio.Lock()  # the pin lock: see the lock order in the module docstring

    async def restore(self) -> None:
        """Make every pinned artifact resident again (at start, in the background)."""
        for key in sorted(self.pins.keys()):
            try:
                await self.hold_resident(key)
            except HwrError as exc:
                log.warning("pinned artifact %s cannot be made resident: %s", key, exc)

    async def hold_resident(self, key: str, record: ArtifactRecord | None = None) -> str:
        if record is None:
            record = await asyncio.to_thread(self.catalog.record_blocking, key)

        def hold() -> str:
            fds = [fd for _name, fd in self.catalog.open_payloads(record)]
            try:
                return self.residency.hold(key, fds)
            finally:
                for fd in fds:
                    os.close(fd)

        async with self._lock:
            return await asyncio.to_thread(hold)

    async def pin(self, key: str) -> tuple[bool, int, int, str]:
        """Pin ``key``: (already pinned, size, locked bytes, residency). The pin takes effect
        on the loop right after ``Catalog.record_settled``'s final check (which waits out an eviction round that
        has marked the key, so the artifact is either gone, ``ArtifactNotFound``, or present and
        unmarked), before any await: no later round can choose the key. A pin that fails
        (pins.json not written, payloads not mappable) leaves the key as it was; a cancelled
        one may stand."""
        record = await self.catalog.record_settled(key)  # waits out a round that marked the key
        added = self.pins.add(key)
        try:
            if added:
                await asyncio.to_thread(self.pins.save)
            residency = await self.hold_resident(key, record)  # pinned: the record stays valid
        except Exception:  # not on cancellation: the thread still saves, so the pin stands
            if added:
                self.pins.discard(key)
                with contextlib.suppress(OSError):
                    await asyncio.to_thread(self.pins.save)
            raise
        return (not added, record.size_bytes, self.residency.locked(key), residency)

    async def unpin(self, key: str) -> bool:
        removed = self.pins.discard(key)
        if removed:
            try:
                await asyncio.to_thread(self.pins.save)
            except OSError:
                self.pins.add(key)  # pins.json not replaced: still pinned on disk, stay pinned
                raise
        async with self._lock:
            await asyncio.to_thread(self.residency.drop, key)
        return removed

    async def close(self) -> None:
        """Unmap (and unlock) every resident payload."""
        await asyncio.to_thread(self.residency.close)
