"""``FileLease``: a local safetensors file as a lease-shaped host source (real files, real mmap)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from hwr.client.errors import LeaseClosed, ManifestCorrupt
from hwr.dlo_backend.file_lease import FileLease


def test_views_lie_in_the_mapping_and_match_the_file(tmp_path: Path) -> None:
    a = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    b = torch.arange(6, dtype=torch.bfloat16)
    path = tmp_path / "w.safetensors"
    save_file({"a": a.t().contiguous(), "b": b}, str(path))
    lease = FileLease(path, key="k", transposed=["a"])
    try:
        assert torch.equal(lease.tensors["a"], a) and lease.tensors["a"].stride() == (1, 3)
        assert torch.equal(lease.tensors["b"], b)
        (region,) = lease.mapped_regions
        for tensor in lease.tensors.values():
            assert lease.contains(tensor)
            assert region.address <= tensor.data_ptr() < region.address + region.length
    finally:
        lease.close()


def test_close_is_idempotent_and_forgets_the_regions(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    save_file({"w": torch.ones(4)}, str(path))
    lease = FileLease(path)
    lease.close()
    lease.close()
    assert lease.closed and lease.mapped_regions == ()
    with pytest.raises(LeaseClosed):
        _ = lease.tensors


def test_a_malformed_file_is_refused_before_any_view(tmp_path: Path) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes((1 << 40).to_bytes(8, "little") + b"{}")
    with pytest.raises(ManifestCorrupt):
        FileLease(path)
