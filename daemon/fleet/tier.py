"""The fleet tier as the daemon sees it: one remote, its puller and pusher, and their counters.

The service graph (``hwr.daemon.app.graph``) builds at most one ``Fleet`` (only when ``remote``
is configured), and it is called from three places: the read API's ``Catalog.record_or_pull``
after a local miss (``pull_on_miss``, the catalog's ``MissFetcher``; both transports' acquires
and so the vLLM-Omni plugin's lookups pass there), ``Publishing``' commit hook (``committed``;
pulls excluded) and the remote RPCs (``hwr.daemon.rpc.remote``).

A miss and a pull (``pull_on_miss``, as the caller's ``MissPolicy`` says): a pull of the key
already running is joined by anyone who may acquire (waiting stages nothing); starting one
needs the publish role, since a pull stages and commits an artifact like a publication (and may
evict to make room), so a caller without it gets ``PermissionDeniedError`` naming the role, the
key and the remote, and nothing is asked of the remote. A caller that does not wait (a
``preferred`` start that falls back at once) starts the pull and gets ``ArtifactNotFound`` with
``details["pulling"]`` right away; the pull goes on for the next start. A waiter is registered
on the pull (``PullProgress.waiters``) while it waits, which ``hwrctl status`` shows.

Counters (``hwr.daemon.app.exposition`` exposes them): pull and push outcomes by fixed words, and the
bytes each direction moved.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

from hwr.client.errors import ArtifactNotFound, HwrError, PermissionDeniedError
from hwr.daemon.fleet.peer_fill import PeerFill
from hwr.daemon.fleet.peer_tier import Peers
from hwr.daemon.fleet.progress import PullProgress
from hwr.daemon.fleet.pull import Puller
from hwr.daemon.fleet.push import Pusher
from hwr.daemon.fleet.remote import RemoteEntry, RemoteLocation, RemoteStore, open_remote, parse_location

if TYPE_CHECKING:
    from hwr.daemon.service.catalog import Catalog, MissPolicy
    from hwr.daemon.service.publishing import Publishing
    from hwr.daemon.store.inspection import ArtifactRecord
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
    def __init__(self, location: RemoteLocation, remote: RemoteStore, catalog: Catalog, publications: Publishing, *,
                 root: Path, push: bool, wait_timeout: float, stall_timeout: float = 60.0) -> None:
        self.location = location
        self.remote = remote
        self.push_enabled = push
        self.pulls: dict[str, int] = dict.fromkeys(PULL_OUTCOMES, 0)
        self.pushes: dict[str, int] = dict.fromkeys(PUSH_OUTCOMES, 0)
        self.bytes_pulled = 0
        self.bytes_pushed = 0
        self.puller = Puller(remote, catalog, publications, wait_timeout=wait_timeout, stall_timeout=stall_timeout,
                             on_outcome=self._pulled)
        self.pusher = Pusher(remote, catalog, root, on_outcome=self._pushed)
        self._recording: set[asyncio.Task[None]] = set()  # to-push records being written
        # (monotonic time, "" or the error, "" or its code) of the last probe
        self._probe: tuple[float, str, str] | None = None
        self.peers: Peers | None = None  # the peer tier (hwr.daemon.fleet.peer_tier), when enabled

    @classmethod
    def open(cls, config: DaemonConfig, catalog: Catalog, publications: Publishing) -> Fleet | None:
        location = location_of(config)
        if location is None:
            return None
        remote = open_remote(location)
        fleet = cls(location, remote, catalog, publications, root=Path(config.root), push=config.remote_push,
                    wait_timeout=config.publication_wait_timeout_s, stall_timeout=config.remote_stall_timeout_s)
        if Peers.enabled(config):
            fleet.peers = Peers(config, remote, catalog)
            if config.fleet_peer_fetch:
                fleet.puller.peer_fill = PeerFill(fleet.peers)
        return fleet

    async def start(self) -> None:
        if self.peers is not None:
            await self.peers.start()
        await self.pusher.start()
        log.info("remote tier %s (push %s)", self.location.display, "on" if self.push_enabled else "off")

    async def stop(self) -> None:
        await self.pusher.stop()
        self.puller.close()
        if self.peers is not None:
            await self.peers.stop()
        await asyncio.to_thread(self.remote.close)

    # ------------------------------------------------------------------ hooks
    async def pull_on_miss(self, key: str, how: MissPolicy) -> ArtifactRecord:
        """The catalog's ``MissFetcher`` (the module docstring says who may start, who waits)."""
        progress = self.puller.in_flight.get(key)
        if progress is None:
            if not how.start:
                raise self._not_allowed(key, how)
            progress = await self.puller.start(key)
        if not how.wait:
            raise ArtifactNotFound(
                f"artifact {key[:16]} is not on this node yet: it is being pulled from remote "
                f"{self.location.display} ({progress.describe()}); not waiting for it",
                details={"key": key, "remote": self.location.display, "pulling": True,
                         "done_bytes": progress.done_bytes, "total_bytes": progress.total_bytes})
        with progress.waiting(how.waiter):
            record, _outcome = await self.puller.join(progress)
        return record

    def _not_allowed(self, key: str, how: MissPolicy) -> PermissionDeniedError:
        uid = how.waiter.uid if how.waiter is not None else -1
        return PermissionDeniedError(
            f"artifact {key[:16]} is not on this node, and pulling it from remote {self.location.display} "
            f"needs the publish role; uid {uid} does not have it (hwrd's publish_uids/publish_gids; an "
            f"operator can run `hwrctl pull {key[:16]}`)",
            details={"role": "publish", "action": "pull on miss", "uid": uid, "key": key,
                     "remote": self.location.display})

    def pulling(self, key: str) -> PullProgress | None:
        """The pull of ``key`` in flight, if any (the transports' progress frames read it)."""
        return self.puller.in_flight.get(key)

    def committed(self, key: str) -> None:
        """``Publishing``' commit hook (on the loop): announce it to the fleet's peers (when
        serving) and queue the upload unless a pull committed it."""
        if self.peers is not None:
            self.peers.committed(key)
        if not self.push_enabled or key in self.puller.committing:
            return
        self.puller.forget_miss(key)  # it is on its way to the remote
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
    async def reachable(self, max_age_s: float = 2.0) -> tuple[bool, str, str]:
        """(reachable, error, error code) from a probe at most ``max_age_s`` old; the code is
        ``REMOTE_DENIED`` when the remote refused hwrd's credentials or permissions,
        ``REMOTE_UNAVAILABLE`` when it did not answer, "" when it answered."""
        now = time.monotonic()
        if self._probe is None or now - self._probe[0] > max_age_s:
            try:
                await asyncio.to_thread(self.remote.probe)
                self._probe = (now, "", "")
            except HwrError as exc:
                self._probe = (now, exc.message, exc.code)
        return not self._probe[1], self._probe[1], self._probe[2]

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
            counter_lines("hwr_remote_pushed_bytes_total", "Payload bytes pushed to the remote.", fleet.bytes_pushed),
            *peer_metric_blocks(fleet)]


def peer_metric_blocks(fleet: Fleet) -> list[list[str]]:
    """The peer tier's series (none when it is off)."""
    if fleet.peers is None:
        return []
    from hwr.daemon.system.metrics import counter_lines

    c = fleet.peers.counters
    return [
        counter_lines("hwr_peer_served_bytes_total", "Payload bytes granted to the fleet's other nodes.",
                      c.served_bytes),
        counter_lines("hwr_peer_fetched_bytes_total", "Payload bytes pulled from peers.", c.fetched_bytes),
        counter_lines("hwr_peer_fallback_bytes_total", "Payload bytes a peer pull took from the remote instead.",
                      c.fallback_bytes),
        counter_lines("hwr_peer_pulls_total", "Pulls that read from at least one peer.", c.peer_pulls),
        counter_lines("hwr_peer_dropped_lying_total", "Peers dropped from a pull: their bytes failed verification.",
                      c.lying_peers),
        counter_lines("hwr_peer_dropped_failed_total", "Peers dropped from a pull: they failed or stalled.",
                      c.failed_peers),
        counter_lines("hwr_peer_refused_total",
                      "Peer connections refused: not a member of the fleet, or outside its networks.", c.refused),
        counter_lines("hwr_peer_agent_restarts_total", "Times the peer transfer process died and was restarted.",
                      c.agent_restarts),
    ]
