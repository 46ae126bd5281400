"""The fleet tier as the daemon sees it: one remote, its puller and pusher, and their counters.

The wiring (``hwr.daemon.app.server``) builds at most one ``Fleet`` (only when ``remote`` is
configured), and it is called from three places: the read API's ``Catalog.lookup`` after a local
miss (``pull_on_miss``, the catalog's ``MissFetcher``; both transports' acquires and so the
vLLM-Omni plugin's lookups pass there), ``Publications``' commit hook (``committed``; pulls
excluded) and the remote RPCs (``hwr.daemon.rpc.remote``).

Counters (``hwr.daemon.app.exposition`` exposes them): pull and push outcomes by fixed words, and the
bytes each direction moved.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

from hwr.client.errors import HwrError
from hwr.daemon.fleet.pull import Puller
from hwr.daemon.fleet.push import Pusher
from hwr.daemon.fleet.remote import RemoteEntry, RemoteLocation, RemoteStore, open_remote, parse_location

if TYPE_CHECKING:
    from hwr.daemon.service.publications import Publications
    from hwr.daemon.store.root import Store
    from hwr.daemon.store.validation import ArtifactRecord
    from hwr.daemon.system.config import DaemonConfig

__all__ = ["PULL_OUTCOMES", "PUSH_OUTCOMES", "Fleet", "location_of"]

log = logging.getLogger("hwrd.remote")
PULL_OUTCOMES = ("pulled", "already_present", "miss", "invalid", "unavailable", "denied", "failed")
PUSH_OUTCOMES = ("pushed", "already_present", "skipped", "unavailable", "failed")


def location_of(config: DaemonConfig) -> RemoteLocation | None:
    """The configured remote, or None when the tier is off."""
    if not config.remote:
        return None
    return parse_location(config.remote, endpoint_url=config.remote_endpoint_url, region=config.remote_region)


class Fleet:
    def __init__(self, location: RemoteLocation, remote: RemoteStore, store: Store, publications: Publications, *,
                 root: Path, push: bool, wait_timeout: float) -> None:
        self.location = location
        self.remote = remote
        self.store = store
        self.push_enabled = push
        self.pulls: dict[str, int] = dict.fromkeys(PULL_OUTCOMES, 0)
        self.pushes: dict[str, int] = dict.fromkeys(PUSH_OUTCOMES, 0)
        self.bytes_pulled = 0
        self.bytes_pushed = 0
        self.puller = Puller(remote, store, publications, wait_timeout=wait_timeout, on_outcome=self._pulled)
        self.pusher = Pusher(remote, store, root, on_outcome=self._pushed)
        self._recording: set[asyncio.Task[None]] = set()  # to-push records being written
        self._probe: tuple[float, str] | None = None  # (monotonic time, "" or the error) of the last probe

    @classmethod
    def open(cls, config: DaemonConfig, store: Store, publications: Publications) -> Fleet | None:
        location = location_of(config)
        if location is None:
            return None
        remote = open_remote(location)
        return cls(location, remote, store, publications, root=Path(config.root), push=config.remote_push,
                   wait_timeout=config.publication_wait_timeout_s)

    async def start(self) -> None:
        await self.pusher.start()
        log.info("remote tier %s (push %s)", self.location.display, "on" if self.push_enabled else "off")

    async def stop(self) -> None:
        await self.pusher.stop()
        self.puller.close()
        await asyncio.to_thread(self.remote.close)

    # ------------------------------------------------------------------ hooks
    async def pull_on_miss(self, key: str) -> ArtifactRecord:
        record, _outcome = await self.puller.pull(key)
        return record

    def committed(self, key: str) -> None:
        """``Publications``' commit hook (on the loop): queue the upload unless a pull committed it."""
        if not self.push_enabled or key in self.puller.committing:
            return
        task = asyncio.get_running_loop().create_task(self.pusher.committed(key))
        self._recording.add(task)  # a reference until it ends (the loop keeps only weak ones)
        task.add_done_callback(self._recording.discard)

    def _pulled(self, outcome: str, nbytes: int) -> None:
        self.pulls[outcome] = self.pulls.get(outcome, 0) + 1
        self.bytes_pulled += nbytes

    def _pushed(self, outcome: str, nbytes: int) -> None:
        self.pushes[outcome] = self.pushes.get(outcome, 0) + 1
        self.bytes_pushed += nbytes

    # ------------------------------------------------------------------ status
    async def reachable(self, max_age_s: float = 2.0) -> tuple[bool, str]:
        """(reachable, error) from a probe at most ``max_age_s`` old."""
        now = time.monotonic()
        if self._probe is None or now - self._probe[0] > max_age_s:
            try:
                await asyncio.to_thread(self.remote.probe)
                self._probe = (now, "")
            except HwrError as exc:
                self._probe = (now, exc.message)
        return not self._probe[1], self._probe[1]

    async def entries(self) -> list[RemoteEntry]:
        return await asyncio.to_thread(self.remote.list_entries)

    async def key_state(self, key: str) -> str:
        """``pending_push`` | ``pulling`` | ``present`` | ``incomplete`` | ``absent`` | ``unreachable``."""
        if self.pusher.is_pending(key):
            return "pending_push"
        if key in self.puller.in_flight:
            return "pulling"
        name = self.location.object_name
        try:
            if await asyncio.to_thread(self.remote.exists, name(key, "READY.json")):
                return "present"
            if await asyncio.to_thread(self.remote.exists, name(key, "manifest.json")):
                return "incomplete"
        except HwrError:
            return "unreachable"
        return "absent"


def metric_blocks(fleet: Fleet | None) -> list[list[str]]:
    """The fleet tier's series for ``hwr.daemon.app.exposition`` (none when it is off)."""
    if fleet is None:
        return []
    from hwr.daemon.system.metrics import Counter, counter_lines

    pulls = Counter("hwr_remote_pulls_total", "Pulls from the remote tier, by outcome.", "outcome")
    for outcome, count in fleet.pulls.items():
        pulls.inc(outcome, count)
    pushes = Counter("hwr_remote_pushes_total", "Uploads to the remote tier, by outcome.", "outcome")
    for outcome, count in fleet.pushes.items():
        pushes.inc(outcome, count)
    return [pulls.lines(), pushes.lines(),
            counter_lines("hwr_remote_pulled_bytes_total", "Payload bytes pulled from the remote.", fleet.bytes_pulled),
            counter_lines("hwr_remote_pushed_bytes_total", "Payload bytes pushed to the remote.", fleet.bytes_pushed)]
