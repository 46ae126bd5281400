"""The producer interface: a versioned, deterministic transform from checkpoint tensors to the
tensors of one final-layout artifact, computed in bounded memory.

A producer is built from plain options (``from_options``: what travels to the worker process as
JSON) and exposes:

- ``plan(sources)`` (pure): the output tensors (name, dtype, shape, which source, which op) for
  the checkpoint's tensors, in a deterministic order. The daemon plans the staging layout from
  it; the worker process recomputes it and both must agree.
- ``produce(output, reader, sink)``: writes one output tensor, reading its source in row blocks
  of at most ``BLOCK_BYTES`` (``reader.rows``) and writing each block at its byte offset
  (``sink.write``). Nothing ever holds a whole model, only a few blocks of one tensor.
- ``identity(source, rank)``: the artifact identity. The producer's name and version go into
  ``producer``, its policy (every option that changes bytes) into ``representation.metadata`` and
  the implementation fingerprint, the TP layout into ``layout``; so changing any of them changes
  the key.

Contract: the same inputs and options give the same bytes on every run (elementwise CPU torch
ops, no threads racing on one output, no randomness). Limits: row blocks follow dim 0, so one row
(``shape[1:]``) must fit in memory; 0-d tensors are one block.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import mmap
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from hwr.client.errors import InvalidRequest
from hwr.client.identity import (
    ArtifactIdentity,
    ComponentIdentity,
    ProducerIdentity,
    RuntimeLayout,
    SourceIdentity,
    WeightRepresentation,
    canonical_json,
)
from hwr.client.safetensors_header import DTYPES
from hwr.client.writeback import start_writeback

__all__ = [
    "BLOCK_BYTES",
    "DTYPE_ALIASES",
    "OutputTensor",
    "Producer",
    "SourceReader",
    "SourceTensor",
    "TensorSink",
    "row_blocks",
]

BLOCK_BYTES = 32 << 20
MANIFEST_SCHEMA = "hwr-manifest-1"
RESTORER_SCHEMA = "hwr-safetensors-1"
#: User-facing dtype names -> safetensors codes. The codes themselves (any case) are names too:
#: a producer's ``options()`` carry codes, and ``from_options`` in the worker parses them again.
DTYPE_ALIASES: Mapping[str, str] = {
    "bf16": "BF16", "bfloat16": "BF16", "fp16": "F16", "f16": "F16", "float16": "F16", "half": "F16",
    "fp32": "F32", "f32": "F32", "float32": "F32",
}  # fmt: skip
FLOAT_CODES = frozenset({"F64", "F32", "F16", "BF16"})


def dtype_code(name: str, *, field: str = "dtype") -> str:
    code = DTYPE_ALIASES.get(str(name).lower())
    if code is None:
        raise InvalidRequest(f"unsupported {field} {str(name)[:20]!r} (bf16, fp16 or fp32)", details={"field": field})
    return code


@dataclass(frozen=True)
class SourceTensor:
    name: str
    dtype: str  # safetensors code
    shape: tuple[int, ...]


@dataclass(frozen=True)
class OutputTensor:
    name: str
    dtype: str  # safetensors code
    shape: tuple[int, ...]
    source: str
    op: str  # producer-specific operation name
    kind: str = "parameter"
    role: str = "weight"

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize


def row_blocks(shape: Sequence[int], itemsize: int, budget: int | None = None) -> Iterator[tuple[int, int]]:
    """Pure: ``(start, stop)`` row ranges over dim 0 of at most ``budget`` (default ``BLOCK_BYTES``)
    bytes, at least one row each."""
    budget = BLOCK_BYTES if budget is None else budget
    if not shape:
        yield 0, 1
        return
    rows = shape[0]
    row_bytes = math.prod(shape[1:]) * itemsize
    step = max(1, budget // max(1, row_bytes))
    for start in range(0, rows, step):
        yield start, min(rows, start + step)


class SourceReader:
    """Reads row blocks of checkpoint tensors: ``rows`` with ``preadv`` into fresh buffers,
    ``cast_rows`` through a private mapping of one block at a time (never a whole-file mapping)."""

    def __init__(self, fds: Sequence[int], headers: Sequence[Any]) -> None:
        self._where: dict[str, tuple[int, int, Any]] = {}
        for fd, header in zip(fds, headers, strict=True):
            for entry in header.entries:
                self._where[entry.name] = (fd, header.data_offset, entry)
        self.bytes_read = 0

    def source(self, name: str) -> SourceTensor:
        entry = self._where[name][2]
        return SourceTensor(entry.name, entry.dtype, entry.shape)

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of tensor ``name`` (a 0-d tensor: the whole value)."""
        fd, base, entry = self._where[name]
        info = DTYPES[entry.dtype]
        shape = entry.shape
        row_numel = math.prod(shape[1:]) if shape else 1
        count = (stop - start) * row_numel if shape else 1
        buf = torch.empty(count * info.itemsize, dtype=torch.uint8)
        if count:
            _pread_into(fd, memoryview(buf.numpy()), base + entry.begin + start * row_numel * info.itemsize)
        self.bytes_read += buf.numel()
        out = buf.view(info.torch_dtype)
        return out.reshape(((stop - start), *shape[1:]) if shape else ())


    def cast_rows(self, name: str, start: int, stop: int, code: str) -> torch.Tensor:
        """Rows ``[start, stop)`` of ``name`` cast to the safetensors dtype ``code``: a new tensor.

        When a cast is needed it reads through a private mapping of just those rows (no copy
        into a fresh buffer: the cast itself is the copy), unmapped before returning, so the
        resident set stays one block; otherwise it is ``rows`` (a fresh buffer, already the
        target dtype). Same bytes either way: the cast is elementwise.
        """
        fd, base, entry = self._where[name]
        info = DTYPES[entry.dtype]
        target = DTYPES[code].torch_dtype
        shape = entry.shape
        row_numel = math.prod(shape[1:]) if shape else 1
        count = (stop - start) * row_numel if shape else 1
        if info.torch_dtype == target or not count:
            return cast_block(self.rows(name, start, stop), code)
        begin = base + entry.begin + start * row_numel * info.itemsize
        nbytes = count * info.itemsize
        aligned = begin - begin % mmap.ALLOCATIONGRANULARITY
        # MAP_PRIVATE + PROT_WRITE only so torch accepts the buffer as writable; nothing writes
        # to it, and a private mapping could never write through to the checkpoint anyway.
        mapped = mmap.mmap(fd, nbytes + begin - aligned, flags=mmap.MAP_PRIVATE,
                           prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=aligned)
        try:
            view = torch.frombuffer(mapped, dtype=torch.uint8, count=nbytes, offset=begin - aligned)
            out = view.view(info.torch_dtype).reshape(((stop - start), *shape[1:]) if shape else ()).to(target)
            del view
        finally:
            with contextlib.suppress(BufferError):  # a view still alive: the GC unmaps it later
                mapped.close()
        self.bytes_read += nbytes
        return out


class TensorSink:
    """Writes output blocks at their placement in a staging payload file.

    After each block it starts the block's writeback (``start_writeback``: the disk works while
    the next block is computed, so the daemon's ``fsync`` at commit is short) and hands the
    block to ``on_write(name, byte_offset, bytes)`` (the producer's digests, ``digests.py``).
    """

    def __init__(self, placements: Mapping[str, tuple[int, int, int]],
                 on_write: Callable[[str, int, memoryview], None] | None = None) -> None:
        self._placements = placements  # name -> (fd, absolute offset, nbytes)
        self._on_write = on_write
        self.bytes_written = 0

    def write(self, name: str, byte_offset: int, tensor: torch.Tensor) -> None:
        fd, offset, nbytes = self._placements[name]
        flat = tensor.contiguous().reshape(-1)
        if flat.numel() == 0:
            return
        data = memoryview(flat.view(torch.uint8).numpy()).cast("B")
        if byte_offset + data.nbytes > nbytes:
            raise InvalidRequest(f"producer wrote past tensor {name!r}", details={"tensor": name})
        block, block_offset = data, byte_offset
        while data:
            written = os.pwrite(fd, data, offset + byte_offset)
            if written <= 0:
                raise OSError("short write to staging")
            data = data[written:]
            byte_offset += written
            self.bytes_written += written
        start_writeback(fd, offset + block_offset, block.nbytes)
        if self._on_write is not None:
            self._on_write(name, block_offset, block)


def _pread_into(fd: int, view: memoryview, offset: int) -> None:
    while view:
        got = os.preadv(fd, [view], offset)
        if got <= 0:
            raise OSError("checkpoint file ended early")
        view = view[got:]
        offset += got


class Producer(ABC):
    """A deterministic transform; subclasses set ``name``/``version`` and implement the rest."""

    name: ClassVar[str]
    version: ClassVar[str]
    representation_name: ClassVar[str] = "final-layout"
    tp_size: int = 1

    @classmethod
    @abstractmethod
    def from_options(cls, options: Mapping[str, Any]) -> Producer: ...

    @abstractmethod
    def options(self) -> dict[str, Any]:
        """Plain JSON options that rebuild this producer (``from_options``) in the worker."""

    @abstractmethod
    def policy(self) -> dict[str, Any]:
        """Everything that changes the output bytes (goes into the identity)."""

    @abstractmethod
    def target_dtype(self) -> str:
        """The representation's dtype name (e.g. ``bfloat16``)."""

    @abstractmethod
    def plan(self, sources: Sequence[SourceTensor], rank: int) -> list[OutputTensor]: ...

    @abstractmethod
    def produce(self, output: OutputTensor, reader: SourceReader, sink: TensorSink, rank: int) -> None: ...

    def layout(self, rank: int) -> RuntimeLayout:
        return RuntimeLayout("dense", 1, 0)

    def fingerprint(self) -> str:
        document = {"name": self.name, "version": self.version, "policy": self.policy()}
        return hashlib.sha256(canonical_json(document)).hexdigest()

    def identity(self, source: SourceIdentity, rank: int = 0, component: str = "transformer") -> ArtifactIdentity:
        return ArtifactIdentity(
            schema_version=1,
            source=source,
            component=ComponentIdentity(component, "diffusion-transformer"),
            representation=WeightRepresentation(self.representation_name, self.target_dtype(),
                                                 canonical_json(self.policy())),
            layout=self.layout(rank),
            producer=ProducerIdentity(f"hwr.{self.name}", self.version, self.fingerprint(),
                                      MANIFEST_SCHEMA, RESTORER_SCHEMA),
        )


def cast_block(block: torch.Tensor, code: str) -> torch.Tensor:
    """Elementwise cast (round to nearest even, torch's CPU rule) to a safetensors dtype code."""
    target = DTYPES[code].torch_dtype
    return block if block.dtype == target else block.to(target)
