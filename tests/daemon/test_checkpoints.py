"""The checkpoint registry with real files: HF topology, content digests, modification, hostile headers."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import save_file

from hwr.client.errors import (
    CheckpointModified,
    CheckpointNotFound,
    InvalidRequest,
    ManifestCorrupt,
    PermissionDeniedError,
)
from hwr.daemon.checkpoints import registry as ckmod
from hwr.daemon.checkpoints.registry import Checkpoints, hf_blob_link

REV = "a" * 40
BLOB = "b" * 64


def hf_snapshot(base: Path, tensors: dict[str, torch.Tensor]) -> Path:
    repo = base / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / REV / "transformer"
    snap.mkdir(parents=True)
    save_file(tensors, repo / "blobs" / BLOB)
    os.symlink(f"../../../blobs/{BLOB}", snap / "model.safetensors")
    return snap


def test_hf_link_is_trusted_only_with_the_exact_topology(short_tmp: Path) -> None:
    snap = hf_snapshot(short_tmp, {"w": torch.ones(4)})
    registry = Checkpoints(short_tmp / "state")
    registry.open()
    ckpt, added = registry.add(snap)
    assert added and ckpt.source_kind == "immutable-blob" and ckpt.files[0].source == f"immutable-blob:{BLOB}"
    assert (ckpt.model_id, ckpt.revision) == ("org/name", REV)
    # A link inside the directory is followed and its bytes are hashed; a link that leaves the
    # directory without the exact snapshot topology is refused (it could name any file).
    other = short_tmp / "plain"
    other.mkdir()
    save_file({"w": torch.ones(4)}, other / "real.bin")
    os.symlink("real.bin", other / "model.safetensors")
    plain, _ = registry.add(other)
    assert plain.source_kind == "content-sha256"
    escaping = short_tmp / "escaping"
    escaping.mkdir()
    os.symlink(short_tmp / "models--org--name" / "blobs" / BLOB, escaping / "model.safetensors")
    with pytest.raises(PermissionDeniedError) as refused:
        registry.add(escaping)
    assert refused.value.details == {"file": "model.safetensors"}
    registry.close()


@given(st.text(alphabet="./abf0123456789", max_size=80))
def test_hf_link_parser_rejects_every_other_target(target: str) -> None:
    path = Path(f"/c/models--o--n/snapshots/{REV}/x/model.safetensors")
    link = hf_blob_link(path, target)
    if link is not None:
        assert target == f"../../../blobs/{link.blob_hash}" and len(link.blob_hash) in (40, 64)


def test_digest_cache_and_registry_survive_a_restart(short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt_dir = short_tmp / "ckpt"
    ckpt_dir.mkdir()
    save_file({"w": torch.arange(10.0)}, ckpt_dir / "a.safetensors")
    first = Checkpoints(short_tmp / "state")
    first.open()
    ckpt, _ = first.add(ckpt_dir)
    first.close()
    assert json.loads((short_tmp / "state" / "registry.json").read_text()) == [str(ckpt_dir)]
    monkeypatch.setattr(ckmod, "HASH_CHUNK", 0)  # any re-hash now fails (range step 0)
    second = Checkpoints(short_tmp / "state")
    assert second.open() == []
    assert second.get(ckpt.checkpoint_id[:6]).checkpoint_id == ckpt.checkpoint_id
    assert second.get(str(ckpt_dir)).checkpoint_id == ckpt.checkpoint_id
    second.close()


def test_file_changing_while_hashed_or_after_registration_is_detected(
        short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt_dir = short_tmp / "ckpt"
    ckpt_dir.mkdir()
    save_file({"w": torch.zeros(1024)}, ckpt_dir / "a.safetensors")
    registry = Checkpoints(short_tmp / "state")
    registry.open()
    real_check = ckmod._check_unchanged
    calls = {"n": 0}

    def touch_then_check(fd, path, expected, name):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 1:  # a writer strikes during the hash
            os.utime(path, ns=(1, 1))
        return real_check(fd, path, expected, name)

    monkeypatch.setattr(ckmod, "_check_unchanged", touch_then_check)
    with pytest.raises(CheckpointModified):
        registry.add(ckpt_dir)
    monkeypatch.setattr(ckmod, "_check_unchanged", real_check)
    ckpt, _ = registry.add(ckpt_dir)
    registry.check(ckpt)
    with open(ckpt_dir / "a.safetensors", "r+b") as fh:
        fh.seek(-1, os.SEEK_END)
        fh.write(b"\x01")
    with pytest.raises(CheckpointModified):
        registry.check(ckpt)
    with pytest.raises(CheckpointModified):
        registry.open_fds(ckpt)
    assert ckpt.modified
    registry.close()


@pytest.mark.parametrize("header", [
    b'{"x":{"dtype":"F32","shape":[4],"data_offsets":[0,999999]}}',  # past the end
    b'{"x":{"dtype":"Q99","shape":[4],"data_offsets":[0,16]}}',  # unknown dtype
    b'{"x":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},"x":{}}',  # duplicate key
    b'{"x":{"dtype":"F32","shape":[2],"data_offsets":[0,16]}}',  # shape disagrees
    b'[1,2,3]',
    b'{"x":{"dtype":"F32","shape":[-4],"data_offsets":[0,16]}}',
])
def test_hostile_headers_are_rejected_with_typed_errors(short_tmp: Path, header: bytes) -> None:
    bad = short_tmp / "bad"
    bad.mkdir()
    (bad / "m.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 16)
    registry = Checkpoints(short_tmp / "state")
    registry.open()
    with pytest.raises(ManifestCorrupt) as err:
        registry.add(bad)
    assert err.value.details["file"] == "m.safetensors"
    assert registry.list() == []
    # Huge declared header length: refused before reading it.
    (bad / "m.safetensors").write_bytes((1 << 62).to_bytes(8, "little") + b"{}")
    with pytest.raises(ManifestCorrupt):
        registry.add(bad)


def test_bad_directories_and_duplicate_tensors_are_invalid_requests(short_tmp: Path) -> None:
    registry = Checkpoints(short_tmp / "state")
    registry.open()
    with pytest.raises(InvalidRequest):
        registry.add(short_tmp / "missing")
    (short_tmp / "empty").mkdir()
    with pytest.raises(InvalidRequest):
        registry.add(short_tmp / "empty")
    dup = short_tmp / "dup"
    dup.mkdir()
    save_file({"w": torch.ones(2)}, dup / "a.safetensors")
    save_file({"w": torch.ones(2)}, dup / "b.safetensors")
    with pytest.raises(InvalidRequest):
        registry.add(dup)
    with pytest.raises(CheckpointNotFound):
        registry.get("abcd")


def test_a_directory_too_large_to_be_a_checkpoint_is_refused_fast(
        short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``checkpoints add /`` (or a home directory) must not walk millions of entries: past the
    walk's bound the request fails with a typed error naming the limit, before reading any file."""
    from hwr.daemon.checkpoints import files as ckfiles

    monkeypatch.setattr(ckfiles, "MAX_WALK_ENTRIES", 50)
    big = short_tmp / "big"
    for i in range(6):
        sub = big / f"d{i}"
        sub.mkdir(parents=True)
        for j in range(10):
            (sub / f"f{j}.txt").write_bytes(b"")
    save_file({"w": torch.ones(2)}, big / "d0" / "model.safetensors")
    registry = Checkpoints(short_tmp / "state")
    registry.open()
    with pytest.raises(InvalidRequest) as err:
        registry.add(big)
    assert err.value.details["limit"] == 50, err.value.details
    small = short_tmp / "small"
    small.mkdir()
    save_file({"w": torch.ones(2)}, small / "model.safetensors")
    ckpt, added = registry.add(small)  # a real checkpoint directory stays well inside the bound
    assert added and len(ckpt.files) == 1
