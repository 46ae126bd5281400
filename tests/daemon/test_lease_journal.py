"""The lease journal's group commit: records buffered per event-loop tick, one write per flush,
forced flushes for descriptors, and replay of what was flushed after an abrupt end (no close)."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from hwr.daemon.service.lease_journal import LeaseJournal, process_start

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


def _full_disk_after(monkeypatch, nbytes: int) -> list[int]:
    """``os.write`` takes ``nbytes`` more bytes in all (a short write at the edge), then fails
    with ENOSPC until the returned switch is cleared (the disk was freed)."""
    real = os.write
    room = [nbytes]

    def write(fd: int, data) -> int:  # type: ignore[no-untyped-def]
        if not room:
            return real(fd, data)
        if room[0] == 0:
            raise OSError(28, "No space left on device")
        n = real(fd, bytes(data[:room[0]]))
        room[0] -= n
        return n

    monkeypatch.setattr(os, "write", write)
    return room


def test_a_failed_write_keeps_every_record_for_the_next_flush(tmp_path: Path, monkeypatch) -> None:
    """A full disk stops a flush mid-line: the flush raises, and the unwritten records (the rest
    of that line included) go out with the next successful flush, in order, as whole lines."""
    path = tmp_path / "leases.journal"
    journal = LeaseJournal.open(path)
    start = process_start(os.getpid()) or 0

    async def run() -> None:  # as in the daemon: records buffered per event-loop tick
        journal.acquired("one", KEY, os.getpid(), start, 0)
        journal.flush()
        room = _full_disk_after(monkeypatch, 30)  # part of the next line only
        journal.acquired("two", KEY, os.getpid(), start, 0)
        journal.released("one")
        try:
            journal.flush()
            raise AssertionError("the flush did not report the full disk")
        except OSError as exc:
            assert exc.errno == 28
        await asyncio.sleep(0)  # the tick's flush fails too: logged, records kept
        assert journal.failures == 2
        journal.acquired("three", KEY, os.getpid(), start, 0)
        room.clear()  # the disk was freed
        await asyncio.sleep(0)
        assert journal.failures == 0

    asyncio.run(run())
    assert [(e["op"], e["lease"]) for e in _lines(path)] == [
        ("acquire", "one"), ("acquire", "two"), ("release", "one"), ("acquire", "three")]
    journal.close()
    assert sorted(h.lease_id for h in LeaseJournal.open(path).recovered) == ["three", "two"]


def test_a_failed_compaction_keeps_the_journal_and_leaves_no_temp_file(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "leases.journal"
    journal = LeaseJournal.open(path)
    start = process_start(os.getpid()) or 0
    journal.acquired("held", KEY, os.getpid(), start, 0)
    journal.flush()
    before = path.read_bytes()
    room = _full_disk_after(monkeypatch, 0)
    try:
        journal._compact()
        raise AssertionError("the compaction did not report the full disk")
    except OSError as exc:
        assert exc.errno == 28
    room.clear()
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["leases.journal"]
    journal.close()
    assert [h.lease_id for h in LeaseJournal.open(path).recovered] == ["held"]


def test_compaction_runs_off_the_event_loop_and_keeps_what_was_written_meanwhile(tmp_path: Path) -> None:
    """A journal of many live leases is compacted in a worker thread: the flush that starts it
    returns at once, the loop serves (and writes records) while it runs, and the compacted
    journal holds the snapshot plus every record written meanwhile."""
    path = tmp_path / "leases.journal"
    journal = LeaseJournal.open(path)
    pid, start = os.getpid(), process_start(os.getpid()) or 0
    live = 60_000

    async def run() -> tuple[bool, bool, int]:
        for i in range(live):
            journal.acquired(f"held{i}", KEY, pid, start, 0)
        journal.flush()
        # Churn until the file passes its bound: the flush that passes it starts a compaction.
        i = 0
        while journal._since is None:
            journal.acquired(f"churn{i}", KEY, pid, start, 0)
            journal.released(f"churn{i}")
            journal.flush()
            i += 1
        in_flight_after_flush = journal._since is not None
        served: list[bool] = []
        # While the thread writes the snapshot, the loop runs and records keep coming.
        asyncio.get_running_loop().call_soon(lambda: served.append(journal._since is not None))
        journal.released("held0")
        journal.acquired("late", KEY, pid, start, 7)
        await asyncio.sleep(0)
        while journal._since is not None:
            await asyncio.sleep(0.01)
        return in_flight_after_flush, served == [True], journal._lines

    in_flight, loop_served_meanwhile, lines = asyncio.run(run())
    assert in_flight and loop_served_meanwhile
    assert lines < live + 100  # compacted: the churn is gone
    journal.close()
    holds = {h.lease_id: h for h in LeaseJournal.open(path).recovered}
    assert "held0" not in holds and "late" in holds and len(holds) == live
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
