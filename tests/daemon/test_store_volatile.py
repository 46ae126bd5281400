"""Non-durable commits: no fsync, a durable marker before the rename, gone at the next open,
and a marker never outlives its artifact (a later durable commit of the key survives)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from hwr.client.errors import ArtifactNotFound
from hwr.client.identity import ArtifactIdentity
from hwr.daemon.store import fileio as store_io
from hwr.daemon.store import root as store_module
from hwr.daemon.store.root import StagedTensor, Store
from hwr.daemon.store.staging import write_tensor


def commit(store: Store, name: str, *, durable: bool, value: float = 1.0) -> str:
    tensors = {"w": torch.full((256,), value)}
    staging = store.installer.begin(ArtifactIdentity.simple(name), [StagedTensor("w", torch.float32, (256,))])
    write_tensor(staging, "w", tensors["w"])
    return store.installer.commit(staging, durable=durable).key


def test_a_non_durable_commit_fsyncs_nothing_and_is_gone_at_the_next_open(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "store"
    with Store.open(root) as store:
        synced: list[int] = []
        real = store_io.fsync
        monkeypatch.setattr(store_io, "fsync", lambda fd: (synced.append(fd), real(fd))[1])
        volatile = commit(store, "m/volatile", durable=False)
        # only the marker's directory was fsynced (fsync_dir calls fsync on a directory descriptor)
        assert len(synced) == 1
        assert store.volatile.marked(volatile) and (root / "volatile" / volatile).exists()
        synced.clear()
        durable = commit(store, "m/durable", durable=True)
        assert len(synced) >= 4 and not store.volatile.marked(durable)  # payload, documents, dirs
        assert store.records.lookup(volatile).key == volatile  # served like any other while hwrd runs
    with Store.open(root) as store:
        with pytest.raises(ArtifactNotFound):
            store.records.lookup(volatile)
        assert store.records.lookup(durable).key == durable
        assert os.listdir(root / "volatile") == [] and not store.volatile.marked(volatile)


def test_the_marker_is_in_place_before_the_rename(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, bool] = {}
    root = tmp_path / "store"
    key = ArtifactIdentity.simple("m/order").key

    def hook(step: str) -> None:
        if step in ("marker_written", "renamed"):
            seen[step] = (root / "volatile" / key).exists()
            if step == "renamed":
                raise KeyboardInterrupt  # a crash right after the rename

    with Store.open(root) as store:
        monkeypatch.setattr(store_module, "FAULT_HOOK", hook)
        with pytest.raises(KeyboardInterrupt):
            commit(store, "m/order", durable=False)
        monkeypatch.setattr(store_module, "FAULT_HOOK", None)
    assert seen == {"marker_written": False, "renamed": True}
    assert (root / "artifacts" / key).exists()  # renamed in before the "crash"
    with Store.open(root) as store:  # the next open removes it, marker last
        assert not (root / "artifacts" / key).exists() and os.listdir(root / "volatile") == []
        with pytest.raises(ArtifactNotFound):
            store.records.lookup(key)


def test_a_removed_non_durable_artifact_leaves_no_marker_to_drop_a_durable_one(tmp_path: Path) -> None:
    root = tmp_path / "store"
    with Store.open(root) as store:
        key = commit(store, "m/again", durable=False)
        store.remove(key)  # evicted: its marker goes with it
        assert not store.volatile.marked(key) and os.listdir(root / "volatile") == []
        again = commit(store, "m/again", durable=True)
        assert again == key
    with Store.open(root) as store:
        assert store.records.lookup(key).key == key


def test_a_mapping_of_a_non_durable_artifact_stays_valid_after_it_is_dropped(tmp_path: Path) -> None:
    root = tmp_path / "store"
    with Store.open(root) as store:
        key = commit(store, "m/mapped", durable=False, value=3.0)
        record = store.records.lookup(key)
        (_name, fd), = store.records.open_payloads(record)
    try:
        import mmap

        size = os.fstat(fd).st_size
        view = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        with Store.open(root):  # drops the artifact: unlinked, never truncated
            pass
        assert os.fstat(fd).st_nlink == 0 and os.fstat(fd).st_size == size
        assert view[size - 4:] == torch.tensor([3.0]).numpy().tobytes()  # still readable: no SIGBUS
        view.close()
    finally:
        os.close(fd)
