"""A node-wide bound on held connections, shared fairly between uids (pure).

Per-uid bounds alone scale with the number of uids: 24 uids holding their 32 gRPC connections
each (about 3 descriptors apiece) exhaust an hwrd started with 2,048 descriptors, and then an
innocent client cannot connect at all. So connections of one kind also have a node-wide
``budget``, a fixed share of the daemon's open-files limit (``connection_budget``), and when
it is full a newcomer is admitted only by taking a connection from the uid that holds the most:

- below the budget: admitted (the per-uid bound is checked before, by the caller);
- at the budget, the newcomer's uid holds ``mine`` and the biggest holder ``top`` (another uid):
  when ``top > mine + 1``, that uid's least recently active connection is shed and the newcomer
  admitted; otherwise the newcomer is refused.

So a uid holding fewer connections than the fair share (``budget / uids holding any``) always
gets in, and whatever the attackers do, the descriptors held stay within the budget. Shedding
never makes the shares less even: the shed uid keeps at least as many as the newcomer then has.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["ShareVerdict", "connection_budget", "share_verdict"]


@dataclass(frozen=True)
class ShareVerdict:
    """``admit``: let the newcomer in; ``shed_uid``: first close the least recently active
    connection of that uid (None: nothing to shed)."""

    admit: bool
    shed_uid: int | None = None


def connection_budget(nofile: int, fds_per_connection: int, share: float, minimum: int) -> int:
    """Connections that may hold ``share`` of ``nofile`` descriptors at ``fds_per_connection``
    each (at least ``minimum``)."""
    return max(minimum, int(nofile * share) // max(1, fds_per_connection))


def share_verdict(held: Mapping[int, int], uid: int, budget: int) -> ShareVerdict:
    """What to do with a new connection of ``uid``, given the connections each uid ``held``
    now (see the module docstring)."""
    if sum(held.values()) < budget:
        return ShareVerdict(True)
    mine = held.get(uid, 0)
    others = [(count, -other) for other, count in held.items() if other != uid and count > 0]
    if not others:
        return ShareVerdict(False)
    top, negated = max(others)  # ties: the lowest uid, so the choice is reproducible
    if top > mine + 1:
        return ShareVerdict(True, -negated)
    return ShareVerdict(False)
