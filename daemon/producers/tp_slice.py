"""``tp-slice``: per-tensor column/row split for one TP rank, from a declarative plan file.

Plan file (JSON or TOML; the first matching rule wins, ``default`` applies otherwise)::

    default = "replicate"              # or "column" / "row"
    [[rules]]
    pattern = "*.attn.to_q.weight"     # fnmatch over tensor names
    split = "column"                   # column: dim 0 (a Linear's output features, its bias too)
    [[rules]]
    pattern = "*.attn.to_out.weight"
    split = "row"                      # row: dim 1 (a Linear's input features)

Rank ``r`` of ``n`` gets the ``r``-th of ``n`` equal parts along the split dimension, so the
ranks' slices concatenated along it give back the original tensor. A split dimension that ``n``
does not divide, a ``row`` split of a tensor with fewer than two dimensions, or a malformed plan
raise ``InvalidRequest`` before anything is built. Optional ``dtype`` casts floating tensors too.
The plan goes into the identity's layout metadata, so another plan is another artifact.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from hwr.client.errors import InvalidRequest
from hwr.client.identity import RuntimeLayout, canonical_json, find_lone_surrogate
from hwr.client.safetensors_header import DTYPES
from hwr.daemon.producers.base import FLOAT_CODES, ArtifactProducer, OutputTensor, SourceTensor, dtype_code, row_blocks
from hwr.daemon.producers.cast import matches_any, stream_tensor

if TYPE_CHECKING:
    from hwr.daemon.producers.blocks import SourceReader, TensorSink

__all__ = ["TpSliceProducer", "parse_plan"]

SPLITS = ("column", "row", "replicate")
MAX_TP = 1024


def parse_plan(data: bytes | str | Mapping[str, Any]) -> dict[str, Any]:
    """Parse and normalise a plan (JSON or TOML bytes, or an already decoded mapping)."""
    if isinstance(data, Mapping):
        raw: Any = dict(data)
    else:
        try:
            text = data.decode("utf-8", "strict") if isinstance(data, bytes) else data
        except UnicodeDecodeError:
            raise InvalidRequest("the TP plan is not UTF-8 text", details={"field": "tp_plan"}) from None
        if len(text) > 1 << 20:
            raise InvalidRequest("the TP plan is larger than 1 MiB", details={"field": "tp_plan"})
        try:
            raw = json.loads(text) if text.lstrip().startswith("{") else tomllib.loads(text)
        except (ValueError, RecursionError, tomllib.TOMLDecodeError) as exc:
            raise InvalidRequest(f"the TP plan is neither JSON nor TOML: {exc}", details={"field": "tp_plan"}) from None
        if find_lone_surrogate(raw) is not None:
            raise InvalidRequest("the TP plan holds a lone surrogate (not Unicode text)", details={"field": "tp_plan"})
    if not isinstance(raw, dict) or set(raw) - {"default", "rules"}:
        raise InvalidRequest("a TP plan has only 'default' and 'rules'", details={"field": "tp_plan"})
    default = raw.get("default", "replicate")
    rules = raw.get("rules", [])
    if default not in SPLITS or not isinstance(rules, list) or len(rules) > 4096:
        raise InvalidRequest("TP plan: default must be column, row or replicate; rules a list",
                             details={"field": "tp_plan"})
    out = []
    for rule in rules:
        if (not isinstance(rule, dict) or set(rule) != {"pattern", "split"} or rule["split"] not in SPLITS
                or not isinstance(rule["pattern"], str) or not rule["pattern"]):
            raise InvalidRequest("TP plan: each rule has exactly a non-empty 'pattern' and a 'split'",
                                 details={"field": "tp_plan"})
        out.append({"pattern": rule["pattern"], "split": rule["split"]})
    return {"default": default, "rules": out}


class TpSliceProducer(ArtifactProducer):
    name = "tp-slice"
    version = "1"
    representation_name = "tp-slice"

    def __init__(self, tp_size: int, plan: Mapping[str, Any] | bytes | str, dtype: str | None = None) -> None:
        if not isinstance(tp_size, int) or not 1 <= tp_size <= MAX_TP:
            raise InvalidRequest("tp_size must be between 1 and 1024", details={"field": "tp_size"})
        self.tp_size = tp_size
        self.plan_doc = parse_plan(plan)
        self.dtype = dtype_code(dtype) if dtype else None

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> TpSliceProducer:
        return cls(int(options.get("tp_size") or 0), options.get("plan") or {}, options.get("dtype"))

    def options(self) -> dict[str, Any]:
        return {"tp_size": self.tp_size, "plan": self.plan_doc, "dtype": self.dtype}

    def policy(self) -> dict[str, Any]:
        return {"dtype": self.dtype or "source", "plan": self.plan_doc}

    def target_dtype(self) -> str:
        return DTYPES[self.dtype].attr if self.dtype else "source"

    def layout(self, rank: int) -> RuntimeLayout:
        return RuntimeLayout("tp-slice", self.tp_size, rank, metadata=canonical_json(self.plan_doc))

    def split_of(self, name: str) -> str:
        for rule in self.plan_doc["rules"]:
            if matches_any(name, (rule["pattern"],)):
                return rule["split"]
        return self.plan_doc["default"]

    def _out_dtype(self, source: SourceTensor) -> str:
        return self.dtype if self.dtype and source.dtype in FLOAT_CODES else source.dtype

    def plan(self, sources: Sequence[SourceTensor], rank: int) -> list[OutputTensor]:
        if not 0 <= rank < self.tp_size:
            raise InvalidRequest("tp_rank out of range", details={"field": "tp_rank"})
        outputs = []
        for s in sorted(sources, key=lambda s: s.name):
            split = self.split_of(s.name)
            shape = list(s.shape)
            if split != "replicate":
                dim = 0 if split == "column" else 1
                if len(shape) <= dim:
                    raise InvalidRequest(f"tensor {s.name!r} has no dim {dim} for a {split} split",
                                         details={"tensor": s.name[:200]})
                if shape[dim] % self.tp_size:
                    raise InvalidRequest(f"tensor {s.name!r}: dim {dim} ({shape[dim]}) is not divisible by "
                                         f"tp_size {self.tp_size}", details={"tensor": s.name[:200]})
                shape[dim] //= self.tp_size
            outputs.append(OutputTensor(s.name, self._out_dtype(s), tuple(shape), s.name, split))
        return outputs

    def produce(self, output: OutputTensor, reader: SourceReader, sink: TensorSink, rank: int) -> None:
        # Here, not at the top: the daemon plans with this class and never loads torch (base.py).
        from hwr.daemon.producers.blocks import cast_block

        source = reader.source(output.source)
        if output.op == "replicate":
            stream_tensor(output, reader, sink, source)
            return
        out_item = DTYPES[output.dtype].itemsize
        row_numel = 1
        for dim in output.shape[1:]:
            row_numel *= dim
        if output.op == "column":
            first = rank * output.shape[0]
            for start, stop in row_blocks(output.shape, DTYPES[source.dtype].itemsize):
                block = reader.cast_rows(source.name, first + start, first + stop, output.dtype)
                sink.write(output.name, start * row_numel * out_item, block)
            return
        width = output.shape[1]
        for start, stop in row_blocks(source.shape, DTYPES[source.dtype].itemsize):
            block = reader.rows(source.name, start, stop)[:, rank * width:(rank + 1) * width]
            sink.write(output.name, start * row_numel * out_item, cast_block(block.contiguous(), output.dtype))
