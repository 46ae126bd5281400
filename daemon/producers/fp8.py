"""``fp8-per-tensor``: e4m3 weights with one fp32 scale per linear weight.

For each floating tensor matching ``linear`` (fnmatch patterns, default ``*.weight``) with
exactly two dimensions: ``scale = amax(|w|) / 448`` as fp32 (1.0 for an all-zero tensor),
``q = clamp(w.float() / scale, -448, 448).to(float8_e4m3fn)``; the artifact holds ``NAME`` (F8_E4M3)
and ``NAME_scale`` (F32, shape ``[]``, vLLM's name for a per-tensor weight scale). Dequantized,
``q.float() * scale`` is within ``max(|w| * 2**-4, scale * 2**-10)`` of ``w.float()`` (half a unit in
the last place of e4m3's 3 mantissa bits; the second term covers subnormals). Other floating
tensors are cast to ``dtype`` (default bf16); integer tensors are copied.

Two passes over each quantized weight (amax, then quantize), both in row blocks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from hwr.client.errors import InvalidRequest
from hwr.client.safetensors_header import DTYPES
from hwr.daemon.producers.base import FLOAT_CODES, ArtifactProducer, OutputTensor, SourceTensor, dtype_code, row_blocks
from hwr.daemon.producers.cast import check_patterns, matches_any, stream_tensor

if TYPE_CHECKING:
    import torch

    from hwr.daemon.producers.blocks import SourceReader, TensorSink

__all__ = ["E4M3_MAX", "SCALE_SUFFIX", "Fp8PerTensorProducer"]

E4M3_MAX = 448.0
SCALE_SUFFIX = "_scale"


class Fp8PerTensorProducer(ArtifactProducer):
    name = "fp8-per-tensor"
    version = "1"
    representation_name = "fp8-per-tensor"

    def __init__(self, dtype: str | None = None, linear: Sequence[str] = ("*.weight",)) -> None:
        self.dtype = dtype_code(dtype or "bf16")
        self.linear = check_patterns(list(linear), "linear")
        self._scales: dict[str, torch.Tensor] = {}

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> Fp8PerTensorProducer:
        return cls(options.get("dtype"), options.get("linear") or ("*.weight",))

    def options(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "linear": list(self.linear)}

    def policy(self) -> dict[str, Any]:
        return {"weights": "float8_e4m3fn", "scale": "per-tensor-fp32", "linear": list(self.linear),
                "other_dtype": self.dtype}

    def target_dtype(self) -> str:
        return "float8_e4m3fn"

    def quantized(self, source: SourceTensor) -> bool:
        return source.dtype in FLOAT_CODES and len(source.shape) == 2 and matches_any(source.name, self.linear)

    def plan(self, sources: Sequence[SourceTensor], rank: int = 0) -> list[OutputTensor]:
        outputs = []
        names = {s.name for s in sources}
        for s in sorted(sources, key=lambda s: s.name):
            if self.quantized(s):
                outputs.append(OutputTensor(s.name, "F8_E4M3", s.shape, s.name, "fp8"))
                scale_name = s.name + SCALE_SUFFIX
                if scale_name in names:
                    raise InvalidRequest(f"{scale_name!r} already exists in the checkpoint",
                                         details={"tensor": scale_name[:200]})
                outputs.append(OutputTensor(scale_name, "F32", (), s.name, "scale"))
            else:
                out = self.dtype if s.dtype in FLOAT_CODES else s.dtype
                outputs.append(OutputTensor(s.name, out, s.shape, s.name, "cast"))
        return sorted(outputs, key=lambda o: o.name)

    def scale_of(self, reader: SourceReader, source: SourceTensor) -> torch.Tensor:
        # torch here and in produce, not at the top: the daemon plans with this class and never
        # loads torch (base.py); the worker that calls these has imported it already.
        import torch

        cached = self._scales.get(source.name)
        if cached is None:
            amax = torch.zeros((), dtype=torch.float32)
            for start, stop in row_blocks(source.shape, DTYPES[source.dtype].itemsize):
                block = reader.rows(source.name, start, stop)
                if block.numel():
                    amax = torch.maximum(amax, block.float().abs().max())
            cached = torch.where(amax > 0, amax / E4M3_MAX, torch.ones((), dtype=torch.float32))
            self._scales[source.name] = cached
        return cached

    def produce(self, output: OutputTensor, reader: SourceReader, sink: TensorSink, rank: int = 0) -> None:
        source = reader.source(output.source)
        if output.op == "cast":
            stream_tensor(output, reader, sink, source)
            return
        scale = self.scale_of(reader, source)
        if output.op == "scale":
            sink.write(output.name, 0, scale.reshape(()))
            return
        import torch

        row = source.shape[1]
        for start, stop in row_blocks(source.shape, DTYPES[source.dtype].itemsize):
            block = reader.rows(source.name, start, stop)
            q = (block.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
            sink.write(output.name, start * row, q)
