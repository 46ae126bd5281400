"""Who may create and repoint a channel on a node shared by several teams (pure).

A channel is what running workers follow, so on a shared node it must not be anybody's to
repoint, and one uid must not be able to use up the node's table of them:

- An **operator** (``hwrctl channel set``, or a publication by a uid with the operator role)
  may create and repoint any channel; a channel an operator creates belongs to no uid
  (``owner`` None) and only operators repoint it.
- A **publisher** (a publication that names a channel) creates a channel it then owns
  (``owner`` = its uid) and may repoint only channels it owns. An operator repointing a
  publisher's channel (a rollback) leaves its owner as it is.
- **Quotas**: a uid owns at most ``MAX_OWNED_PER_UID`` channels; publishers together create
  channels only while fewer than ``MAX_CHANNELS - OPERATOR_RESERVE`` exist, so the last
  ``OPERATOR_RESERVE`` places are an operator's whatever publishers do. ``MAX_CHANNELS`` bounds
  everything (hwrd keeps the table and its file in memory).

A refusal is ``PERMISSION_DENIED`` (another uid's channel; details name the role, the channel and
its owner) or ``INVALID_ARGUMENT`` with ``details.reason`` (``CHANNELS_PER_UID``,
``CHANNELS_FOR_PUBLISHERS``, ``CHANNELS``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from hwr.client.errors import InvalidRequest, PermissionDeniedError

__all__ = ["MAX_CHANNELS", "MAX_OWNED_PER_UID", "OPERATOR_RESERVE", "Actor", "owner_after"]

MAX_CHANNELS = 1024
#: Places only an operator may fill (publishers stop at MAX_CHANNELS - OPERATOR_RESERVE).
OPERATOR_RESERVE = 128
MAX_OWNED_PER_UID = 64


@dataclass(frozen=True)
class Actor:
    """Who changes a channel: ``uid`` (None: hwrd itself, e.g. a restart's fallback) and whether
    it holds the operator role."""

    uid: int | None
    operator: bool


def owner_after(actor: Actor, name: str, exists: bool, owner: int | None, owners: Iterable[int | None]) -> int | None:
    """The channel's owner once ``actor`` sets ``name`` (``exists``: the channel is there now,
    owned by ``owner``; ``owners``: the owner of every channel of the node), or the typed refusal
    (module docstring)."""
    if exists:
        if actor.operator or (actor.uid is not None and owner == actor.uid):
            return owner
        who = "no publisher (an operator's channel)" if owner is None else f"uid {owner}"
        raise PermissionDeniedError(
            f"channel {name!r} belongs to {who}: repointing it needs the operator role",
            details={"role": "operator", "action": "repoint a channel another uid owns", "channel": name,
                     "uid": actor.uid if actor.uid is not None else -1,
                     "owner": owner if owner is not None else -1})
    owners = list(owners)
    if len(owners) >= MAX_CHANNELS:
        raise InvalidRequest(f"hwrd keeps at most {MAX_CHANNELS} channels; remove one first",
                             details={"limit": MAX_CHANNELS, "reason": "CHANNELS"})
    if actor.operator:
        return None
    if len(owners) >= MAX_CHANNELS - OPERATOR_RESERVE:
        raise InvalidRequest(
            f"publishers may create at most {MAX_CHANNELS - OPERATOR_RESERVE} channels on this node (the last "
            f"{OPERATOR_RESERVE} are for operators); ask an operator to remove unused ones",
            details={"limit": MAX_CHANNELS - OPERATOR_RESERVE, "reason": "CHANNELS_FOR_PUBLISHERS"})
    if sum(1 for o in owners if o is not None and o == actor.uid) >= MAX_OWNED_PER_UID:
        raise InvalidRequest(
            f"uid {actor.uid} already owns {MAX_OWNED_PER_UID} channels, the most one uid may create; "
            "publish to one of them, or ask an operator to remove one",
            details={"limit": MAX_OWNED_PER_UID, "reason": "CHANNELS_PER_UID", "uid": actor.uid})
    return actor.uid
