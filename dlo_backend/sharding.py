"""Build one rank's host shard of a block (AllGather mode) without materializing the block.

For each dtype group, rank ``r`` keeps elements ``[r * shard, (r + 1) * shard)`` of the group's
flattened physical storage (see ``layout``); the pieces come straight from the host tensors'
storage spans, so a rank's host memory for streamed blocks is about ``1 / world`` of the model
plus at most ``world - 1`` padding elements per group. Gaps and padding are zero.
"""

from __future__ import annotations

import torch

from hwr.dlo_backend.arena import HostArena
from hwr.dlo_backend.layout import BlockLayout, shard_pieces

__all__ = ["build_shard", "flat_span"]


def flat_span(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s physical storage span as a 1-D tensor over the same memory (no copy)."""
    span = 1 + sum((size - 1) * step for size, step in zip(tensor.shape, tensor.stride(), strict=True))
    if tensor.numel() == 0:
        span = 0
    return torch.as_strided(tensor, (span,), (1,), tensor.storage_offset())


def build_shard(
    layout: BlockLayout, host: list[torch.Tensor], rank: int, *, pin: bool, arena: HostArena | None = None
) -> list[torch.Tensor]:
    """Rank ``rank``'s shard of every dtype group of one block.

    Carved from ``arena`` when given (exact sizes; pinned if the arena is, see ``arena``), else
    one tensor per group (pinned when ``pin``, which rounds each up to a power of two).
    """
    shards: list[torch.Tensor] = []
    for index, group in enumerate(layout.groups):
        if arena is not None:
            shard = arena.take(group.shard_numel, group.dtype)  # fresh memory: zero
        else:
            shard = torch.zeros(group.shard_numel, dtype=group.dtype, pin_memory=pin)
        for piece in shard_pieces(layout, index, rank):
            source = flat_span(host[piece.tensor])[piece.source : piece.source + piece.length]
            shard[piece.target : piece.target + piece.length].copy_(source)
        shards.append(shard)
    return shards
