"""One rank's AllGather shard of a block: how it is built, and where it comes from.

For each dtype group, rank ``r`` keeps elements ``[r * shard, (r + 1) * shard)`` of the group's
flattened physical storage (see ``layout``); the pieces come straight from the host tensors'
storage spans (``flat_span``), so a rank's host memory for streamed blocks is about ``1 / world``
of the model plus at most ``world - 1`` padding elements per group. Gaps and padding are zero.

A block's *gather input* holds this rank's shard of every dtype group, group ``g`` at byte
``shard_offsets(layout)[g]`` (each group's shard rounded up to ``GROUP_ALIGN_BYTES``). Two
sources write it, both behind ``copy_into(block, target)``:

- ``PrivateShards``: shards built once at ``enable()`` (``build_shard``, pinned on
  CUDA) and kept in private host memory for the life of the backend. The path for module
  tensors as host source, and for a lease with ``allgather_host_copy=True`` (upstream's design:
  the page cache plus private pinned shards, i.e. a second host copy of the model per node).
- ``LeaseShards``: no private copy. At every fill the rank's own *pieces* of the block
  (``layout.shard_pieces``: contiguous runs of the tensors' storage spans) are copied from the
  lease's read-only mapping into the gather input, so a rank only ever touches the pages of its
  own pieces (plus the kernel's fault-around) and the node keeps one physical copy, the
  daemon's. ``regions`` gives the page-aligned, merged address ranges of those pieces that lie
  inside the lease mapping: what CUDA registers (``cudaHostRegister``) so the H2D copy reads
  the mapping directly.

Limits: the bytes of alignment gaps and padding inside a gather input are not written by either
source (no tensor view covers them, so their content never reaches compute). A piece of a
non-persistent buffer comes from the module's own tensor (it is not in a checkpoint), which is
private but tiny. The caller keeps the lease open while a ``LeaseShards`` may be read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from hwr.client.carrier import MappedRegion
from hwr.dlo_backend.arena import HostArena
from hwr.dlo_backend.layout import GROUP_ALIGN_BYTES, BlockLayout, shard_pieces
from hwr.dlo_backend.paging import page_range

__all__ = [
    "LeaseShards",
    "Piece",
    "PrivateShards",
    "ShardSource",
    "build_shard",
    "flat_span",
    "input_nbytes",
    "merge_ranges",
    "shard_offsets",
]


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


def shard_offsets(layout: BlockLayout) -> list[int]:
    """Byte offset of every dtype group's shard inside the gather input."""
    offsets, cursor = [], 0
    for group in layout.groups:
        offsets.append(cursor)
        cursor += -(-group.shard_nbytes // GROUP_ALIGN_BYTES) * GROUP_ALIGN_BYTES
    return offsets


def input_nbytes(layout: BlockLayout) -> int:
    """Bytes of the gather input of one block (up to the end of its last group's shard)."""
    return shard_offsets(layout)[-1] + layout.groups[-1].shard_nbytes


class ShardSource(Protocol):
    kind: str

    @property
    def host_bytes(self) -> int:
        """Private host bytes this source keeps for its shards (0 when read from the lease)."""

    def copy_into(self, block: int, target: torch.Tensor) -> None:
        """Write this rank's shard of ``block`` into ``target`` (a 1-D uint8 gather input)."""


class PrivateShards:
    """Shards held in private host memory (pinned on CUDA), one list of groups per block."""

    kind = "private"

    def __init__(self, shards: Sequence[list[torch.Tensor]], layouts: Sequence[BlockLayout]) -> None:
        self._shards = list(shards)
        self._offsets = [shard_offsets(layout) for layout in layouts]

    @property
    def host_bytes(self) -> int:
        return sum(int(t.nbytes) for shard in self._shards for t in shard)

    def copy_into(self, block: int, target: torch.Tensor) -> None:
        for offset, shard in zip(self._offsets[block], self._shards[block], strict=True):
            flat = shard.view(torch.uint8)
            # non_blocking: the shards are pinned on CUDA; on CPU this is a plain memcpy.
            target[offset : offset + flat.numel()].copy_(flat, non_blocking=True)


@dataclass(frozen=True)
class Piece:
    """``source`` (a 1-D uint8 view of host memory) goes to byte ``target`` of the gather input."""

    source: torch.Tensor
    target: int


def _pieces(layout: BlockLayout, host: Sequence[torch.Tensor], rank: int) -> tuple[Piece, ...]:
    out: list[Piece] = []
    for group, offset in enumerate(shard_offsets(layout)):
        itemsize = layout.groups[group].itemsize
        for piece in shard_pieces(layout, group, rank):
            span = flat_span(host[piece.tensor])[piece.source : piece.source + piece.length]
            out.append(Piece(span.view(torch.uint8), offset + piece.target * itemsize))
    return tuple(out)


def merge_ranges(ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sort ``(start, length)`` ranges and merge the overlapping or touching ones (pure)."""
    merged: list[tuple[int, int]] = []
    for start, length in sorted(r for r in ranges if r[1] > 0):
        if merged and start <= merged[-1][0] + merged[-1][1]:
            last_start, last_length = merged[-1]
            merged[-1] = (last_start, max(last_length, start + length - last_start))
        else:
            merged.append((start, length))
    return merged


class LeaseShards:
    """This rank's pieces of every block, as views of the host sources (the lease mapping)."""

    kind = "lease"

    def __init__(self, layouts: Sequence[BlockLayout], hosts: Sequence[Sequence[torch.Tensor]], rank: int) -> None:
        self.pieces = [_pieces(layout, host, rank) for layout, host in zip(layouts, hosts, strict=True)]

    @property
    def host_bytes(self) -> int:
        return 0

    @property
    def piece_bytes(self) -> int:
        """Bytes this rank reads from its host sources per pass (about ``1 / world`` of the model)."""
        return sum(p.source.numel() for block in self.pieces for p in block)

    def copy_into(self, block: int, target: torch.Tensor) -> None:
        for piece in self.pieces[block]:
            # non_blocking: on CUDA the pieces' pages are registered (else the caller stages them).
            target[piece.target : piece.target + piece.source.numel()].copy_(piece.source, non_blocking=True)

    def regions(self, mapped: Sequence[MappedRegion]) -> tuple[MappedRegion, ...]:
        """Page-aligned merged ranges of the pieces that lie inside ``mapped`` (for registration)."""
        spans = [page_range(p.source.data_ptr(), p.source.numel()) for block in self.pieces for p in block]
        out: list[MappedRegion] = []
        for start, length in merge_ranges(spans):
            for region in mapped:
                lo = max(start, region.address)
                hi = min(start + length, region.address + region.length)
                if lo < hi:
                    out.append(MappedRegion(region.file, lo, hi - lo, True))
        return tuple(out)

    def close(self) -> None:
        """Drop the views (they must not outlive the lease)."""
        self.pieces = []
