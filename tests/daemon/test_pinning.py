"""``PinSet``: membership in memory, persistence by ``save`` (atomic, serialized)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

from hwr.daemon.service.pinning import PinSet


def _key(i: int) -> str:
    return f"{i:064x}"


def test_membership_changes_at_once_and_persists_only_on_save(tmp_path: Path) -> None:
    pins = PinSet.open(tmp_path)
    assert pins.add(_key(1)) and not pins.add(_key(1))
    assert _key(1) in pins and not (tmp_path / "pins.json").exists()
    pins.save()
    assert PinSet.open(tmp_path).keys() == {_key(1)}
    assert pins.discard(_key(1)) and not pins.discard(_key(1))
    assert PinSet.open(tmp_path).keys() == {_key(1)}  # not saved yet
    pins.save()
    assert json.loads((tmp_path / "pins.json").read_text()) == {"pins": [], "schema_version": 1}


def test_concurrent_saves_keep_every_pin(tmp_path: Path) -> None:
    """Each thread pins its key and saves; whatever order the saves finish in, the file ends
    with every key (a save writes the set as it is under the save lock, so the last one to
    finish saw every change made before it started)."""
    for _ in range(20):
        pins = PinSet.open(tmp_path)
        start = threading.Barrier(8)

        def pin(i: int, pins: PinSet = pins, start: threading.Barrier = start) -> None:
            start.wait()
            pins.add(_key(i))
            pins.save()

        threads = [threading.Thread(target=pin, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert PinSet.open(tmp_path).keys() == {_key(i) for i in range(8)}
        for i in range(8):
            pins.discard(_key(i))
        pins.save()
    assert not [p for p in tmp_path.iterdir() if p.name != "pins.json"]  # no temp file left


def test_an_unreadable_file_starts_unpinned(tmp_path: Path) -> None:
    (tmp_path / "pins.json").write_text("{not json")
    assert PinSet.open(tmp_path).keys() == set()
