"""Producer-reported digests: computed while writing, equal to a re-hash, trusted at commit, and a
wrong one is caught by ``verify`` (the limit of the trust argument in ``ProducerDigests``)."""

from __future__ import annotations

import hashlib
import io
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import hwr.client as hc
from hwr.client.errors import ArtifactDenied, ChecksumMismatch
from hwr.client.identity import ArtifactIdentity
from hwr.client.safetensors_header import read_header
from hwr.daemon.producers import base, worker
from hwr.daemon.producers.digests import StreamDigests
from hwr.daemon.store import fileio as store_io
from hwr.daemon.store.root import StagedTensor, Store
from hwr.daemon.store.staging import ProducerDigests


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_stream_digests_cover_gaps_and_blocks_in_order_and_give_up_out_of_order(short_tmp: Path) -> None:
    path = short_tmp / "f.bin"
    head = b"H" * 100
    data = {"a": os.urandom(300), "b": os.urandom(50)}
    size = 100 + 300 + 20 + 50 + 7  # a padding gap between a and b, and a tail
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, size)
        os.pwrite(fd, head, 0)
        placements = {"a": (fd, 100, 300), "b": (fd, 420, 50)}
        digests = StreamDigests([(fd, "f.bin", size)], placements)
        for name, blocks in (("a", [(0, 120), (120, 300)]), ("b", [(0, 50)])):
            for begin, end in blocks:
                chunk = data[name][begin:end]
                os.pwrite(fd, chunk, placements[name][1] + begin)
                digests.wrote(name, begin, memoryview(chunk))
        reported = digests.finish()
        digests.close()
        assert reported == {"files": {"f.bin": _sha(os.pread(fd, size, 0))},
                            "tensors": {"a": _sha(data["a"]), "b": _sha(data["b"])}}
        backwards = StreamDigests([(fd, "f.bin", size)], placements)
        backwards.wrote("b", 0, memoryview(data["b"]))
        backwards.wrote("a", 0, memoryview(data["a"]))  # before b in the file: out of order
        assert backwards.finish() is None
        backwards.close()
        partial = StreamDigests([(fd, "f.bin", size)], placements)
        partial.wrote("a", 0, memoryview(data["a"][:10]))
        assert partial.finish() is None  # a tensor not fully written: no digests
        partial.close()
    finally:
        os.close(fd)


def _worker_build(tmp: Path, store: Store, options: dict, keep_fp32: bool = False):
    g = torch.Generator().manual_seed(3)
    source = {"w": torch.randn(33, 17, generator=g), "norm.weight": torch.randn(17, generator=g),
              "steps": torch.arange(5), "empty": torch.zeros(0, 4)}
    save_file(source, tmp / "src.safetensors")
    src_fd = os.open(tmp / "src.safetensors", os.O_RDONLY)
    header = read_header(src_fd, require_alignment=False)
    producer = worker.make_producer("cast", options)
    outputs = producer.plan([base.SourceTensor(e.name, e.dtype, e.shape) for e in header.entries], 0)
    specs = [StagedTensor(o.name, o.dtype, o.shape) for o in outputs]
    staging = store.installer.begin(ArtifactIdentity.simple(f"digests-{json.dumps(options, sort_keys=True)}"), specs,
                                    max_file_bytes=1200)  # several payload files, mixed item sizes
    fds = {name: os.open(path, os.O_RDWR) for name, path, _size in staging.files}
    st = os.fstat(src_fd)
    job = {"producer": "cast", "options": options, "rank": 0,
           "sources": [{"fd": src_fd, "fingerprint": [st.st_size, st.st_dev, st.st_ino, st.st_mtime_ns,
                                                      st.st_ctime_ns]}],
           "outputs": {n: [fds[f], off, nb] for n, (f, off, nb) in staging.placements.items()},
           "files": [[fds[name], name, size] for name, _path, size in staging.files]}
    try:
        done = worker.run(job, io.StringIO())
    finally:
        for fd in [src_fd, *fds.values()]:
            os.close(fd)
    return staging, done


def test_worker_digests_equal_a_rehash_and_commit_trusts_them(short_tmp: Path, monkeypatch) -> None:
    monkeypatch.setattr(base, "BLOCK_BYTES", 256)  # many blocks per tensor
    with Store.open(short_tmp / "store") as store:
        staging, done = _worker_build(short_tmp, store, {"dtype": "bf16", "keep_fp32": ["norm.*"]})
        assert len(staging.plans) > 1
        jobs, fds = [], []
        for plan in staging.plans:
            fd = os.open(staging.path / plan.name, os.O_RDONLY)
            fds.append(fd)
            head = len(plan.head)
            jobs.append((fd, plan.size, [(e.name, head + e.begin, head + e.end) for e in plan.entries]))
        file_sha, tensor_sha = store_io.hash_ranges(jobs)
        for fd in fds:
            os.close(fd)
        assert done["digests"] == {"files": {p.name: h for p, h in zip(staging.plans, file_sha, strict=True)},
                                   "tensors": tensor_sha}
        calls = []
        monkeypatch.setattr(store_io, "hash_ranges", lambda *a, **k: calls.append(a) or (_ for _ in ()).throw(
            AssertionError("commit re-hashed despite complete producer digests")))
        record = store.installer.commit(staging, trusted_digests=ProducerDigests.parse(done["digests"]))
        assert calls == []
        assert {t.name: t.sha256 for t in record.manifest.tensors} == tensor_sha
        monkeypatch.undo()
        assert store.verify(record.key).key == record.key


def test_a_wrong_producer_digest_is_committed_but_caught_by_verify(short_tmp: Path) -> None:
    with Store.open(short_tmp / "store") as store:
        staging, done = _worker_build(short_tmp, store, {"dtype": "fp16"})
        digests = done["digests"]
        digests["tensors"]["w"] = "0" * 64  # a producer that lies (or a hashing bug)
        record = store.installer.commit(staging, trusted_digests=ProducerDigests.parse(digests))
        with pytest.raises(ChecksumMismatch):
            store.verify(record.key)
        with pytest.raises(ArtifactDenied):
            store.records.lookup(record.key)


def test_incomplete_or_malformed_digests_fall_back_to_hashing(short_tmp: Path) -> None:
    assert ProducerDigests.parse({"files": {"a": "xyz"}, "tensors": {}}) is None
    assert ProducerDigests.parse(None) is None and ProducerDigests.parse({"files": []}) is None
    with Store.open(short_tmp / "store") as store:
        staging, done = _worker_build(short_tmp, store, {"dtype": "bf16"})
        digests = done["digests"]
        true_w = digests["tensors"].pop("w")
        digests["tensors"]["not-a-tensor"] = "0" * 64
        record = store.installer.commit(staging, trusted_digests=ProducerDigests.parse(digests))
        assert next(t.sha256 for t in record.manifest.tensors if t.name == "w") == true_w
        store.verify(record.key)


def test_prewarm_with_producer_digests_verifies(short_tmp: Path, hwrd) -> None:
    source = {"blocks.0.w": torch.randn(256, 64), "blocks.0.norm.weight": torch.randn(64), "n": torch.arange(3)}
    (short_tmp / "ckpt").mkdir()
    save_file(source, short_tmp / "ckpt" / "model.safetensors")
    with hc.connect(hwrd.socket) as client:
        info = client.add_checkpoint(short_tmp / "ckpt")
        [built] = client.prewarm(info["checkpoint_id"], "cast", dtype="bf16", keep_fp32=["*norm*"])
        assert client.verify(built["key"])["ok"] is True
        with client.acquire(built["key"]) as lease:
            assert torch.equal(lease.tensors["blocks.0.w"], source["blocks.0.w"].to(torch.bfloat16))
