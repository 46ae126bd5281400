"""The running configuration and the roles derived from it, as the handlers read them.

A SIGHUP reload (``hwr.daemon.app.reload``) replaces ``config`` and, when a role key changed,
``roles`` on the object that owns them (the daemon's wiring, ``hwr.daemon.app.server.Daemon``);
each is an immutable value swapped by one assignment, so a handler that reads ``settings.roles``
once sees the old roles or the new ones, never half of a change. Readers hold that owner typed
as ``Settings`` (these two attributes and nothing else), never a copy of its fields.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from hwr.daemon.service.roles import Roles
    from hwr.daemon.system.config import DaemonConfig

__all__ = ["Settings"]


class Settings(Protocol):
    config: DaemonConfig
    roles: Roles
