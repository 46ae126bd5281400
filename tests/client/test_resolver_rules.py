"""The resolver's terminal rule (pure) and restore planning against model skeletons."""

from __future__ import annotations

import mmap
import os
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from hwr.client import errors as e
from hwr.client.carrier import MappedRegion
from hwr.client.resolver import Action, RuntimeMode, action_for
from hwr.client.restore import plan_restore
from hwr.client.safetensors_header import DTYPES, read_header

P, R = RuntimeMode.PREFERRED, RuntimeMode.REQUIRED


@pytest.mark.parametrize(
    ("mode", "error", "expected"),
    [
        (P, None, Action.RETURN_LEASE),
        (R, None, Action.RETURN_LEASE),
        (P, e.ArtifactNotFound("miss"), Action.CANONICAL_FALLBACK),
        (R, e.ArtifactNotFound("miss"), Action.FAIL_STARTUP),
        (P, e.ManifestCorrupt("bad"), Action.CANONICAL_FALLBACK),
        (P, e.ArtifactDenied("denied"), Action.CANONICAL_FALLBACK),
        (P, e.ChecksumMismatch("flip"), Action.CANONICAL_FALLBACK),
        (P, e.DaemonUnavailable("down"), Action.CANONICAL_FALLBACK),
        (R, e.DaemonUnavailable("down"), Action.FAIL_STARTUP),
        (P, e.InsufficientCapacity("full"), Action.CANONICAL_FALLBACK),
        (P, e.DeadlineExceeded("slow"), Action.CANONICAL_FALLBACK),
        # never disguised as a miss, even in preferred mode
        (P, e.IdentityCollision("other bytes"), Action.FAIL_STARTUP),
        (P, e.Unsupported("producer"), Action.FAIL_STARTUP),
        (P, e.ConfigError("bad"), Action.FAIL_STARTUP),
        (P, e.IdentityError("bad"), Action.FAIL_STARTUP),
        (RuntimeMode.DISABLED, e.DaemonUnavailable("x"), Action.SKIP),
    ],
)
def test_action_for(mode: RuntimeMode, error: e.HwrError | None, expected: Action) -> None:
    assert action_for(mode, error) is expected


def test_a_miss_with_a_producer_tries_it_in_both_modes() -> None:
    for mode in (P, R):
        assert action_for(mode, e.ArtifactNotFound("miss"), can_produce=True) is Action.TRY_PRODUCER


class FileLease:
    """A real lease over a real read-only mapping of a safetensors file (no daemon needed)."""

    def __init__(self, path: Path) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            header = read_header(fd)
            self._map = mmap.mmap(fd, os.fstat(fd).st_size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            base = torch.frombuffer(self._map, dtype=torch.uint8)
        self._tensors = {}
        for entry in header.entries:
            info = DTYPES[entry.dtype]
            raw = base[header.data_offset + entry.begin: header.data_offset + entry.end]
            self._tensors[entry.name] = raw.view(info.torch_dtype).view(entry.shape)
        self.closes = 0

    key = "f" * 64

    @property
    def tensors(self):  # type: ignore[no-untyped-def]
        return self._tensors

    @property
    def mapped_regions(self) -> tuple[MappedRegion, ...]:
        return ()

    @property
    def closed(self) -> bool:
        return self.closes > 0

    def close(self) -> None:
        self.closes += 1


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(3, 4, bias=False)
        self.register_buffer("scale", torch.ones(4))
        self.register_buffer("cache", torch.zeros(2), persistent=False)


def _lease_for(tmp_path: Path, tensors: dict[str, torch.Tensor]) -> FileLease:
    path = tmp_path / "w.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    return FileLease(path)


def _weights() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {k: v.clone() for k, v in Tiny().state_dict().items()}


def test_plan_then_commit_binds_views_without_copies(tmp_path: Path) -> None:
    lease = _lease_for(tmp_path, _weights())
    with torch.device("meta"):
        model = Tiny()
    model.cache = torch.zeros(2)  # the skeleton builder makes non-persistent buffers real
    plan = plan_restore(model, lease)
    assert model.a.weight.is_meta, "planning must not mutate the model"
    carrier = plan.commit()
    assert model.a.weight.data_ptr() == lease.tensors["a.weight"].data_ptr()
    assert model.scale.data_ptr() == lease.tensors["scale"].data_ptr()
    assert not model.a.weight.requires_grad
    assert carrier.take() is lease and lease.closes == 0
    with pytest.raises(e.RestoreCommitFailed):
        plan.commit()


@pytest.mark.parametrize(
    ("mutate", "detail"),
    [
        (lambda w: w.pop("b.weight"), "first_missing"),
        (lambda w: w.__setitem__("extra", torch.ones(1)), "first_unexpected"),
        (lambda w: w.__setitem__("a.weight", torch.ones(3, 5)), "first_mismatched"),
        (lambda w: w.__setitem__("a.weight", w["a.weight"].to(torch.float16)), "first_mismatched"),
    ],
)
def test_plan_rejects_inexact_coverage(tmp_path: Path, mutate, detail: str) -> None:  # type: ignore[no-untyped-def]
    weights = _weights()
    mutate(weights)
    lease = _lease_for(tmp_path, weights)
    model = Tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(e.RestorePreflightFailed) as info:
        plan_restore(model, lease)
    assert detail in info.value.details
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_plan_rejects_a_stride_mismatch(tmp_path: Path) -> None:
    lease = _lease_for(tmp_path, _weights())
    model = Tiny()
    model.a.weight = nn.Parameter(torch.ones(4, 3).t())  # same shape, transposed stride
    with pytest.raises(e.RestorePreflightFailed) as info:
        plan_restore(model, lease)
    assert info.value.details["first_mismatched"] == "a.weight"


def test_plan_rejects_meta_non_persistent_buffers(tmp_path: Path) -> None:
    lease = _lease_for(tmp_path, _weights())
    with torch.device("meta"):
        model = Tiny()
    with pytest.raises(e.RestorePreflightFailed) as info:
        plan_restore(model, lease)
    assert info.value.details["first_meta_buffer"] == "cache"


def test_a_failed_commit_closes_the_lease(tmp_path: Path) -> None:
    lease = _lease_for(tmp_path, _weights())
    model = Tiny()

    def boom(name: str) -> None:
        if name == "b.weight":
            raise OSError("injected")

    plan = plan_restore(model, lease, fault=boom)
    with pytest.raises(e.RestoreCommitFailed):
        plan.commit()
    assert lease.closes == 1


def test_tied_parameters_stay_tied(tmp_path: Path) -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.enc = nn.Linear(4, 4, bias=False)
            self.dec = nn.Linear(4, 4, bias=False)
            self.dec.weight = self.enc.weight

    weights = {k: v.clone() for k, v in Tied().state_dict().items()}
    assert set(weights) == {"enc.weight", "dec.weight"}
    lease = _lease_for(tmp_path, weights)
    model = Tied()
    plan_restore(model, lease).commit()
    assert model.enc.weight is model.dec.weight
