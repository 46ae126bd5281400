"""Header-vs-manifest binding and zero-copy views."""

from __future__ import annotations

import hashlib
import mmap
import os
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


def test_views_alias_the_mapping(tmp_path: Path) -> None:
    tensors, path, manifest = _artifact(tmp_path)
    header = read_header(path)
    pairs = validate_payload_header(header, manifest, manifest.files[0])
    fd = os.open(path, os.O_RDONLY)
    with mmap.mmap(fd, 0, prot=mmap.PROT_READ) as mapped:
        views = tensor_views(mapped, header, [r for r, _ in pairs])
        for name, t in tensors.items():
            assert torch.equal(views[name], t) and views[name].stride() == t.stride()
        del views
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
