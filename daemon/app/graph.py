"""The node service's object graph, built in one place: what hwrd serves and what tests drive.

``ServiceGraph.build(settings, store)`` builds every collaborator of the node service over one
open store, each handed its collaborators in its constructor (nothing is set on a part after it
is built): the read API ``Catalog`` over the store and the eviction marks, the lease holds (the
lease journal), recency, the weight ``Channels``, ``Capacity`` (its evictor protecting the
channels' keys), ``Pinning``, ``Publishing`` (which may set channels), the remote tier
(``Fleet``, when configured; the catalog asks it to pull a miss), the checkpoint registry and
``Leasing`` (every lease, journaled, and channel names resolved). ``hwr.daemon.app.server.Daemon``
builds the transports over it; tests build it on a temporary root and call the use cases
directly, with no daemon process::

    settings = RunningSettings(load_config(env={"HWR_ROOT": str(root), "HWR_SOCKET": str(sock)}))
    with Store.open(root) as store:
        graph = ServiceGraph.build(settings, store)
        session = graph.registry.open_session(cred)
        grant = await graph.leasing.grant(session, key)
        ...
        await graph.close()

Blocking: ``build`` reads the pins, the lease journal, ``channels.json`` and the checkpoint
registry (a daemon's start, before it serves). ``background()`` are the node service's own
tasks (housekeeping, pin restore, scrub), started by the caller on its loop; ``close()`` ends
what the graph owns except the store (the caller opened it, the caller closes it). The remote
tier's network tasks start with ``Fleet.start`` (the daemon's start).
"""

from __future__ import annotations

from collections.abc import Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hwr.daemon.checkpoints.registry import Checkpoints
from hwr.daemon.fleet.tier import Fleet
from hwr.daemon.service.capacity import Capacity
from hwr.daemon.service.catalog import Catalog
from hwr.daemon.service.channels import Channels
from hwr.daemon.service.eviction_marks import EvictionMarks
from hwr.daemon.service.housekeeping import Housekeeping
from hwr.daemon.service.lease_journal import LeaseHolds, LeaseJournal
from hwr.daemon.service.leasing import Leasing
from hwr.daemon.service.mapping_scan import MappingScan
from hwr.daemon.service.pinning import Pinning, PinSet, Residency
from hwr.daemon.service.publishing import Publishing
from hwr.daemon.service.recency import AccessTimes, Recency
from hwr.daemon.service.roles import OPERATOR
from hwr.daemon.service.scrubber import Scrubber
from hwr.daemon.service.sessions import Registry, Session
from hwr.daemon.store.writer_bounds import MemfdStagings
from hwr.daemon.system.metrics import Instruments

if TYPE_CHECKING:
    from hwr.daemon.service.catalog import MissFetcher
    from hwr.daemon.service.settings import RunningSettings
    from hwr.daemon.store.root import Store

__all__ = ["ServiceGraph"]


@dataclass(frozen=True, eq=False)
class ServiceGraph:
    """The node service's parts over one store (module docstring); built only by ``build``."""

    settings: RunningSettings
    store: Store
    metrics: Instruments
    registry: Registry
    catalog: Catalog
    pins: PinSet
    lease_holds: LeaseHolds
    recency: Recency
    channels: Channels
    capacity: Capacity
    pinning: Pinning
    publications: Publishing
    fleet: Fleet | None
    checkpoints: Checkpoints
    leasing: Leasing

    @classmethod
    def build(cls, settings: RunningSettings, store: Store, *, metrics: Instruments | None = None) -> ServiceGraph:
        """Every part over ``store`` (open; the caller closes it after ``close``), configured by
        ``settings.config`` and reading ``settings.roles`` at each decision (reloads apply)."""
        config = settings.config
        metrics = metrics if metrics is not None else Instruments()
        root = store.root
        registry = Registry(max_leases_per_session=config.max_leases_per_session,
                            max_leases_per_uid=config.max_leases_per_uid)
        pins = PinSet.open(root)
        marks = EvictionMarks()  # an acquire (or pin) of a key an eviction round marked waits for it
        fleet: Fleet | None = None  # built below, over the catalog; the catalog asks it at each miss

        def fetcher() -> MissFetcher | None:
            return fleet

        catalog = Catalog(store, marks, pins=pins, on_check_failure=metrics.count_check_failure,
                          fetcher=fetcher)
        lease_holds = LeaseHolds(LeaseJournal.open(root / "leases.journal"))
        recency = Recency(AccessTimes(root / "access.json"), catalog)
        channels = Channels.open(root, catalog.is_volatile, catalog.record_settled)
        scan = MappingScan(lease_holds)  # "nobody maps it", cached per key: eviction reads it, a lease voids it
        capacity = Capacity(config, store, catalog, registry, marks=marks, pins=pins, holds=lease_holds,
                            recency=recency, scan=scan,
                            protected=channels.protects,  # a channel's keys are never evicted
                            on_evict=metrics.count_eviction)
        pinning = Pinning(catalog, pins, Residency(config.mlock_budget_bytes))

        def committed(key: str) -> None:
            # Push after publish (pulls excluded); a non-durable revision stays on this node: it
            # is gone at the next start, and superseded within seconds anyway.
            if fleet is not None and not catalog.is_volatile(key):
                fleet.committed(key)

        def is_operator(session: Session) -> bool:
            return settings.roles.grants(session.cred, OPERATOR)  # the roles of now, after reloads too

        publications = Publishing(store, catalog, capacity=capacity, commit_threads=config.commit_threads,
                                  on_phase=metrics.observe_publication_phase, on_commit=committed,
                                  memfd_staging=MemfdStagings(config.memfd_staging_max_bytes),
                                  channels=channels, is_operator=is_operator)
        fleet = Fleet.open(config, catalog, publications)
        checkpoints = Checkpoints(root / "checkpoints")
        checkpoints.open()
        leasing = Leasing(catalog, registry, checkpoints=checkpoints, holds=lease_holds,
                          scan=scan, recency=recency, channels=channels,
                          on_last_release=capacity.signal_room, on_acquire=metrics.observe_acquire,
                          settings=settings)
        return cls(settings=settings, store=store, metrics=metrics, registry=registry, catalog=catalog,
                   pins=pins, lease_holds=lease_holds, recency=recency, channels=channels, capacity=capacity,
                   pinning=pinning, publications=publications, fleet=fleet, checkpoints=checkpoints,
                   leasing=leasing)

    def background(self) -> list[Coroutine[object, object, None]]:
        """The node service's own tasks, for the caller to run on its loop: housekeeping, the
        restore of pins (when any), scrub (when it has bandwidth)."""
        config = self.settings.config
        work: list[Coroutine[object, object, None]] = [
            Housekeeping(config, self.store, self.lease_holds, self.recency).run(self.publications)]
        if self.pins.keys():
            work.append(self.pinning.restore())
        if config.scrub_bandwidth_mib_s > 0:
            work.append(Scrubber(config, self.catalog).run())
        return work

    async def close(self) -> None:
        """Save the access times, close the lease journal, release resident pins, wait for the
        deletions of retired bytes handed over, close the checkpoint registry. The background
        tasks must have ended (the caller cancels them first); the store stays open."""
        self.recency.access.flush()
        self.lease_holds.close()
        await self.pinning.close()
        self.capacity.close()
        self.checkpoints.close()
