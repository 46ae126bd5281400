"""Byte equality of a new revision's tensors with the base's (what decides reuse)."""

from __future__ import annotations

import torch

from hwr.client.revision_diff import same_bytes


def test_same_bytes_is_dtype_shape_and_bits() -> None:
    a = torch.arange(4096, dtype=torch.float32)
    assert same_bytes(a, a.clone())
    changed = a.clone()
    changed[-1] += 1  # the last element only: memcmp reads to the end
    assert not same_bytes(a, changed)
    assert not same_bytes(a, a.to(torch.int32).view(torch.float32))  # other bits
    assert not same_bytes(a, a.view(64, 64))  # other shape
    assert not same_bytes(a, a.view(torch.int32))  # other dtype, same bits
    assert not same_bytes(torch.tensor([0.0]), torch.tensor([-0.0]))  # bytes, not values
    nan = torch.tensor([float("nan")])
    assert same_bytes(nan, nan.clone())
    assert not same_bytes(a[::2], a[::2].clone())  # not contiguous: never reused
    assert same_bytes(torch.empty(0), torch.empty(0))
