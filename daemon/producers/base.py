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

Two sides, two processes. The daemon builds producers to plan and name artifacts (``plan``,
``identity``) and never imports torch: this module and each producer's module import none. Only
``produce`` touches tensors; it runs in the worker process, with the readers and writers of
``hwr.daemon.producers.blocks`` (which import torch), and a producer that needs torch itself
imports it inside ``produce``. ``tests/daemon/test_rooms.py`` holds the daemon side to that.
"""

from __future__ import annotations

import hashlib
import math
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

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

if TYPE_CHECKING:  # the worker's side: blocks.py imports torch
    from hwr.daemon.producers.blocks import SourceReader, TensorSink

__all__ = [
    "BLOCK_BYTES",
    "DTYPE_ALIASES",
    "ArtifactProducer",
    "OutputTensor",
    "SourceTensor",
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


class ArtifactProducer(ABC):
    """A deterministic transform; subclasses set ``name``/``version`` and implement the rest.
    Daemon-side (prewarm); not ``hwr.client.resolver.Producer``, a client's in-process producer."""

    name: ClassVar[str]
    version: ClassVar[str]
    representation_name: ClassVar[str] = "final-layout"
    tp_size: int = 1

    @classmethod
    @abstractmethod
    def from_options(cls, options: Mapping[str, Any]) -> ArtifactProducer: ...

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


