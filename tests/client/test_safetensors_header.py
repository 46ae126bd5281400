"""The strict safetensors header parser and the deterministic planner, against safetensors itself."""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import pytest
import safetensors
import safetensors.torch
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hwr.client.errors import ManifestCorrupt
from hwr.client.safetensors_header import DTYPES, parse_header, plan_file, read_header

# Dtypes every safetensors reader we test against supports.
_CODES = sorted(c for c in DTYPES if c not in ("U16", "U32", "U64"))


def _raw(document: dict, data_size: int, *, pad: bool = True) -> tuple[bytes, int]:
    text = json.dumps(document).encode()
    if pad:
        text += b" " * (-(8 + len(text)) % 8)
    head = struct.pack("<Q", len(text)) + text
    return head, len(head) + data_size


def test_plan_file_loads_with_safetensors(tmp_path: Path) -> None:
    specs = [("w", "BF16", (3, 5)), ("b", "F32", (7,)), ("flag", "BOOL", ()), ("empty", "U8", (0, 4))]
    head, entries, size = plan_file(specs)
    assert [e.name for e in entries] == sorted(n for n, _, _ in specs)
    assert len(head) % 8 == 0
    assert plan_file(list(reversed(specs))) == (head, entries, size)
    path = tmp_path / "x.safetensors"
    path.write_bytes(head + os.urandom(size - len(head)))
    loaded = safetensors.torch.load_file(path)
    assert {k: (v.dtype, tuple(v.shape)) for k, v in loaded.items()} == {
        "w": (torch.bfloat16, (3, 5)), "b": (torch.float32, (7,)),
        "flag": (torch.bool, ()), "empty": (torch.uint8, (0, 4)),
    }  # fmt: skip
    header = read_header(path)
    assert header.entries == entries and header.file_size == size
    assert header.metadata == {"format": "pt", "host_weight_runtime": "1"}


def test_reads_files_written_by_safetensors(tmp_path: Path) -> None:
    path = tmp_path / "st.safetensors"
    safetensors.torch.save_file({"a": torch.zeros(3, dtype=torch.float16), "b": torch.ones(2, 2)}, path)
    header = read_header(path)
    assert [(e.name, e.dtype, e.shape) for e in header.entries] == [("a", "F16", (3,)), ("b", "F32", (2, 2))]


@pytest.mark.parametrize(
    ("document", "data_size", "check"),
    [
        ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, 8, "bounds"),  # past EOF
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
          "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, 12, "overlap"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, 12, "gap"),
        ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, 8, "size"),  # shape/nbytes
        ({"a": {"dtype": "X9", "shape": [2], "data_offsets": [0, 8]}}, 8, "dtype"),
        ({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, 8, "shape"),
        ({"a": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}}, 4, "shape"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, 8, "offsets"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, 12, "trailing"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8], "x": 1}}, 8, "fields"),
        ({"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
          "b": {"dtype": "F32", "shape": [1], "data_offsets": [1, 5]}}, 5, "alignment"),
        ({"__metadata__": {"k": 1}}, 0, "metadata"),
        ([1, 2], 0, "json"),
    ],
)  # fmt: skip
def test_hostile_headers_are_rejected(document: object, data_size: int, check: str) -> None:
    head, size = _raw(document, data_size)  # type: ignore[arg-type]
    with pytest.raises(ManifestCorrupt) as info:
        parse_header(head, size)
    assert info.value.details["check"] == check


def test_huge_header_length_and_truncation() -> None:
    with pytest.raises(ManifestCorrupt, match="exceeds"):
        parse_header(struct.pack("<Q", 2**63) + b"{}", 1 << 40)
    with pytest.raises(ManifestCorrupt, match="past the end"):
        parse_header(struct.pack("<Q", 4096) + b"{}", 100)
    with pytest.raises(ManifestCorrupt):
        parse_header(b"\x01\x02", 2)


@pytest.mark.parametrize("text", [b'{"a":1,"a":2}', b"{NaN}", b'{"__metadata__":{"x":NaN}}', b"\xff\xfe{}",
                                  b" {}", b"[" * 5000 + b"]" * 5000])  # fmt: skip
def test_malformed_json_is_corrupt(text: bytes) -> None:
    head = struct.pack("<Q", len(text)) + text
    with pytest.raises(ManifestCorrupt):
        parse_header(head, len(head), require_alignment=False)


def test_read_header_of_truncated_file(tmp_path: Path) -> None:
    head, _, _size = plan_file([("a", "F32", (4,))])
    path = tmp_path / "t.safetensors"
    path.write_bytes(head + b"\0" * 8)  # 8 of 16 data bytes
    with pytest.raises(ManifestCorrupt):
        read_header(path)


_shapes = st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple)
_specs = st.dictionaries(
    st.text("abcxyz._", min_size=1, max_size=6), st.tuples(st.sampled_from(_CODES), _shapes), min_size=1, max_size=6
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(specs=_specs)
def test_random_layouts_round_trip_through_safetensors(tmp_path: Path, specs: dict) -> None:
    plan = [(name, code, shape) for name, (code, shape) in specs.items()]
    head, entries, size = plan_file(plan)
    tensors = {}
    data = bytearray(size - len(head))
    for entry in entries:
        info = DTYPES[entry.dtype]
        raw = os.urandom(entry.nbytes)
        if info.torch_dtype == torch.bool:
            raw = bytes(b & 1 for b in raw)
        data[entry.begin : entry.end] = raw
        tensors[entry.name] = raw
    path = tmp_path / "r.safetensors"
    path.write_bytes(head + bytes(data))
    assert read_header(path).entries == entries
    with safetensors.safe_open(path, framework="pt") as f:
        for entry in entries:
            t = f.get_tensor(entry.name)
            assert tuple(t.shape) == entry.shape and t.dtype == DTYPES[entry.dtype].torch_dtype
            if math.prod(entry.shape):
                assert t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() == tensors[entry.name]


_VALID_HEAD, _, _VALID_SIZE = plan_file([("a", "F32", (2, 3)), ("b", "BF16", (5,)), ("c", "I8", (3,))])


@settings(max_examples=400, deadline=None)
@given(
    flips=st.lists(st.tuples(st.integers(0, len(_VALID_HEAD) - 1), st.integers(0, 255)), max_size=4),
    cut=st.integers(0, len(_VALID_HEAD)),
    size_delta=st.integers(-40, 40),
)
def test_mutated_headers_never_raise_anything_else(flips: list, cut: int, size_delta: int) -> None:
    head = bytearray(_VALID_HEAD)
    for index, value in flips:
        head[index] = value
    head = head[: max(cut, 8)] if cut < len(head) // 2 else head
    try:
        header = parse_header(bytes(head), _VALID_SIZE + size_delta)
    except ManifestCorrupt:
        return
    # Accepted: then it is self-consistent and safetensors' own loader agrees with it.
    assert header.file_size == _VALID_SIZE + size_delta
    assert header == parse_header(bytes(head), _VALID_SIZE + size_delta)
    blob = bytes(head[: header.data_offset]) + b"\0" * (header.file_size - header.data_offset)
    loaded = safetensors.torch.load(blob)
    assert {e.name: e.shape for e in header.entries} == {k: tuple(v.shape) for k, v in loaded.items()}
