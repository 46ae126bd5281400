"""The running configuration and the roles derived from it, as the handlers read them.

A SIGHUP reload (``hwr.daemon.app.reload``) replaces ``config`` and, when a role key changed,
``roles`` on the daemon's one ``RunningSettings``; each is an immutable value swapped by one
assignment, so a handler that reads ``settings.roles`` once sees the old roles or the new ones,
never half of a change. Readers hold that object typed as ``Settings`` (these two attributes and
nothing else), never a copy of its fields.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from hwr.daemon.service.roles import roles_from

if TYPE_CHECKING:
    from hwr.daemon.service.roles import Roles
    from hwr.daemon.system.config import DaemonConfig

__all__ = ["RunningSettings", "Settings"]


class Settings(Protocol):
    config: DaemonConfig
    roles: Roles


class RunningSettings:
    """The one ``Settings`` a daemon runs with: ``config`` and the ``roles`` derived from it, both
    swapped (never mutated) by a reload."""

    def __init__(self, config: DaemonConfig) -> None:
        self.config: DaemonConfig = config
        self.roles: Roles = roles_from(config)
