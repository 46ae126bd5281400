"""The ring at run time: what a block's forward hooks do (bind, prefetch, release).

One ``BlockStream`` per backend, made and owned by ``runtime.StreamingRuntime``.

``BlockStream.before(i)`` runs in block ``i``'s forward pre-hook: it asks the policy
(``ring.plan_step``) where ``i`` is, fetches it on demand if it is not in a slot, makes the
compute lane wait for that slot only, re-points ``i``'s tensors at what the transfer says compute
reads (views into the slot, or on a CPU device the host tensors themselves; zero copy either
way, same shape and stride) and starts the prefetch of the next block into the other slot.
``after(i)`` runs in the forward hook: it records that compute is done with the slot and puts
placeholders back, so no block's weights stay attached between calls.

A failure of the copy or communication lane marks the stream ``poisoned``; every later call
raises the error made by ``poison_error`` (a ``CollectiveStateError`` when a group is used).
With a group, every gather's completion is also handed to a ``watchdog.CollectiveWatchdog``:
NCCL failures are asynchronous and never reach the lane, so a gather that a peer never joins
poisons the stream through the watchdog instead (``poison``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from hwr.client.errors import HwrError
from hwr.dlo_backend.lanes import Lane, LaneError
from hwr.dlo_backend.layout import BlockLayout
from hwr.dlo_backend.ring import plan_step
from hwr.dlo_backend.slots import SlotPair, SlotState
from hwr.dlo_backend.sources import BlockSource
from hwr.dlo_backend.transfer import Transfer
from hwr.dlo_backend.watchdog import CollectiveWatchdog

__all__ = ["BlockStream"]


class _ClosedTransfer:
    """What a closed stream's transfer is: any use is an error, nothing is held."""

    mode = "closed"

    def fill(self, block: int, slot: int) -> None:
        raise RuntimeError("the block stream is closed")

    def tensor(self, block: int, slot: int, index: int) -> torch.Tensor:
        raise RuntimeError("the block stream is closed")

    def close(self) -> None:
        return None


class BlockStream:
    """Two-slot streaming of ``sources`` (ring order) through ``slots`` with ``transfer``."""

    def __init__(
        self,
        sources: Sequence[BlockSource],
        layouts: Sequence[BlockLayout],
        slots: SlotPair,
        transfer: Transfer,
        compute: Lane,
        device: torch.device,
        *,
        collective: bool,
        poison_error: Callable[[str], HwrError],
        watchdog: CollectiveWatchdog | None = None,
    ) -> None:
        self._sources, self._layouts, self._slots, self._transfer = sources, layouts, slots, transfer
        self._compute, self._device, self._collective = compute, device, collective
        self._poison_error = poison_error
        self._watchdog = watchdog
        self.poison_reason: str | None = None
        self._placeholders: dict[torch.dtype, torch.Tensor] = {}
        self._bound: tuple[int, int] | None = None
        self._last_slot: int | None = None
        self.gathered = False
        self.poisoned = False

    def close(self) -> None:
        """Drop the sources and the transfer (they hold the host views, lease views among them);
        ``poisoned`` and ``gathered`` stay readable. Call after ``unbind`` and the lanes' drain."""
        self._sources, self._layouts = [], []
        self._transfer = _ClosedTransfer()
        self._placeholders = {}
        self._bound = None

    def placeholder(self, dtype: torch.dtype) -> torch.Tensor:
        """The empty device tensor a block's tensors point at while it is not running."""
        if dtype not in self._placeholders:
            self._placeholders[dtype] = torch.empty(0, dtype=dtype, device=self._device)
        return self._placeholders[dtype]

    def slot_state(self) -> SlotState:
        return SlotState(
            owners=(self._slots.owner[0], self._slots.owner[1]),
            bound=None if self._bound is None else self._bound[0],
        )

    def fill(self, block: int, slot: int) -> None:
        """Start writing ``block`` into ``slot`` (a collective with AllGather)."""
        self._slots.owner[slot] = block
        self.gathered = self.gathered or self._collective
        self._transfer.fill(block, slot)
        if self._watchdog is not None:
            ready = self._slots.ready[slot]
            if ready is not None:
                self._watchdog.watch(ready, f"the gather of block {block}")

    def restart(self, transfer: Transfer) -> None:
        """Stream through ``transfer`` from now on (a live update, between two passes).

        What the slots hold is forgotten (it came through the old transfer) and the head of the
        ring is fetched again, into the slot ``ring.plan_step`` will look in, so the next pass
        starts as after ``enable()``. The caller has drained the lanes and unbound the block.
        """
        self._transfer = transfer
        self._slots.owner = [None, None]
        self.fill(0, 0 if self._last_slot is None else 1 - self._last_slot)

    def poison(self, reason: str) -> None:
        """Refuse every later call with ``reason`` (the watchdog's verdict on a stuck gather)."""
        self.poison_reason = reason
        self.poisoned = True

    def wait_ready(self, slot: int) -> None:
        # Wait: the slot's bytes are written on the copy/communication lane.
        self._compute.wait(self._slots.ready[slot])

    def mark_free(self, slot: int) -> None:
        # Record: the next writer of this slot must wait until compute has finished reading it.
        self._slots.free[slot] = self._compute.record()

    def _bind(self, block: int, slot: int) -> None:
        for index, ref in enumerate(self._sources[block].refs):
            ref.current().data = self._transfer.tensor(block, slot, index)
        self._bound = (block, slot)

    def unbind(self) -> None:
        """Release the running block (placeholders back); no-op when none is bound."""
        if self._bound is None:
            return
        block, slot = self._bound
        self.mark_free(slot)
        for ref in self._sources[block].refs:
            ref.current().data = self.placeholder(ref.original.dtype)
        self._bound = None
        self._last_slot = slot

    def before(self, block: int) -> None:
        if self.poisoned:
            reason = f" ({self.poison_reason})" if self.poison_reason else ""
            raise self._poison_error(f"the offload backend is poisoned by an earlier failure{reason}")
        try:
            if self._bound is not None:
                self.unbind()  # the previous block's forward raised before its post-hook
            owners = (self._slots.owner[0], self._slots.owner[1])
            step = plan_step(block, owners, self._last_slot, len(self._sources))
            if step.fetch:
                self.fill(block, step.slot)
            self.wait_ready(step.slot)
            self._bind(block, step.slot)
            if step.prefetch is not None:
                self.fill(step.prefetch, step.prefetch_slot)
        except (LaneError, RuntimeError) as exc:
            self.poisoned = True
            raise self._poison_error(f"streaming block {block} failed ({exc})") from exc

    def after(self, block: int) -> None:
        if self._bound is not None and self._bound[0] == block:
            self.unbind()
