"""The prefetch policy: which slot a block runs from and what to prefetch, as a pure function.

Blocks form a ring ``0 .. count-1``; the block after ``i`` is ``(i + 1) % count``, so the tail
prefetches the head for the next pass. Slots are tracked by *ownership*, never by ``i % 2``:
a block runs from the slot that actually holds it, so odd counts stay correct over any number
of passes (the tail's prefetch of the head lands in whichever slot is free). When a block is
not where the ring predicted (the model skipped or reordered blocks, or a forward raised) it
is fetched on demand into the slot the previous block did not use; this stays correct and
only loses the overlap. With AllGather, every rank makes the same decisions because they see
the same call order, so collectives stay matched.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Step", "plan_step"]


@dataclass(frozen=True)
class Step:
    """What to do when block ``block`` is about to run."""

    slot: int
    fetch: bool
    prefetch: int | None
    prefetch_slot: int


def plan_step(block: int, owners: tuple[int | None, int | None], last_slot: int | None, count: int) -> Step:
    """Decide the slot for ``block`` and the prefetch of its successor.

    ``owners`` are the blocks held by slots 0 and 1; ``last_slot`` is the slot of the block
    that ran last (``None`` before the first). Requires ``count >= 2``.
    """
    if count < 2 or not 0 <= block < count:
        raise ValueError("a ring needs at least two blocks and a block inside it")
    if block in owners:
        slot, fetch = owners.index(block), False
    else:
        slot, fetch = (0 if last_slot is None else 1 - last_slot), True
    following = (block + 1) % count
    other = 1 - slot
    prefetch = None if owners[other] == following else following
    return Step(slot=slot, fetch=fetch, prefetch=prefetch, prefetch_slot=other)
