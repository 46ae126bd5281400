"""Scrub: re-verify every stored artifact in the background, at a bandwidth cap.

``Scrubber.run`` calls ``scrub_once`` every ``scrub_interval_s`` (the first pass after at most
5 s); a pass lists the artifacts and verifies each one's payload hashes through the read API
(``Catalog.artifacts``/``Catalog.verify``: ``Store.verify`` denies and quarantines an artifact
that fails) paced to ``scrub_bandwidth_mib_s``.

Contract: on the daemon's event loop; hashing runs in worker threads. The pacing sleeps in the
progress callback, which ``store_io.hash_ranges`` calls under the lock its hashing threads share,
so one sleep paces all of them. Limits:
an artifact evicted between the listing and its turn is skipped; ``scrubbed`` counts artifacts
verified since start, not passes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from hwr.client.errors import ArtifactNotFound, HwrError

if TYPE_CHECKING:
    from hwr.daemon.service.catalog import Catalog
    from hwr.daemon.system.config import DaemonConfig

__all__ = ["Scrubber"]

log = logging.getLogger("hwrd.store")


class Scrubber:
    """Background verification of one store (see the module contract)."""

    def __init__(self, config: DaemonConfig, catalog: Catalog) -> None:
        self.config = config
        self.catalog = catalog
        self.scrubbed = 0

    async def run(self) -> None:
        while True:
            await asyncio.sleep(min(self.config.scrub_interval_s, 5.0) if not self.scrubbed else
                                self.config.scrub_interval_s)
            await self.scrub_once()

    async def scrub_once(self) -> list[str]:
        """Verify every artifact at the configured bandwidth cap; returns the keys found corrupt."""
        rate = self.config.scrub_bandwidth_mib_s * (1 << 20)
        bad = []
        for record in await self.catalog.records():
            started = time.monotonic()

            def throttle(done: int, _total: int, started: float = started) -> None:
                # Called under the hashing lock: sleeping here paces every hashing thread.
                ahead = done / rate - (time.monotonic() - started)
                if ahead > 0:
                    time.sleep(min(ahead, 1.0))

            try:
                await self.catalog.verify(record.key, throttle if rate else None)
            except ArtifactNotFound:
                continue  # evicted or removed since the listing: nothing left to scrub
            except HwrError as exc:
                bad.append(record.key)
                log.error("scrub: artifact %s failed verification: %s", record.key, exc)
            self.scrubbed += 1
        return bad
