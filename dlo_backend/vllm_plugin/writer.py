"""vLLM-Omni's ``ArtifactWriter`` protocol in front of an hwrd publication.

vLLM-Omni producers write file by file (``open_tensor_file(name, specs)``, then
``write_tensor``/``write_rows``) and only say what the artifact is (``ProductionMetadata``) when
``produce()`` returns. An hwrd publication needs every tensor spec up front (the daemon lays out
the payload file), so ``CollectingWriter`` records the specs and the tensors during ``produce()``
and ``tensor_specs()``/``tensors()`` feed ``Client.publisher`` afterwards.

Memory: ``write_tensor`` keeps a reference to the producer's tensor (no copy); the finalized-model
producers vLLM-Omni ships pass live model parameters, so this costs nothing. ``write_rows``
assembles into one preallocated CPU tensor per name. Limit: a producer that materializes a fresh
tensor for every write keeps all of them alive until the publication is committed (peak host
memory = the artifact size), where vLLM-Omni's own writer would have streamed them to disk.
The file split chosen by the producer is not kept: hwrd lays out its own payload files (the
artifact's content digest does not depend on the split).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch

from hwr.client.publisher import TensorSpec

__all__ = ["CollectingWriter", "WriterError"]


class WriterError(ValueError):
    """The producer broke the writer protocol (unknown tensor, wrong shape, missing rows, ...)."""


@dataclass
class _Slot:
    spec: Any  # vLLM-Omni TensorWriteSpec
    tensor: torch.Tensor | None = None
    rows_written: int = 0
    whole: bool = False


class _FileWriter:
    def __init__(self, owner: CollectingWriter, name: str, slots: dict[str, _Slot], ordered: bool) -> None:
        self._owner = owner
        self._name = name
        self._slots = slots
        self._ordered = ordered
        self._order = list(slots)
        self._next = 0
        self._closed = False

    def _slot(self, name: str) -> _Slot:
        if self._closed:
            raise WriterError(f"tensor file {self._name!r} is closed")
        slot = self._slots.get(name)
        if slot is None:
            raise WriterError(f"tensor {name!r} is not declared in {self._name!r}")
        if self._ordered and not slot.whole and slot.rows_written == 0:
            if self._order[self._next] != name:
                raise WriterError(f"{self._name!r} is ordered: expected {self._order[self._next]!r}, got {name!r}")
            self._next += 1
        return slot

    def write_tensor(self, name: str, tensor: torch.Tensor) -> None:
        slot = self._slot(name)
        if slot.whole or slot.rows_written:
            raise WriterError(f"tensor {name!r} was already written")
        _check_like(name, tensor, slot.spec.dtype, tuple(slot.spec.shape))
        slot.tensor = tensor.detach() if tensor.device.type == "cpu" else tensor.detach().to("cpu")
        slot.whole = True

    def write_rows(self, name: str, start_row: int, tensor: torch.Tensor) -> None:
        slot = self._slot(name)
        shape = tuple(slot.spec.shape)
        if slot.whole or not shape:
            raise WriterError(f"tensor {name!r} cannot take rows")
        if start_row != slot.rows_written:
            raise WriterError(f"tensor {name!r}: rows must be written in order (expected row {slot.rows_written})")
        rows = int(tensor.shape[0]) if tensor.dim() else 0
        _check_like(name, tensor, slot.spec.dtype, (rows, *shape[1:]))
        if start_row + rows > shape[0]:
            raise WriterError(f"tensor {name!r}: rows beyond its declared shape")
        if slot.tensor is None:
            slot.tensor = torch.empty(shape, dtype=slot.spec.dtype)
        slot.tensor[start_row:start_row + rows].copy_(tensor.detach())
        slot.rows_written += rows

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for name, slot in self._slots.items():
            complete = slot.whole or (slot.tensor is not None and slot.rows_written == slot.spec.shape[0])
            if not complete:
                raise WriterError(f"tensor {name!r} in {self._name!r} was not completely written")

    def __enter__(self) -> _FileWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 _traceback: TracebackType | None) -> bool | None:
        if exc_type is None:
            self.close()
        else:
            self._closed = True
        return None


class CollectingWriter:
    """Collects one artifact's tensors during ``produce()``; single use, not thread-safe."""

    def __init__(self) -> None:
        self._slots: dict[str, _Slot] = {}
        self._files: set[str] = set()

    def open_tensor_file(self, relative_name: str, specs: tuple[Any, ...], *, ordered: bool = False) -> _FileWriter:
        if not isinstance(relative_name, str) or not relative_name or "/" in relative_name:
            raise WriterError(f"invalid payload file name {relative_name!r}")
        if relative_name in self._files:
            raise WriterError(f"payload file {relative_name!r} was opened twice")
        if not specs:
            raise WriterError(f"payload file {relative_name!r} declares no tensors")
        slots: dict[str, _Slot] = {}
        for spec in specs:
            if spec.name in self._slots or spec.name in slots:
                raise WriterError(f"tensor {spec.name!r} is declared twice")
            slots[spec.name] = _Slot(spec)
        self._files.add(relative_name)
        self._slots.update(slots)
        return _FileWriter(self, relative_name, slots, ordered)

    def tensor_specs(self) -> list[TensorSpec]:
        """hwr publication specs (kind and role kept: they enter the content digest)."""
        return [TensorSpec(name, s.spec.dtype, tuple(s.spec.shape), str(s.spec.kind.value), s.spec.role)
                for name, s in sorted(self._slots.items())]

    def tensors(self) -> dict[str, torch.Tensor]:
        missing = [name for name, s in self._slots.items() if s.tensor is None]
        if missing or not self._slots:
            raise WriterError(f"the producer left {len(missing)} tensors unwritten" if missing
                              else "the producer wrote no tensors")
        return {name: s.tensor for name, s in sorted(self._slots.items()) if s.tensor is not None}


def _check_like(name: str, tensor: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise WriterError(f"tensor {name!r} is not a torch.Tensor")
    if tensor.dtype != dtype or tuple(tensor.shape) != shape:
        raise WriterError(f"tensor {name!r} is {tensor.dtype}{tuple(tensor.shape)}, declared {dtype}{shape}")
