"""What the gRPC handlers work with, passed in when the servicer is built (by ``hwr.daemon.app``).

Every field is the one object of its kind in the daemon; the servicer and its handler classes
(``hwr.daemon.rpc.checkpoints``, ``.store_admin``, ``.remote``) read them from ``self.c`` and
never reach for anything else. ``settings`` is shared, not copied: a SIGHUP reload swaps its
config and roles in place (``hwr.daemon.service.settings``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from hwr.daemon.rpc.support import authorize, session_of
from hwr.daemon.service.roles import Role

if TYPE_CHECKING:
    from hwr.daemon.checkpoints.registry import Checkpoints
    from hwr.daemon.fleet.tier import Fleet
    from hwr.daemon.service.capacity import Capacity
    from hwr.daemon.service.catalog import Catalog
    from hwr.daemon.service.channels import Channels
    from hwr.daemon.service.leasing import Leasing
    from hwr.daemon.service.pinning import Pinning
    from hwr.daemon.service.publishing import Publishing
    from hwr.daemon.service.sessions import Registry, Session
    from hwr.daemon.service.settings import Settings
    from hwr.daemon.system.metrics import Instruments

__all__ = ["Ctx", "Handlers", "RpcCollaborators"]

#: The context every handler receives.
Ctx = grpc.aio.ServicerContext


@dataclass(frozen=True)
class RpcCollaborators:
    settings: Settings
    registry: Registry
    catalog: Catalog
    leasing: Leasing
    publications: Publishing
    capacity: Capacity  # eviction, garbage collection, usage
    pinning: Pinning  # pin, unpin
    checkpoints: Checkpoints
    fleet: Fleet | None  # None: no remote tier configured
    metrics: Instruments
    socket_path: Path
    started: float  # time.monotonic() when the daemon started (uptime)
    channels: Channels | None = None  # None: channels are not served (UNSUPPORTED)


class Handlers:
    """The base of the servicer and its handler classes: the collaborators and the two checks
    every handler starts with."""

    c: RpcCollaborators

    def _session(self, context: Ctx) -> Session:
        return session_of(self.c.registry, context)

    def _authorize(self, context: Ctx, role: Role, action: str) -> Session:
        return authorize(self.c.registry, self.c.settings, context, role, action)
