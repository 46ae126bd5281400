"""``cast``: floating tensors to bf16 or fp16, keeping the tensors a policy declares fp32.

Policy: ``dtype`` (``bf16``/``fp16``) and ``keep_fp32`` (fnmatch patterns over tensor names;
matching floating tensors are stored as fp32). Integer and bool tensors are copied unchanged.
Bytes equal ``tensor.to(dtype)`` done in one go with torch (the cast is elementwise, so doing it
in row blocks changes nothing).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from hwr.client.errors import InvalidRequest
from hwr.client.safetensors_header import DTYPES
from hwr.daemon.producers.base import FLOAT_CODES, ArtifactProducer, OutputTensor, SourceTensor, dtype_code, row_blocks

if TYPE_CHECKING:
    from hwr.daemon.producers.blocks import SourceReader, TensorSink

__all__ = ["CastProducer", "matches_any", "stream_tensor"]


def matches_any(name: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def check_patterns(patterns: object, field: str) -> tuple[str, ...]:
    if not isinstance(patterns, (list, tuple)) or not all(isinstance(p, str) and p and len(p) <= 256 for p in patterns):
        raise InvalidRequest(f"{field} must be a list of non-empty patterns", details={"field": field})
    if len(patterns) > 256:
        raise InvalidRequest(f"too many {field} patterns", details={"field": field})
    return tuple(sorted(set(patterns)))


def stream_tensor(output: OutputTensor, reader: SourceReader, sink: TensorSink, source: SourceTensor) -> None:
    """Copy ``source`` into ``output`` block by block, casting to the output dtype."""
    out_item = DTYPES[output.dtype].itemsize
    row = 1
    for dim in source.shape[1:]:
        row *= dim
    for start, stop in row_blocks(source.shape, DTYPES[source.dtype].itemsize):
        block = reader.cast_rows(source.name, start, stop, output.dtype)
        sink.write(output.name, start * row * out_item, block)


class CastProducer(ArtifactProducer):
    name = "cast"
    version = "1"

    def __init__(self, dtype: str = "bf16", keep_fp32: Sequence[str] = ()) -> None:
        self.dtype = dtype_code(dtype)
        if self.dtype not in ("BF16", "F16"):
            raise InvalidRequest("cast targets bf16 or fp16", details={"field": "dtype"})
        self.keep_fp32 = check_patterns(list(keep_fp32), "keep_fp32")

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> CastProducer:
        return cls(options.get("dtype") or "bf16", options.get("keep_fp32") or ())

    def options(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "keep_fp32": list(self.keep_fp32)}

    def policy(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "keep_fp32": list(self.keep_fp32)}

    def target_dtype(self) -> str:
        return DTYPES[self.dtype].attr  # torch's name without "torch.", read without importing torch

    def output_dtype(self, source: SourceTensor) -> str:
        if source.dtype not in FLOAT_CODES:
            return source.dtype
        return "F32" if matches_any(source.name, self.keep_fp32) else self.dtype

    def plan(self, sources: Sequence[SourceTensor], rank: int = 0) -> list[OutputTensor]:
        return [OutputTensor(s.name, self.output_dtype(s), s.shape, s.name, "cast")
                for s in sorted(sources, key=lambda s: s.name)]

    def produce(self, output: OutputTensor, reader: SourceReader, sink: TensorSink, rank: int = 0) -> None:
        stream_tensor(output, reader, sink, reader.source(output.source))
