"""Host sources: where each block tensor's bytes come from, bound without host copies.

A ``BlockSource`` lists a block's tensors (parameters and buffers, as ``TensorRef``) with the
host tensor that holds each one's bytes:

- **module source** (``host_source=None``): the module's own CPU tensors (``.data``, shared
  storage, no copy).
- **lease source**: the lease's read-only views, looked up by state-dict name
  (``"blocks.0.attn.qkv.weight"``) for parameters and persistent buffers; shape, dtype and
  stride must match the model's tensor exactly, else ``HostSourceMismatch``. Non-persistent
  buffers are not in a checkpoint and come from the module.

``TensorRef`` keeps the original tensor object so a rollback can reattach it. Validation of
what cannot be streamed (``unsupported_reason``) is a pure function over the tensor.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from hwr.client.errors import InvalidRequest, Unsupported
from hwr.dlo_backend.errors import HostSourceMismatch
from hwr.dlo_backend.layout import TensorMeta

__all__ = [
    "SUPPORTED_QUANTIZATION",
    "BlockSource",
    "TensorRef",
    "bind_lease",
    "collect_blocks",
    "host_copy",
    "require_host_memory",
    "unsupported_reason",
]

# Online quantization schemes whose runtime layout is a plain tensor per name (weights plus
# per-tensor scales), so byte-exact sharding is valid. Anything else is rejected with AllGather.
SUPPORTED_QUANTIZATION = frozenset({None, "fp8_per_tensor"})

_PACKED_DTYPES = frozenset(
    getattr(torch, name)
    for name in ("uint1", "uint2", "uint3", "uint4", "uint5", "uint6", "uint7", "float4_e2m1fn_x2")
    if hasattr(torch, name)
)


@dataclass(eq=False)
class TensorRef:
    """One block tensor: its owner module and attribute, and the object found there."""

    name: str
    owner: nn.Module
    attr: str
    is_param: bool
    persistent: bool
    original: torch.Tensor
    backing: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        # Shares the original's storage; survives the backend swapping ``original.data``.
        self.backing = self.original.detach()

    def current(self) -> torch.Tensor:
        store = self.owner._parameters if self.is_param else self.owner._buffers
        value = store[self.attr]
        assert value is not None
        return value

    def replace_object(self, value: torch.Tensor) -> None:
        """Swap the registered object itself (used only for meta tensors, which ``.data`` can't take)."""
        store = self.owner._parameters if self.is_param else self.owner._buffers
        store[self.attr] = value  # type: ignore[assignment]


@dataclass(eq=False)
class BlockSource:
    """One block: its qualified name, module, tensors and their host bytes (same order)."""

    name: str
    module: nn.Module
    refs: tuple[TensorRef, ...]
    host: list[torch.Tensor] = field(default_factory=list)

    def metas(self) -> tuple[TensorMeta, ...]:
        return tuple(
            TensorMeta(ref.name, t.dtype, tuple(t.shape), tuple(t.stride()))
            for ref, t in zip(self.refs, self.host, strict=True)
        )


def plain_storage(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s bytes are its storage's: a plain tensor or parameter, or a subclass that
    only adds Python behaviour (vLLM's ``ModelWeightParameter`` carries a weight loader), not a
    dispatch-level wrapper (``DTensor``, quantized wrapper tensors) whose storage is something else."""
    cls = type(tensor)
    if cls in (torch.Tensor, nn.Parameter):
        return True
    return cls.__torch_dispatch__ is torch.Tensor.__torch_dispatch__ and not is_traceable_wrapper_subclass(tensor)


def unsupported_reason(tensor: torch.Tensor, *, allgather: bool) -> str | None:
    """Why ``tensor`` cannot be streamed (``None`` when it can)."""
    if not plain_storage(tensor):
        return f"tensor subclass {type(tensor).__name__} (quantized or distributed tensors are not streamed)"
    if tensor.layout != torch.strided:
        return f"layout {tensor.layout}"
    if tensor.is_quantized:
        return f"quantized dtype {tensor.dtype}"
    if allgather and tensor.dtype in _PACKED_DTYPES:
        return f"packed sub-byte dtype {tensor.dtype} cannot be sharded by element"
    return None


def _module_names(model: nn.Module) -> dict[int, str]:
    return {id(module): name for name, module in model.named_modules()}


def collect_blocks(model: nn.Module, blocks: Sequence[nn.Module]) -> list[BlockSource]:
    """Describe every block's tensors, bound to the module's own tensors as host bytes.

    Raises ``Unsupported`` for a tensor shared by two blocks (tied weights).
    """
    names = _module_names(model)
    seen: dict[int, str] = {}
    sources: list[BlockSource] = []
    for block in blocks:
        prefix = names.get(id(block))
        if prefix is None:
            raise InvalidRequest("a block is not a submodule of the model")
        refs: list[TensorRef] = []
        for module_name, module in block.named_modules():
            for attr, param in module._parameters.items():
                if param is not None:
                    refs.append(_ref(prefix, module_name, module, attr, param, True, True))
            for attr, buf in module._buffers.items():
                if buf is not None:
                    persistent = attr not in module._non_persistent_buffers_set
                    refs.append(_ref(prefix, module_name, module, attr, buf, False, persistent))
        for ref in refs:
            if id(ref.original) in seen:
                raise Unsupported(
                    f"{ref.name} is shared with {seen[id(ref.original)]}; tied weights cannot be streamed",
                    details={"tensor": ref.name},
                )
            seen[id(ref.original)] = ref.name
        sources.append(BlockSource(prefix, block, tuple(refs), [ref.backing for ref in refs]))
    return sources


def _ref(
    prefix: str, module_name: str, module: nn.Module, attr: str, tensor: torch.Tensor, is_param: bool, persistent: bool
) -> TensorRef:
    local = f"{module_name}.{attr}" if module_name else attr
    return TensorRef(f"{prefix}.{local}", module, attr, is_param, persistent, tensor)


def require_host_memory(sources: Sequence[BlockSource]) -> None:
    """Every host tensor must be a materialized CPU tensor."""
    for source in sources:
        for ref, host in zip(source.refs, source.host, strict=True):
            if host.device.type != "cpu":
                raise InvalidRequest(
                    f"{ref.name} is on {host.device}; streamed blocks must start on the host (CPU or a lease)",
                    details={"tensor": ref.name},
                )


def bind_lease(sources: Sequence[BlockSource], tensors: Mapping[str, torch.Tensor]) -> None:
    """Point every parameter and persistent buffer's host bytes at the lease's view."""
    for source in sources:
        for index, ref in enumerate(source.refs):
            if not ref.persistent:
                continue  # not part of a checkpoint; the module's own tensor stays the source
            view = tensors.get(ref.name)
            if view is None:
                raise HostSourceMismatch(f"the lease has no tensor {ref.name!r}", details={"tensor": ref.name})
            want = ref.original
            got = (view.dtype, tuple(view.shape), tuple(view.stride()))
            expected = (want.dtype, tuple(want.shape), tuple(want.stride()))
            if got != expected or view.device.type != "cpu":
                raise HostSourceMismatch(
                    f"lease tensor {ref.name!r} is {got} on {view.device}, the model expects {expected} on cpu",
                    details={"tensor": ref.name},
                )
            source.host[index] = view


def host_copy(value: torch.Tensor) -> torch.Tensor:
    """A private CPU tensor with ``value``'s shape, stride and bytes (what a restored block holds
    once the lease, or the device slot, it was read from is gone)."""
    copy = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="cpu")
    copy.copy_(value)
    return copy
