"""Byte layout of one block inside a device slot: pure planning over frozen descriptions.

A block's tensors are grouped by dtype (first-appearance order). Inside a group each tensor
occupies its *physical storage span* (``1 + sum((size - 1) * stride)`` elements), so a
transposed or otherwise strided tensor is rebuilt with ``as_strided`` and keeps its stride.
Offsets are aligned so every view starts on ``TENSOR_ALIGN_BYTES``; gaps are zero in shards.

Slot bytes of one block (``BlockLayout.nbytes``)::

    | group 0 (dtype a): t0 span | pad | t1 span | pad ... | zero pad to world multiple | pad |
    | group 1 (dtype b): ...                                                              |

With AllGather each group's element count is padded up to a multiple of ``world``; rank ``r``
owns elements ``[r * shard, (r + 1) * shard)`` of every group (``shard = ceil(numel / world)``).

Nothing here touches storage: these are the planner's dataclasses and pure functions.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "GROUP_ALIGN_BYTES",
    "TENSOR_ALIGN_BYTES",
    "BlockLayout",
    "DtypeGroup",
    "ShardPiece",
    "TensorLayout",
    "TensorMeta",
    "manifest_digest",
    "plan_block",
    "shard_pieces",
    "storage_span",
]

TENSOR_ALIGN_BYTES = 64
GROUP_ALIGN_BYTES = 256


def storage_span(shape: Sequence[int], stride: Sequence[int]) -> int:
    """Elements of storage a strided tensor touches, from its first element (0 if empty)."""
    if any(size == 0 for size in shape):
        return 0
    return 1 + sum((size - 1) * step for size, step in zip(shape, stride, strict=True))


def _align(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class TensorMeta:
    """What the planner needs to know of one block tensor (``name`` is the state-dict name)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def span(self) -> int:
        return storage_span(self.shape, self.stride)


@dataclass(frozen=True)
class TensorLayout:
    """Where a tensor lives in its dtype group: element ``offset`` of group ``group``."""

    meta: TensorMeta
    group: int
    offset: int


@dataclass(frozen=True)
class DtypeGroup:
    """One dtype's region of the slot.

    ``numel`` counts elements including alignment gaps and the zero padding up to a multiple of
    ``world``; ``shard_numel = numel // world`` is what one rank keeps on the host.
    """

    dtype: torch.dtype
    itemsize: int
    byte_offset: int
    numel: int
    shard_numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def shard_nbytes(self) -> int:
        return self.shard_numel * self.itemsize


@dataclass(frozen=True)
class BlockLayout:
    """The planned slot layout of one block, for a group of ``world`` ranks (1 = rank-local)."""

    name: str
    world: int
    groups: tuple[DtypeGroup, ...]
    tensors: tuple[TensorLayout, ...]
    nbytes: int

    @property
    def shard_nbytes(self) -> int:
        """Host bytes one rank keeps for this block in AllGather mode."""
        return sum(group.shard_nbytes for group in self.groups)

    @property
    def payload_nbytes(self) -> int:
        """Bytes of the tensors themselves (no alignment or padding)."""
        return sum(t.meta.span * self.groups[t.group].itemsize for t in self.tensors)


def plan_block(name: str, tensors: Sequence[TensorMeta], world: int = 1) -> BlockLayout:
    """Plan one block's slot layout; tensor order is kept within each dtype group."""
    if world < 1:
        raise ValueError("world must be >= 1")
    order: list[torch.dtype] = []
    for meta in tensors:
        if meta.dtype not in order:
            order.append(meta.dtype)
    cursor: dict[torch.dtype, int] = dict.fromkeys(order, 0)
    placed: list[TensorLayout] = []
    for meta in tensors:
        itemsize = torch.empty((), dtype=meta.dtype).element_size()
        start = _align(cursor[meta.dtype], max(1, TENSOR_ALIGN_BYTES // itemsize))
        placed.append(TensorLayout(meta=meta, group=order.index(meta.dtype), offset=start))
        cursor[meta.dtype] = start + meta.span
    groups: list[DtypeGroup] = []
    byte_offset = 0
    for dtype in order:
        itemsize = torch.empty((), dtype=dtype).element_size()
        shard = math.ceil(cursor[dtype] / world)
        group = DtypeGroup(dtype, itemsize, byte_offset, shard * world, shard)
        groups.append(group)
        byte_offset = _align(byte_offset + group.nbytes, GROUP_ALIGN_BYTES)
    return BlockLayout(name=name, world=world, groups=tuple(groups), tensors=tuple(placed), nbytes=byte_offset)


@dataclass(frozen=True)
class ShardPiece:
    """Copy ``length`` elements from tensor ``tensor``'s span at ``source`` to shard ``target``."""

    tensor: int
    source: int
    target: int
    length: int


def shard_pieces(layout: BlockLayout, group: int, rank: int) -> tuple[ShardPiece, ...]:
    """The pieces of rank ``rank``'s shard of dtype group ``group`` (gaps stay zero)."""
    shard = layout.groups[group].shard_numel
    lo, hi = rank * shard, (rank + 1) * shard
    pieces: list[ShardPiece] = []
    for index, placed in enumerate(layout.tensors):
        if placed.group != group:
            continue
        start, end = max(lo, placed.offset), min(hi, placed.offset + placed.meta.span)
        if start < end:
            pieces.append(ShardPiece(index, start - placed.offset, start - lo, end - start))
    return tuple(pieces)


def manifest_digest(layouts: Sequence[BlockLayout]) -> bytes:
    """SHA-256 over everything ranks must agree on before their first collective."""
    h = hashlib.sha256()
    for layout in layouts:
        h.update(f"B|{layout.name}|{layout.world}|{layout.nbytes}\n".encode())
        for group in layout.groups:
            h.update(f"G|{group.dtype}|{group.byte_offset}|{group.numel}\n".encode())
        for placed in layout.tensors:
            m = placed.meta
            h.update(f"T|{m.name}|{m.dtype}|{m.shape}|{m.stride}|{placed.group}|{placed.offset}\n".encode())
    return h.digest()
