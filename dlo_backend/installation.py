"""What ``enable`` changed on the model, and how a teardown undoes it.

``Installation`` owns the rollback target: the hook registry, the blocks whose tensors were
re-pointed (in the order they were), and whether the backend committed. At INSTALL_HOOKS
resident blocks get device copies, streamed blocks get the stream's empty placeholders and
their two hooks, and (with live updates) the model gets its pass-boundary pre-hook, first of
its pre-hooks. Until COMMIT the original tensors are the rollback target: ``restore``
reattaches them. After it the host sources are, and ``restore`` gives rank-local blocks their
originals (module source) or CPU copies of the lease views; AllGather blocks are gathered back
by the runtime (``runtime.StreamingRuntime.gather_back``), not here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from hwr.dlo_backend.contract import ModelTensor
from hwr.dlo_backend.hooks import HookRegistry
from hwr.dlo_backend.sources import BlockSource, TensorRef, host_copy
from hwr.dlo_backend.stream import BlockStream

__all__ = ["Installation", "bind"]


def bind(ref: TensorRef | ModelTensor, value: torch.Tensor) -> None:
    """Point the model's tensor ``ref`` at ``value`` (zero copy: ``value`` is what it reads)."""
    current = ref.current()
    if current.is_meta:
        # ``.data`` cannot move a meta tensor to a real device: register a new object instead.
        # A fresh object per tensor (``detach`` aliases): placeholders are shared per dtype.
        fresh = nn.Parameter(value.detach(), requires_grad=current.requires_grad) if ref.is_param else value.detach()
        ref.replace_object(fresh)
    else:
        current.data = value


class Installation:
    """The model's side of an enabled backend (see the module docstring)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._hooks = HookRegistry()
        self._installed: list[BlockSource] = []
        self.committed = False

    def install(
        self,
        resident: Sequence[BlockSource],
        streamed: Sequence[BlockSource],
        stream: BlockStream,
        device: torch.device,
    ) -> None:
        """Resident blocks onto ``device``; streamed blocks onto placeholders, hooked to ``stream``."""
        for source in resident:
            self._installed.append(source)
            for ref, host in zip(source.refs, source.host, strict=True):
                on_device = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=device)
                on_device.copy_(host)
                bind(ref, on_device)
        for index, source in enumerate(streamed):
            self._installed.append(source)
            for ref in source.refs:
                bind(ref, stream.placeholder(ref.original.dtype))
            self._hooks.attach(source.module, lambda i=index: stream.before(i), lambda i=index: stream.after(i))

    def attach_boundary(self, boundary: Callable[[], None]) -> None:
        """Run ``boundary()`` before every call of the model, before any block's hook runs."""
        self._hooks.attach_pre(self.model, boundary)

    def commit(self, streamed: Sequence[BlockSource], *, allgather: bool) -> None:
        """From here on the original host tensors are no longer a rollback target; AllGather
        ranks drop the ones the backend does not stream from, keeping only their shards."""
        if allgather:
            for source in streamed:
                source.host = []
        self.committed = True

    def remove_hooks(self) -> None:
        self._hooks.remove()

    def restore(self, resident: Sequence[BlockSource], streamed: Sequence[BlockSource], *, allgather: bool) -> None:
        """Give the model back its weights (see the module docstring); the runtime has drained."""
        if not self.committed:
            for source in self._installed:
                for ref in source.refs:
                    if ref.original.is_meta:
                        ref.replace_object(ref.original)
                    else:
                        ref.current().data = ref.backing
            return
        for source in list(resident) + ([] if allgather else list(streamed)):
            for ref, host in zip(source.refs, source.host, strict=True):
                bind(ref, host if host is ref.backing else host_copy(host))

    def forget(self) -> None:
        """Drop the installed blocks (the teardown is done; they hold no rollback target)."""
        self._installed = []
