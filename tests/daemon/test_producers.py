"""Producers in-process (chunked output equals whole-tensor torch) and the runner's failure paths."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import save_file

from hwr.client.errors import InvalidRequest, ProducerFailed, ProducerTimeout
from hwr.client.safetensors_header import read_header
from hwr.daemon.producers import base, make_producer
from hwr.daemon.producers.base import SourceTensor, row_blocks
from hwr.daemon.producers.blocks import SourceReader, TensorSink
from hwr.daemon.producers.runner import run_job
from hwr.daemon.producers.tp_slice import parse_plan


@given(st.lists(st.integers(0, 9), min_size=0, max_size=3), st.integers(1, 64))
def test_row_blocks_tile_dim_zero(shape: list[int], budget: int) -> None:
    blocks = list(row_blocks(shape, 4, budget))
    if not shape:
        assert blocks == [(0, 1)]
        return
    assert [b for b in blocks if b[0] >= b[1]] == []
    assert [r for s, e in blocks for r in range(s, e)] == list(range(shape[0]))


def run_in_process(tmp: Path, tensors: dict[str, torch.Tensor], name: str, options: dict, rank: int = 0,
                   monkeypatch: pytest.MonkeyPatch | None = None) -> dict[str, torch.Tensor]:
    save_file(tensors, tmp / "src.safetensors")
    fd = os.open(tmp / "src.safetensors", os.O_RDONLY)
    header = read_header(fd, require_alignment=False)
    producer = make_producer(name, options)
    outputs = producer.plan([SourceTensor(e.name, e.dtype, e.shape) for e in header.entries], rank)
    buffers = {o.name: bytearray(o.nbytes) for o in outputs}
    out_fd = os.open(tmp / "out.bin", os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(out_fd, sum(o.nbytes for o in outputs))
    placements, cursor = {}, 0
    for o in outputs:
        placements[o.name] = (out_fd, cursor, o.nbytes)
        cursor += o.nbytes
    sink = TensorSink(placements)
    reader = SourceReader([fd], [header])
    for o in outputs:
        producer.produce(o, reader, sink, rank)
    result = {}
    for o in outputs:
        _fd, offset, nbytes = placements[o.name]
        buffers[o.name][:] = os.pread(out_fd, nbytes, offset)
        from hwr.client.safetensors_header import DTYPES
        result[o.name] = torch.frombuffer(buffers[o.name], dtype=DTYPES[o.dtype].torch_dtype).reshape(o.shape) \
            if nbytes else torch.empty(o.shape)
    os.close(fd)
    os.close(out_fd)
    return result


def test_chunked_cast_equals_whole_tensor_torch(short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(base, "BLOCK_BYTES", 100)  # many blocks per tensor
    g = torch.Generator().manual_seed(1)
    tensors = {"w": torch.randn(37, 11, generator=g), "ln.weight": torch.randn(11, generator=g),
               "i": torch.arange(6), "s": torch.tensor(3.5)}
    out = run_in_process(short_tmp, tensors, "cast", {"dtype": "fp16", "keep_fp32": ["ln.*"]})
    assert torch.equal(out["w"], tensors["w"].to(torch.float16))
    assert torch.equal(out["ln.weight"], tensors["ln.weight"]) and torch.equal(out["i"], tensors["i"])
    assert torch.equal(out["s"], tensors["s"].half())


def test_chunked_tp_row_split_and_fp8_in_process(short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(base, "BLOCK_BYTES", 64)
    w = torch.randn(9, 8, generator=torch.Generator().manual_seed(2))
    plan = {"rules": [{"pattern": "w", "split": "row"}]}
    parts = [run_in_process(short_tmp, {"w": w}, "tp-slice", {"tp_size": 4, "plan": plan}, rank)["w"]
             for rank in range(4)]
    assert torch.equal(torch.cat(parts, 1), w)
    out = run_in_process(short_tmp, {"x.weight": w}, "fp8-per-tensor", {})
    scale = w.abs().max() / 448.0
    assert torch.equal(out["x.weight_scale"], scale)
    assert torch.equal(out["x.weight"].view(torch.uint8),
                       (w / scale).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8))


def test_invalid_plans_and_options_are_invalid_requests() -> None:
    for bad in (b"not = [valid", b'{"rules": [{"pattern": "x"}]}', b'{"default": "diagonal"}', b'{"extra": 1}'):
        with pytest.raises(InvalidRequest):
            parse_plan(bad)
    assert parse_plan(b'default = "column"')["default"] == "column"
    with pytest.raises(InvalidRequest):
        make_producer("nope", {})
    with pytest.raises(InvalidRequest):
        make_producer("cast", {"dtype": "int4"})
    producer = make_producer("tp-slice", {"tp_size": 3, "plan": {"default": "column"}})
    with pytest.raises(InvalidRequest):
        producer.plan([SourceTensor("w", "F32", (4, 4))], 0)  # 4 rows do not split in 3


def test_runner_reports_worker_errors_and_kills_on_timeout(short_tmp: Path) -> None:
    with pytest.raises(InvalidRequest):  # the worker's typed error comes back typed
        asyncio.run(run_job({"producer": "cast", "options": {"dtype": "int4"}, "sources": [], "outputs": {}},
                            [], timeout=60))
    with pytest.raises(ProducerFailed):
        asyncio.run(run_job({"producer": "cast", "options": {}}, [], timeout=60))  # KeyError in the worker
    with pytest.raises(ProducerTimeout):
        asyncio.run(run_job({}, [], timeout=0.05))


@pytest.mark.parametrize(("name", "options"), [
    ("cast", {"dtype": "bf16"}), ("cast", {"dtype": "fp16", "keep_fp32": ["*norm*"]}),
    ("cast", {"dtype": "float16"}), ("fp8-per-tensor", {}),
    ("tp-slice", {"tp_size": 2, "plan": {"rules": [{"pattern": "w", "split": "row"}]}}),
    ("tp-slice", {"tp_size": 2, "dtype": "fp16"}),
])
def test_options_rebuild_the_same_producer(name: str, options: dict) -> None:
    """The worker process rebuilds the producer from ``options()`` (codes such as "F16", not
    the user's "fp16"): that must give the same producer. Before the fix every fp16 build
    failed there with "unsupported dtype 'F16' (bf16, fp16 or fp32)"."""
    producer = make_producer(name, options)
    again = make_producer(name, producer.options())
    assert again.options() == producer.options() and again.policy() == producer.policy()


@pytest.mark.parametrize(("name", "options"), [
    ("cast", {"dtype": "bf16"}), ("cast", {"dtype": "fp16"}),
    ("tp-slice", {"tp_size": 2, "dtype": "bf16"}), ("tp-slice", {"tp_size": 2, "dtype": "fp32"}),
])
def test_the_representation_dtype_is_torchs_name_of_the_target(name: str, options: dict) -> None:
    """The identity's representation dtype (part of the key) is torch's name of the target dtype,
    read from the static dtype table so that the daemon, which plans and names builds, never
    imports torch: the same names torch gives, so keys built before and after stay equal."""
    producer = make_producer(name, options)
    assert producer.target_dtype() == str(getattr(torch, producer.target_dtype())).removeprefix("torch.")
    code = producer.options()["dtype"]
    assert producer.target_dtype() == str(base.DTYPES[code].torch_dtype).removeprefix("torch.")
