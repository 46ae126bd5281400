"""Roles: who may acquire, who may publish, who may operate the store.

Three allow-lists, each a set of uids plus a set of gids (a caller's primary gid or any of its
supplementary groups, as the peer socket read them at connect, matches):

- ``acquire``: ``allow_uids`` / ``allow_gids`` (``hwr.daemon.system.peercred``): connect, open a
  session, acquire and release leases, list and inspect;
- ``publish``: ``publish_uids`` / ``publish_gids``: also begin, write, commit and abort
  publications (the only way a client makes hwrd consume disk). Both empty (the default) means
  everyone allowed to connect may publish;
- ``operator``: ``operator_uids`` / ``operator_gids``: register checkpoints, prewarm, deny and
  allow, pin and unpin, evict, collect garbage, verify, pull and push. Both empty (the default)
  means nobody beyond root and the daemon's own uid.

Root and the daemon's own uid hold every role. A refused call raises ``PermissionDeniedError``
whose details name the ``role`` it needs, the ``action`` and the caller's ``uid``. ``Roles`` is
immutable: a reload swaps the whole object, so one decision never sees half of a change.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from hwr.client.errors import PermissionDeniedError
from hwr.daemon.system.peercred import PeerCred

if TYPE_CHECKING:
    from hwr.daemon.system.config import DaemonConfig

__all__ = ["OPERATOR", "PUBLISH", "Role", "Roles", "roles_from"]

Role = Literal["publish", "operator"]
PUBLISH: Role = "publish"
OPERATOR: Role = "operator"
_KEYS = {PUBLISH: "publish_uids/publish_gids", OPERATOR: "operator_uids/operator_gids"}


@dataclass(frozen=True)
class Roles:
    daemon_uid: int
    publish_uids: frozenset[int] = frozenset()
    publish_gids: frozenset[int] = frozenset()
    operator_uids: frozenset[int] = frozenset()
    operator_gids: frozenset[int] = frozenset()

    def grants(self, cred: PeerCred, role: Role) -> bool:
        """Pure: whether ``cred`` (already admitted by the connect allow-list) holds ``role``."""
        if cred.uid in (0, self.daemon_uid):
            return True
        if role == PUBLISH:
            uids, gids = self.publish_uids, self.publish_gids
            if not uids and not gids:
                return True
        else:
            uids, gids = self.operator_uids, self.operator_gids
        return cred.uid in uids or any(g in gids for g in (cred.gid, *cred.groups))

    def require(self, cred: PeerCred, role: Role, action: str) -> None:
        if not self.grants(cred, role):
            raise PermissionDeniedError(
                f"{action} needs the {role} role; uid {cred.uid} does not have it "
                f"(hwrd's {_KEYS[role]})",
                details={"role": role, "action": action, "uid": cred.uid},
            )


def roles_from(config: DaemonConfig) -> Roles:
    """The roles of a ``DaemonConfig`` for a daemon running as this process's effective uid."""
    return Roles(os.geteuid(), frozenset(config.publish_uids), frozenset(config.publish_gids),
                 frozenset(config.operator_uids), frozenset(config.operator_gids))
