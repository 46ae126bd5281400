"""Header-vs-manifest binding and zero-copy views."""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
from pathlib import Path

import pytest
import torch

from hwr.client.artifact import tensor_views, validate_payload_header
from hwr.client.errors import ManifestCorrupt
from hwr.client.identity import ArtifactIdentity
from hwr.client.manifest import FileRecord, Manifest, TensorRecord
from hwr.client.safetensors_header import contiguous_stride, plan_file, read_header

NAME = "model-00001.safetensors"


def _artifact(tmp_path: Path):
    tensors = {
        "w": torch.randn(4, 6).to(torch.bfloat16),
        "b": torch.arange(5, dtype=torch.int32),
        "z": torch.zeros(0, 3),
    }
    head, entries, size = plan_file(
        [
            (n, {torch.bfloat16: "BF16", torch.int32: "I32", torch.float32: "F32"}[t.dtype], tuple(t.shape))
            for n, t in tensors.items()
        ]
    )
    data = bytearray(head + bytes(size - len(head)))
    records = []
    for e in entries:
        raw = tensors[e.name].reshape(-1).view(torch.uint8).numpy().tobytes()
        data[len(head) + e.begin : len(head) + e.end] = raw
        t = tensors[e.name]
        records.append(
            TensorRecord(
                e.name,
                "parameter",
                "weight",
                file=NAME,
                storage_key=e.name,
                shape=tuple(t.shape),
                dtype=str(t.dtype),
                stride=contiguous_stride(t.shape),
                nbytes=e.nbytes,
                sha256=hashlib.sha256(raw).hexdigest(),
            )
        )
    path = tmp_path / NAME
    path.write_bytes(bytes(data))
    files = [FileRecord(name=NAME, size=size, sha256=hashlib.sha256(data).hexdigest())]
    return tensors, path, Manifest.build(ArtifactIdentity.simple("m"), records, files)


def _mapped_range(path: Path) -> tuple[int, int]:
    """[start, end) of this process's one mapping of ``path``, from /proc/self/maps (by inode)."""
    inode = os.stat(path).st_ino
    found = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and int(fields[4]) == inode and fields[5] == str(path):
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                found.append((lo, hi))
    assert len(found) == 1, f"expected one mapping of {path}: {found}"
    return found[0]


def test_views_alias_the_mapping(tmp_path: Path) -> None:
    """Each view's bytes lie inside the file's mapping (found in /proc/self/maps, not through
    the code under test), at the offset the file's own header gives (read here with struct +
    json), so they are the mapped pages themselves, not copies."""
    tensors, path, manifest = _artifact(tmp_path)
    raw = path.read_bytes()
    (header_len,) = struct.unpack("<Q", raw[:8])
    offsets = {k: v["data_offsets"] for k, v in json.loads(raw[8 : 8 + header_len]).items() if k != "__metadata__"}
    header = read_header(path)
    pairs = validate_payload_header(header, manifest, manifest.files[0])
    fd = os.open(path, os.O_RDONLY)
    with mmap.mmap(fd, 0, prot=mmap.PROT_READ) as mapped:
        lo, hi = _mapped_range(path)
        views = tensor_views(mapped, header, [r for r, _ in pairs])
        for name, t in tensors.items():
            view = views[name]
            assert torch.equal(view, t) and view.stride() == t.stride()
            if view.numel() == 0:
                continue  # no bytes to alias
            begin, end = offsets[name]
            assert view.data_ptr() == lo + 8 + header_len + begin, f"{name} is not at its offset in the mapping"
            assert view.data_ptr() + view.numel() * view.element_size() == lo + 8 + header_len + end <= hi
        del views, view
    os.close(fd)


def test_mismatches_are_corrupt(tmp_path: Path) -> None:
    _, path, manifest = _artifact(tmp_path)
    header = read_header(path)
    wrong_size = FileRecord(name=NAME, size=manifest.files[0].size + 1, sha256=manifest.files[0].sha256)
    with pytest.raises(ManifestCorrupt):
        validate_payload_header(header, manifest, wrong_size)
    with pytest.raises(ManifestCorrupt):
        tensor_views(b"\0" * 10, header, manifest.tensors)
    other, *_ = plan_file([("w", "F32", (4, 6))])
    with pytest.raises(ManifestCorrupt):
        validate_payload_header(read_header_bytes(tmp_path, other), manifest, manifest.files[0])


def read_header_bytes(tmp_path: Path, head: bytes):
    p = tmp_path / "other.safetensors"
    p.write_bytes(head + bytes(96))
    return read_header(p)
