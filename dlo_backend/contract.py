"""The model's tensor contract: what a new revision must hold for a live update to be taken.

At ``enable()`` the backend records, for every tensor a revision replaces, its state-dict name
with the dtype, shape and stride the model runs it with (``TensorContract``): the parameters and
persistent buffers of every block (streamed or resident), as bound and validated at enable, and
the model's other parameters and persistent buffers (embeddings, final layers: ``collect_rest``),
as they are at enable. A revision is a whole model: a fresh model loaded with it must compute
what the updated one computes, so the non-block tensors switch with the blocks.

``mismatches`` is a pure function over ``TensorMeta``s; ``TensorContract.check`` applies it to a
lease's views and raises ``RevisionMismatch``. Names a revision holds that the model has not
are ignored, as at ``enable()``. Non-persistent buffers are no part of a checkpoint and keep
coming from the module.

Limits: the contract is what the model held at enable. Tensors shared by two modules outside
the blocks (tied weights) are switched once, under the first name ``named_modules`` reaches.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import torch
from torch import nn

from hwr.dlo_backend.errors import RevisionMismatch
from hwr.dlo_backend.layout import TensorMeta
from hwr.dlo_backend.sources import BlockSource

__all__ = ["ModelTensor", "TensorContract", "collect_rest", "meta_of", "mismatches"]

# How many mismatching names an error message lists before it says "and N more".
_LISTED = 3


def meta_of(name: str, tensor: torch.Tensor) -> TensorMeta:
    return TensorMeta(name, tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()))


def mismatches(want: Mapping[str, TensorMeta], got: Mapping[str, TensorMeta]) -> list[str]:
    """Why ``got`` (a revision's tensors) cannot replace ``want`` (the contract); empty: it can."""
    problems: list[str] = []
    for name, meta in want.items():
        have = got.get(name)
        if have is None:
            problems.append(f"{name}: missing")
        elif (have.dtype, have.shape, have.stride) != (meta.dtype, meta.shape, meta.stride):
            problems.append(
                f"{name}: {have.dtype} {list(have.shape)} stride {list(have.stride)}, the model runs "
                f"{meta.dtype} {list(meta.shape)} stride {list(meta.stride)}"
            )
    return problems


@dataclass(frozen=True)
class TensorContract:
    """State-dict name -> the dtype, shape and stride every revision must give that tensor."""

    metas: Mapping[str, TensorMeta]

    @classmethod
    def of(cls, sources: Iterable[BlockSource], rest: Iterable[ModelTensor]) -> TensorContract:
        """The contract of the bound block ``sources`` and the model's other tensors ``rest``."""
        metas: dict[str, TensorMeta] = {}
        for source in sources:
            for ref, host in zip(source.refs, source.host, strict=True):
                if ref.persistent:
                    metas[ref.name] = meta_of(ref.name, host)
        for ref in rest:
            metas[ref.name] = meta_of(ref.name, ref.current())
        return cls(MappingProxyType(metas))

    def check(self, tensors: Mapping[str, torch.Tensor], key: str) -> None:
        """Raise ``RevisionMismatch`` unless ``tensors`` (CPU views) satisfy the contract."""
        got = {
            name: meta_of(name, tensors[name])
            for name in self.metas
            if name in tensors and tensors[name].device.type == "cpu"
        }
        problems = mismatches(self.metas, got)
        if problems:
            more = f" and {len(problems) - _LISTED} more" if len(problems) > _LISTED else ""
            first = problems[0].split(":", 1)[0]
            raise RevisionMismatch(
                f"revision {key} does not match the model's tensor contract: {'; '.join(problems[:_LISTED])}{more}",
                details={"key": key, "tensor": first, "mismatches": len(problems)},
            )


@dataclass(eq=False)
class ModelTensor:
    """One of the model's non-block tensors: where it is registered (no reference to its bytes,
    so a switch leaves nothing of an old revision alive)."""

    name: str
    owner: nn.Module
    attr: str
    is_param: bool

    def current(self) -> torch.Tensor:
        store = self.owner._parameters if self.is_param else self.owner._buffers
        value = store[self.attr]
        assert value is not None
        return value

    def replace_object(self, value: torch.Tensor) -> None:
        """Swap the registered object itself (for meta tensors, which ``.data`` can't take)."""
        store = self.owner._parameters if self.is_param else self.owner._buffers
        store[self.attr] = value  # type: ignore[assignment]


def collect_rest(model: nn.Module, blocks: Sequence[nn.Module]) -> list[ModelTensor]:
    """The model's parameters and persistent buffers outside ``blocks`` (once per tensor object)."""
    inside = {id(module) for block in blocks for module in block.modules()}
    seen: set[int] = set()
    refs: list[ModelTensor] = []
    for prefix, module in model.named_modules():
        if id(module) in inside:
            continue
        tensors: list[tuple[str, torch.Tensor, bool]] = [
            (attr, p, True) for attr, p in module._parameters.items() if p is not None
        ]
        tensors += [
            (attr, b, False)
            for attr, b in module._buffers.items()
            if b is not None and attr not in module._non_persistent_buffers_set
        ]
        for attr, tensor, is_param in tensors:
            if id(tensor) in seen:
                continue  # tied: switched once
            seen.add(id(tensor))
            refs.append(ModelTensor(f"{prefix}.{attr}" if prefix else attr, module, attr, is_param))
    return refs
