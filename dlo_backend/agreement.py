"""Which revision the ranks of an AllGather group run next: one agreement per pass boundary.

Each rank of an AllGather group holds only its shard of every block, so all ranks must switch
to a new revision at the same pass, or a gather would mix shards of two revisions. Updates
reach the ranks at different moments (each rank's watch, acquire and check run on their own),
so at every pass boundary every rank states what it holds in one ``Proposal`` and all of them
are gathered on DLO's own communicator (``encode``/``decode``: 33 bytes per rank). Every rank
then applies ``decide`` to the same rows and reaches the same ``SwitchDecision``:

- every rank is ``READY`` with the same revision digest, refused by none: all switch to it;
- a digest some rank ``REFUSED`` (it failed that rank's contract check, or could not be
  prepared there) is refused by all: each rank drops it if it holds it and remembers it;
- anything else (a rank has nothing yet, or ranks hold different revisions because a newer one
  reached some of them first): nobody switches; they decide again at the next boundary (the
  newest revision replaces an older pending one, so the ranks converge once updates pause).

``decide`` is pure; the collective that gathers the proposals is the backend's (on the
communication lane, so it is ordered with the block gathers on every rank).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["PROPOSAL_BYTES", "Offer", "Proposal", "SwitchDecision", "decide", "decode", "encode"]

_DIGEST = 32
PROPOSAL_BYTES = 1 + _DIGEST


class Offer(enum.IntEnum):
    NONE = 0
    READY = 1
    REFUSED = 2


@dataclass(frozen=True)
class Proposal:
    """What one rank holds at a boundary: nothing, a revision ready to run, or one it refused."""

    offer: Offer = Offer.NONE
    digest: bytes = bytes(_DIGEST)


@dataclass(frozen=True)
class SwitchDecision:
    """What the group does at one boundary. ``switch``: the digest every rank switches to now
    (``None``: no switch). ``refused``: digest -> the group ranks that refused it."""

    switch: bytes | None
    refused: dict[bytes, tuple[int, ...]]


def encode(proposal: Proposal) -> bytes:
    if len(proposal.digest) != _DIGEST:
        raise ValueError("a proposal's digest has 32 bytes")
    return bytes([int(proposal.offer)]) + proposal.digest


def decode(rows: bytes, world: int) -> list[Proposal]:
    """The ``world`` proposals of an all-gather of ``encode``d rows (rank order)."""
    if len(rows) != world * PROPOSAL_BYTES:
        raise ValueError(f"{len(rows)} bytes are not {world} proposals")
    out = []
    for rank in range(world):
        row = rows[rank * PROPOSAL_BYTES : (rank + 1) * PROPOSAL_BYTES]
        out.append(Proposal(Offer(row[0]), bytes(row[1:])))
    return out


def decide(proposals: Sequence[Proposal]) -> SwitchDecision:
    """The verdict every rank reaches from the same gathered ``proposals`` (pure)."""
    refused: dict[bytes, list[int]] = {}
    for rank, proposal in enumerate(proposals):
        if proposal.offer is Offer.REFUSED:
            refused.setdefault(proposal.digest, []).append(rank)
    ready = {p.digest for p in proposals if p.offer is Offer.READY}
    unanimous = len(ready) == 1 and all(p.offer is Offer.READY for p in proposals)
    switch = next(iter(ready)) if unanimous and not refused.keys() & ready else None
    return SwitchDecision(switch, {digest: tuple(ranks) for digest, ranks in refused.items()})
