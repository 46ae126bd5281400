"""AccessTimes (``hwr.daemon.service.recency``): the persisted clock of LRU eviction. Round trip,
snapshots saved newest-wins from any thread, and a bad or unwritable file never raises."""

from __future__ import annotations

import json
import os
import stat
import threading
from pathlib import Path

import pytest

from hwr.daemon.service.recency import AccessTimes

A, B = "a" * 64, "b" * 64


def test_round_trip_and_forget(tmp_path: Path) -> None:
    times = AccessTimes(tmp_path / "access.json")
    assert times.snapshot() is None  # nothing changed: nothing to save
    times.touch(A, 100.5)
    times.touch(B, 200.25)
    times.forget(B)
    times.flush()
    assert times.snapshot() is None
    again = AccessTimes(tmp_path / "access.json")
    assert again.get(A, 0.0) == 100.5 and again.get(B, -1.0) == -1.0
    assert json.loads((tmp_path / "access.json").read_bytes()) == {"schema_version": 1, "last_access": {A: 100.5}}
    assert stat.S_IMODE(os.stat(tmp_path / "access.json").st_mode) == 0o600


def test_an_older_snapshot_never_replaces_a_newer_one(tmp_path: Path) -> None:
    times = AccessTimes(tmp_path / "access.json")
    times.touch(A, 1.0)
    older = times.snapshot()
    times.touch(A, 2.0)
    newer = times.snapshot()
    assert older is not None and newer is not None
    assert times.write(newer) is True
    assert times.write(older) is False  # e.g. a housekeeping write that lost the race to stop()
    assert AccessTimes(tmp_path / "access.json").get(A, 0.0) == 2.0


def test_concurrent_writes_leave_the_newest_and_no_temp_files(tmp_path: Path) -> None:
    times = AccessTimes(tmp_path / "access.json")
    snapshots = []
    for i in range(40):
        times.touch(A, float(i))
        snapshot = times.snapshot()
        assert snapshot is not None
        snapshots.append(snapshot)
    threads = [threading.Thread(target=times.write, args=(s,)) for s in reversed(snapshots)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert AccessTimes(tmp_path / "access.json").get(A, -1.0) == 39.0
    assert os.listdir(tmp_path) == ["access.json"]


@pytest.mark.parametrize("content", [b"", b"{not json", b"[1, 2]", b'{"last_access": {"k": "soon"}}',
                                     b'{"last_access": [1]}', b"\xff\xfe"])
def test_an_unreadable_file_starts_empty(tmp_path: Path, content: bytes) -> None:
    (tmp_path / "access.json").write_bytes(content)
    times = AccessTimes(tmp_path / "access.json")
    assert times.get(A, 7.0) == 7.0
    times.touch(A, 3.0)
    times.flush()  # and is replaced by a good one
    assert AccessTimes(tmp_path / "access.json").get(A, 0.0) == 3.0


def test_a_failed_save_is_logged_not_raised(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    times = AccessTimes(tmp_path / "gone" / "access.json")  # its directory does not exist
    times.touch(A, 1.0)
    snapshot = times.snapshot()
    assert snapshot is not None
    assert times.write(snapshot) is False
    assert "cannot save access times" in caplog.text
    assert not (tmp_path / "gone").exists()
