"""The two device slots every streamed block passes through, and views into them.

Each slot is one ``uint8`` device buffer of the largest block's ``nbytes``; a block uses the
prefix its layout needs (heterogeneous blocks narrow the view). A slot remembers which block
it holds or is being filled with (``owner``), the signal that its bytes are ready (recorded on
the lane that wrote them) and the signal that compute finished reading it (recorded on the
compute lane after the block ran). Writers wait on ``free``, readers on ``ready``.

Views are zero-copy: ``tensor_view`` rebuilds a tensor with its own shape and stride on top of
its dtype group's region, exactly as planned in ``layout``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hwr.dlo_backend.lanes import Signal
from hwr.dlo_backend.layout import BlockLayout

__all__ = ["SlotPair", "SlotState"]


@dataclass(frozen=True)
class SlotState:
    """A snapshot for probes: block held by each slot and the block bound for compute."""

    owners: tuple[int | None, int | None]
    bound: int | None


class SlotPair:
    """Exactly two device buffers of ``nbytes`` each, with ownership and signals."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.nbytes = nbytes
        self.buffers = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(2)]
        self.owner: list[int | None] = [None, None]
        self.ready: list[Signal | None] = [None, None]
        self.free: list[Signal | None] = [None, None]

    def group_view(self, slot: int, layout: BlockLayout, group: int) -> torch.Tensor:
        """The whole (padded) region of dtype group ``group`` as a 1-D typed tensor."""
        g = layout.groups[group]
        return self.buffers[slot][g.byte_offset : g.byte_offset + g.nbytes].view(g.dtype)

    def span_view(self, slot: int, layout: BlockLayout, index: int) -> torch.Tensor:
        """Tensor ``index``'s physical storage span as a 1-D typed tensor (the copy target)."""
        placed = layout.tensors[index]
        return self.group_view(slot, layout, placed.group)[placed.offset : placed.offset + placed.meta.span]

    def tensor_view(self, slot: int, layout: BlockLayout, index: int) -> torch.Tensor:
        """Tensor ``index`` with its own shape and stride, aliasing the slot."""
        placed = layout.tensors[index]
        group = self.group_view(slot, layout, placed.group)
        # as_strided's offset is absolute within the storage, so add the group view's own offset.
        return torch.as_strided(group, placed.meta.shape, placed.meta.stride, group.storage_offset() + placed.offset)

    def release(self) -> None:
        """Drop the device buffers; the caller has drained every lane that may touch them."""
        self.buffers = []
        self.owner = [None, None]
        self.ready = [None, None]
        self.free = [None, None]
