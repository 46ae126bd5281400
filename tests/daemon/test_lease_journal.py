"""The lease journal's group commit: records buffered per event-loop tick, one write per flush,
forced flushes for descriptors, and replay of what was flushed after an abrupt end (no close)."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from hwr.daemon.lease_journal import LeaseJournal, process_start

KEY = "ab" * 32


def _lines(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_bytes().splitlines()]


def test_records_of_one_tick_are_written_with_one_write(tmp_path: Path) -> None:
    path = tmp_path / "leases.journal"
    journal = LeaseJournal.open(path)
    start = process_start(os.getpid())
    assert start is not None

    async def tick() -> tuple[bytes, bytes, int]:
        for i in range(50):
            journal.acquired(f"lease{i}", KEY, os.getpid(), start, os.getuid())
        for i in range(0, 50, 2):
            journal.released(f"lease{i}")
        before = path.read_bytes()  # nothing written yet: buffered until the end of the tick
        await asyncio.sleep(0)
        return before, path.read_bytes(), journal.writes

    before, after, writes = asyncio.run(tick())
    assert before == b""
    assert writes == 1
    entries = _lines(path)
    assert len(entries) == 75 and after.endswith(b"\n")
    assert entries[0] == {"op": "acquire", "lease": "lease0", "key": KEY, "pid": os.getpid(), "start": start,
                          "uid": os.getuid()}
    # Abrupt end (no close): the replay sees exactly the flushed state.
    recovered = LeaseJournal.open(path).recovered
    assert sorted(h.lease_id for h in recovered) == sorted(f"lease{i}" for i in range(1, 50, 2))
    journal.close()


def test_flush_writes_now_and_a_forced_flush_precedes_the_tick(tmp_path: Path) -> None:
    path = tmp_path / "leases.journal"
    journal = LeaseJournal.open(path)

    async def run() -> None:
        journal.acquired("one", KEY, os.getpid(), 1, 0)
        journal.flush()  # what the daemon does right before descriptors leave
        assert b'"lease":"one"' in path.read_bytes()
        journal.released("one")
        assert b'"op":"release"' not in path.read_bytes()
        await asyncio.sleep(0)
        assert b'"op":"release"' in path.read_bytes()

    asyncio.run(run())
    assert journal.writes == 2
    journal.close()


def test_without_an_event_loop_every_record_is_written_at_once(tmp_path: Path) -> None:
    path = tmp_path / "leases.journal"
    journal = LeaseJournal.open(path)
    journal.acquired("x", KEY, os.getpid(), 1, 0)
    assert _lines(path)[0]["lease"] == "x"
    journal.forget(KEY)
    assert _lines(path)[-1] == {"op": "forget", "key": KEY}
    journal.close()


_ids = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=40)


@settings(max_examples=200, deadline=None)
@given(lease_id=_ids | st.from_regex(r"[A-Za-z0-9:_.-]{1,40}", fullmatch=True),
       key=st.sampled_from([KEY, "checkpoint:abc", 'we"ird\\key\n']),
       pid=st.integers(0, 1 << 22), start=st.integers(0, 1 << 40), uid=st.integers(0, 1 << 31))
def test_the_hand_formatted_lines_are_the_json_lines(tmp_path_factory, lease_id: str, key: str, pid: int,
                                                     start: int, uid: int) -> None:
    path = tmp_path_factory.mktemp("j") / "leases.journal"
    journal = LeaseJournal.open(path)
    journal.acquired(lease_id, key, pid, start, uid)
    journal.released(lease_id)
    assert _lines(path) == [{"op": "acquire", "lease": lease_id, "key": key, "pid": pid, "start": start, "uid": uid},
                            {"op": "release", "lease": lease_id}]
    journal.close()
