"""A pull hashes while it downloads: ``DownloadSink``/``InOrderDigests`` and a real pull's commit.

The sink gets pieces in any order (S3's parallel ranged GETs), writes them into a real file and
must produce exactly ``hashlib``'s digests of the file and of each tensor range, or None (the
commit then hashes the file itself) when the pieces are inconsistent. A real ``Puller`` over a
real ``file://`` remote, store and publications commits with those digests: the store's own
hash pass (``fileio.hash_ranges``) is never called, and a flipped byte is still refused.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import shutil
from pathlib import Path

import pytest
import torch

from hwr.client.errors import ChecksumMismatch
from hwr.client.identity import ArtifactIdentity
from hwr.daemon.fleet import sink as sink_module
from hwr.daemon.fleet.pull import Puller
from hwr.daemon.fleet.remote import RemoteObjectInvalid, parse_location
from hwr.daemon.fleet.remote_file import FileRemote
from hwr.daemon.fleet.sink import DownloadSink
from hwr.daemon.service.catalog import Catalog
from hwr.daemon.service.eviction_marks import EvictionMarks
from hwr.daemon.service.publishing import Publishing
from hwr.daemon.store import fileio
from hwr.daemon.store.root import Store

SIZE = 3 << 20
RANGES = [("a", 100, 1 << 20), ("empty", 1 << 20, 1 << 20), ("b", (1 << 20) + 8, SIZE - 16)]


def expected(data: bytes) -> tuple[str, dict[str, str]]:
    return hashlib.sha256(data).hexdigest(), {n: hashlib.sha256(data[s:e]).hexdigest() for n, s, e in RANGES}


def pieces(data: bytes, size: int) -> list[tuple[int, bytes]]:
    return [(off, data[off:off + size]) for off in range(0, len(data), size)]


def run_sink(tmp: Path, order: list[tuple[int, bytes]]) -> tuple[str, dict[str, str]] | None:
    fd = os.open(tmp / "staging", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        sink = DownloadSink(fd, SIZE, RANGES, progress=lambda n: None, check=lambda: None)
        for offset, piece in order:
            sink.write(offset, piece)
        return sink.finish()
    finally:
        os.close(fd)


@pytest.mark.parametrize("budget", [64 << 20, 300 << 10])  # all held in memory / most re-read from the file
def test_pieces_in_any_order_give_hashlibs_digests(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   budget: int) -> None:
    monkeypatch.setattr(sink_module, "REORDER_BUDGET", budget)
    data = random.Random(1).randbytes(SIZE)
    order = pieces(data, 256 << 10)
    random.Random(2).shuffle(order)
    assert run_sink(tmp_path, order) == expected(data)
    assert (tmp_path / "staging").read_bytes() == data


def test_inconsistent_pieces_give_no_digests(tmp_path: Path) -> None:
    data = random.Random(3).randbytes(SIZE)
    order = pieces(data, 1 << 20)
    assert run_sink(tmp_path, order[:-1]) is None  # a gap at the end
    assert run_sink(tmp_path, [*order, order[0]]) is None  # the same bytes twice
    overlapping = [order[0], (512 << 10, data[512 << 10:(3 << 19)]), *order[1:]]
    assert run_sink(tmp_path, overlapping) is None


def test_a_piece_past_the_size_is_refused_and_a_stopped_pull_stops(tmp_path: Path) -> None:
    fd = os.open(tmp_path / "staging", os.O_RDWR | os.O_CREAT, 0o600)
    stop: list[Exception] = []

    def check() -> None:
        if stop:
            raise stop[0]

    try:
        sink = DownloadSink(fd, 10, [], progress=lambda n: None, check=check)
        with pytest.raises(RemoteObjectInvalid):
            sink.write(8, b"abcd")
        stop.append(ChecksumMismatch("stopped"))
        with pytest.raises(ChecksumMismatch):
            sink.write(0, b"ab")
        sink.close()
        assert os.fstat(fd).st_size == 0  # nothing was written
    finally:
        os.close(fd)


def _remote_with_artifact(tmp: Path) -> tuple[FileRemote, str]:
    """A file:// remote laid out as hwrd pushes, holding one artifact a real store published."""
    with Store.open(tmp / "origin") as origin:
        tensors = {"w": torch.arange(300_000, dtype=torch.float32), "b": torch.ones(4096, dtype=torch.bfloat16)}
        record = origin.installer.publish(ArtifactIdentity.simple("sink/pull"), tensors)
        shutil.copytree(origin.root / "artifacts" / record.key, tmp / "remote" / "artifacts" / record.key)
    return FileRemote(parse_location(f"file://{tmp / 'remote'}")), record.key


def _pull(root: Path, remote: FileRemote, key: str) -> tuple[object, str]:
    async def go() -> tuple[object, str]:
        with Store.open(root) as store:
            catalog = Catalog(store, EvictionMarks())  # the read API the puller reads through
            puller = Puller(remote, catalog, Publishing(store, catalog), wait_timeout=10)
            try:
                return await puller.pull(key)
            finally:
                puller.close()

    return asyncio.run(go())


def test_a_pull_commits_with_the_digests_it_computed_while_downloading(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    remote, key = _remote_with_artifact(tmp_path)

    def no_second_pass(*args: object, **kwargs: object) -> object:
        raise AssertionError("the commit re-read and re-hashed the pulled bytes")

    monkeypatch.setattr(fileio, "hash_ranges", no_second_pass)
    record, outcome = _pull(tmp_path / "node", remote, key)
    assert outcome == "pulled"
    pulled = tmp_path / "node" / "artifacts" / key / "model-00001.safetensors"
    assert pulled.read_bytes() == (tmp_path / "remote" / "artifacts" / key / "model-00001.safetensors").read_bytes()
    monkeypatch.undo()
    with Store.open(tmp_path / "node") as store:  # a full re-hash agrees with the committed manifest
        assert store.verify(key).manifest == record.manifest  # type: ignore[attr-defined]


def test_a_flipped_byte_is_still_refused_and_leaves_nothing(tmp_path: Path) -> None:
    remote, key = _remote_with_artifact(tmp_path)
    payload = tmp_path / "remote" / "artifacts" / key / "model-00001.safetensors"
    data = bytearray(payload.read_bytes())
    data[len(data) // 2] ^= 1
    payload.write_bytes(bytes(data))
    with pytest.raises(ChecksumMismatch):
        _pull(tmp_path / "node", remote, key)
    assert os.listdir(tmp_path / "node" / "artifacts") == []
    assert os.listdir(tmp_path / "node" / "tmp") == []
