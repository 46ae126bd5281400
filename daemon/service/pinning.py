"""Pinning as a service operation: pin and unpin an artifact, and restore residency at start.

A pinned artifact is exempt from eviction (``PinSet``, persisted in ``pins.json``) and its
payloads are kept resident in the daemon (``Residency``: mapped, and ``mlock``-ed within the
budget); ``hwr.daemon.service.pins`` holds both adapters, this module the order of the steps.

Contract: on the daemon's event loop; the pins file and the residency's system calls run in
worker threads. A pin takes effect on the loop right after ``lookup``'s final check, which waits
out an eviction round that marked the key (``StoreService.lookup``), so no later round can
choose a pinned key.

Lock order: ``_lock`` (an ``asyncio.Lock``, loop) serializes the residency's ``hold``/``drop``
(``Residency`` has no lock of its own), held across the worker thread that runs them; under it
only ``RecordCache.open_payloads``. ``PinSet.save`` serializes itself (a ``threading.Lock`` in the
worker thread) and is never called under ``_lock``. The capacity lock (``CapacityGate``) is never
taken under ``_lock``, nor ``_lock`` under it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from hwr.client.errors import HwrError

if TYPE_CHECKING:
    from hwr.daemon.service.pins import PinSet, Residency
    from hwr.daemon.store.inspection import ArtifactRecord
    from hwr.daemon.store.root import Store

__all__ = ["Pinning"]

log = logging.getLogger("hwrd.store")


class Pinning:
    """Pin, unpin and keep pinned artifacts resident (see the module contract).

    ``lookup(key)``: the validated record, waiting while the key is being evicted.
    """

    def __init__(self, store: Store, pins: PinSet, residency: Residency,
                 lookup: Callable[[str], Awaitable[ArtifactRecord]]) -> None:
        self.store = store
        self.pins = pins
        self.residency = residency
        self.lookup = lookup
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
            record = await asyncio.to_thread(self.store.records.lookup, key)

        def hold() -> str:
            fds = self.store.records.open_payloads(record)
            try:
                return self.residency.hold(key, [fd for _, fd in fds])
            finally:
                for _, fd in fds:
                    os.close(fd)

        async with self._lock:
            return await asyncio.to_thread(hold)

    async def pin(self, key: str) -> tuple[bool, int, int, str]:
        """Pin ``key``: (already pinned, size, locked bytes, residency). The pin takes effect
        on the loop right after ``lookup``'s final check (which waits out an eviction round that
        has marked the key, so the artifact is either gone, ``ArtifactNotFound``, or present and
        unmarked), before any await: no later round can choose the key. A pin that fails
        (pins.json not written, payloads not mappable) leaves the key as it was; a cancelled
        one may stand."""
        record = await self.lookup(key)
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
