"""Hashing handed-over staging files while the rest is written: the commit takes the digests only
for files that nobody else holds and that did not change since they were hashed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from hwr.client.errors import ManifestCorrupt
from hwr.client.identity import ArtifactIdentity
from hwr.daemon.store.prehash import prehash
from hwr.daemon.store.root import StagedTensor, Store
from hwr.daemon.store.staging import OVERLAP_MIN_FILE_BYTES, overlap_file_bytes, plan_payloads, write_tensor

MIB = 1 << 20


def staged(store: Store, name: str, files: int = 3) -> tuple[object, dict[str, torch.Tensor]]:
    tensors = {f"t{i}": torch.arange(i * MIB, (i + 1) * MIB, dtype=torch.float32) for i in range(files)}
    specs = [StagedTensor(n, torch.float32, tuple(t.shape)) for n, t in tensors.items()]
    staging = store.installer.begin(ArtifactIdentity.simple(name), specs, max_file_bytes=4 * MIB)
    assert len(staging.plans) == files
    for n, t in tensors.items():
        write_tensor(staging, n, t)
    return staging, tensors


def test_prehashed_files_are_committed_with_the_digests_of_a_full_hash(tmp_path: Path) -> None:
    with Store.open(tmp_path / "store") as store:
        staging, _ = staged(store, "m/pre")
        done = {d.name: d for d in (prehash(staging, i) for i in (0, 2)) if d is not None}
        assert sorted(done) == [staging.plans[0].name, staging.plans[2].name]
        record = store.installer.commit(staging, opened={n: d.fd for n, d in done.items()}, prehashed=done)
        assert store.verify(record.key).key == record.key  # every digest re-hashed: they agree
        for name, d in done.items():  # taken and closed by the commit
            with pytest.raises(OSError):
                os.fstat(d.fd)
            assert next(f.sha256 for f in record.manifest.files if f.name == name) == d.file_sha256


def test_a_file_changed_after_it_was_hashed_fails_the_commit(tmp_path: Path) -> None:
    with Store.open(tmp_path / "store") as store:
        staging, _ = staged(store, "m/changed")
        done = prehash(staging, 1)
        assert done is not None
        plan = staging.plans[1]
        fd = os.open(staging.path / plan.name, os.O_WRONLY)  # the daemon's own writer (no client can)
        os.pwrite(fd, b"\x01", plan.size - 1)
        os.close(fd)
        with pytest.raises(ManifestCorrupt):
            store.installer.commit(staging, opened={done.name: done.fd}, prehashed={done.name: done})


def test_a_file_someone_still_holds_is_not_hashed_early(tmp_path: Path) -> None:
    with Store.open(tmp_path / "store") as store:
        staging, _ = staged(store, "m/held")
        held = os.open(staging.path / staging.plans[0].name, os.O_RDWR)
        try:
            assert prehash(staging, 0) is None
        finally:
            os.close(held)
        store.installer.abort(staging)


def test_the_layout_of_a_publication_hashed_while_written_is_a_function_of_its_size() -> None:
    assert overlap_file_bytes(2 * OVERLAP_MIN_FILE_BYTES - 1) is None
    assert overlap_file_bytes(2 * OVERLAP_MIN_FILE_BYTES) == OVERLAP_MIN_FILE_BYTES
    one_gib = overlap_file_bytes(1 << 30)
    assert one_gib == 64 * MIB
    specs = [StagedTensor(f"blocks.{i}.w", torch.bfloat16, (32 * MIB // 2,)) for i in range(32)]
    assert len(plan_payloads(specs, one_gib)) == 16


def test_a_remote_node_re_plans_the_layout_of_a_revision_hashed_while_written(tmp_path: Path) -> None:
    from hwr.client.manifest import MANIFEST_FILE, READY_FILE
    from hwr.daemon.fleet.pull import plan_from_documents

    specs = [StagedTensor(f"blocks.{i}.w", torch.float32, (8 * MIB // 4,)) for i in range(10)]  # 80 MiB
    with Store.open(tmp_path / "store") as store:
        total = sum(8 * MIB for _ in specs)
        staging = store.installer.begin(ArtifactIdentity.simple("m/remote"), specs,
                                        max_file_bytes=overlap_file_bytes(total))
        assert len(staging.plans) > 1
        for spec in specs:
            write_tensor(staging, spec.name, torch.ones(spec.shape))
        record = store.installer.commit(staging, durable=False)
        directory = tmp_path / "store" / "artifacts" / record.key
        plan = plan_from_documents(record.key, (directory / READY_FILE).read_bytes(),
                                   (directory / MANIFEST_FILE).read_bytes(), "file:///remote")
    assert plan.overlap and [name for name, _ in plan.files] == [f.name for f in record.manifest.files]
