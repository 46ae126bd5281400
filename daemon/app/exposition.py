"""One scrape of hwrd's metrics: the series of ``hwr.daemon.system.metrics``, gathered from the
collaborators the wiring built (the store, the lease registry, publications, the fleet tier).

Call on the event loop thread: one call renders in one loop step, so its numbers are consistent
with each other (see ``hwr.daemon.system.metrics``'s contract).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hwr.daemon.fleet.tier import metric_blocks as fleet_blocks
from hwr.daemon.system.metrics import Counter, counter_lines, gauge_lines, render

if TYPE_CHECKING:
    from hwr.daemon.fleet.tier import Fleet
    from hwr.daemon.service.catalog import Catalog
    from hwr.daemon.service.channels import Channels
    from hwr.daemon.service.publishing import Publishing
    from hwr.daemon.service.sessions import Registry
    from hwr.daemon.system.metrics import Instruments

__all__ = ["exposition"]


def exposition(*, catalog: Catalog, registry: Registry, publications: Publishing, metrics: Instruments,
               fleet: Fleet | None, channels: Channels | None = None) -> bytes:
    records = catalog.records_now()
    pubs = Counter("hwr_publications_total", "Publications finished, by outcome.", "outcome")
    pubs.inc("committed", publications.committed)
    pubs.inc("failed", publications.failed)
    return render([
        gauge_lines("hwr_artifacts", "Ready artifacts in the store.", len(records)),
        gauge_lines("hwr_store_bytes", "Bytes of the ready artifacts.", sum(r.size_bytes for r in records)),
        gauge_lines("hwr_leases", "Leases held now.", registry.lease_count()),
        gauge_lines("hwr_sessions", "Sessions open now.", len(registry.sessions())),
        gauge_lines("hwr_publications_active", "Publications in progress.", len(publications.active())),
        counter_lines("hwr_leases_granted_total", "Leases granted since start.", registry.leases_granted),
        counter_lines("hwr_leases_released_total", "Leases released since start.", registry.leases_released),
        pubs.lines(), metrics.evictions.lines(), metrics.check_failures.lines(), metrics.acquire.lines(),
        metrics.publication_phases.lines(), *fleet_blocks(fleet), *_channel_blocks(channels),
    ])


def _channel_blocks(channels: Channels | None) -> list[list[str]]:
    """Channels in aggregate: names and keys are never labels (see ``metrics``); ``hwrctl
    status`` and ``hwrctl channel ls`` list them one by one."""
    if channels is None:
        return []
    states = channels.states()
    return [
        gauge_lines("hwr_channels", "Channels on this node.", len(states)),
        gauge_lines("hwr_channel_watchers", "Watches of channels open now, over all channels.",
                    channels.watcher_count()),
        gauge_lines("hwr_channels_non_durable", "Channels pointing to a non-durable artifact now.",
                    sum(1 for s in states if not s.durable)),
        counter_lines("hwr_channel_switches_total", "Channel changes since start.", channels.switches),
    ]
