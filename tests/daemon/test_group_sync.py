"""Group commit of the artifacts/ directory fsync (``store_io.GroupSync``): a caller is released
only by an fsync that started after it arrived, a failed round fails every caller it covered, and
concurrent commits through a real Store share rounds and all land complete."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import pytest
import torch

from hwr.client.identity import ArtifactIdentity
from hwr.daemon.store import fileio as store_io
from hwr.daemon.store.fileio import GroupSync
from hwr.daemon.store.root import StagedTensor, Store


class GatedFsync:
    """Replaces ``store_io.fsync`` (the OS boundary): each call waits for its gate to open."""

    def __init__(self, fail_call: int | None = None) -> None:
        self.calls: list[threading.Event] = []
        self.started = threading.Semaphore(0)
        self.fail_call = fail_call
        self.lock = threading.Lock()

    def __call__(self, fd: int) -> None:
        gate = threading.Event()
        with self.lock:
            self.calls.append(gate)
            index = len(self.calls)
        self.started.release()
        assert gate.wait(10)
        if index == self.fail_call:
            raise OSError(errno.EIO, "injected")


def _run(sync: GroupSync, results: dict[str, object], name: str) -> threading.Thread:
    def target() -> None:
        try:
            sync.sync()
            results[name] = "ok"
        except OSError as exc:
            results[name] = exc.errno
    thread = threading.Thread(target=target)
    thread.start()
    return thread


def _wait_for_waiters(sync: GroupSync, joined: int) -> None:
    for _ in range(1000):
        with sync._lock:
            if sync.joined >= joined:
                return
        threading.Event().wait(0.005)
    raise AssertionError("callers did not arrive")


def test_a_round_in_flight_does_not_cover_later_callers_and_the_next_covers_them_all(
        short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = GatedFsync()
    monkeypatch.setattr(store_io, "fsync", fake)
    sync = GroupSync(short_tmp)
    results: dict[str, object] = {}
    first = _run(sync, results, "first")
    assert fake.started.acquire(timeout=10)  # round 1 is in its fsync
    late = [_run(sync, results, f"late{i}") for i in range(3)]
    _wait_for_waiters(sync, 3)
    fake.calls[0].set()  # round 1 ends: it must release only "first"
    first.join(10)
    assert results == {"first": "ok"}
    assert fake.started.acquire(timeout=10)  # one late caller leads round 2 for all three
    assert results == {"first": "ok"}
    fake.calls[1].set()
    for thread in late:
        thread.join(10)
    assert results == {"first": "ok", "late0": "ok", "late1": "ok", "late2": "ok"}
    assert len(fake.calls) == 2 and sync.rounds == 2


def test_a_failed_round_fails_every_caller_it_covered(short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = GatedFsync(fail_call=2)
    monkeypatch.setattr(store_io, "fsync", fake)
    sync = GroupSync(short_tmp)
    results: dict[str, object] = {}
    first = _run(sync, results, "first")
    assert fake.started.acquire(timeout=10)
    late = [_run(sync, results, f"late{i}") for i in range(2)]
    _wait_for_waiters(sync, 2)
    fake.calls[0].set()
    assert fake.started.acquire(timeout=10)
    fake.calls[1].set()
    for thread in [first, *late]:
        thread.join(10)
    assert results == {"first": "ok", "late0": errno.EIO, "late1": errno.EIO}
    results.clear()
    after = _run(sync, results, "after")  # a new caller gets a new round, not the old error
    assert fake.started.acquire(timeout=10)
    fake.calls[2].set()
    after.join(10)
    assert results == {"after": "ok"}


def test_concurrent_commits_share_directory_fsyncs_and_all_land(short_tmp: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Eight commits arrive while the first one's artifacts/ fsync is in flight (held at the OS
    boundary until the other seven wait on it): they must share one following round, two
    directory fsyncs in all instead of eight, and every artifact lands complete."""
    real_fsync_dir = store_io.fsync_dir
    with Store.open(short_tmp / "store") as store:
        sync = store._artifacts_sync
        first_round = threading.Event()

        def hold_the_first_round(path: Path) -> None:
            if Path(path) == sync.path and not first_round.is_set():
                first_round.set()
                for _ in range(2000):  # up to 10 s for the other seven commits to arrive
                    with sync._lock:
                        if sync.joined - joined_before >= 7:
                            break
                    threading.Event().wait(0.005)
            real_fsync_dir(path)

        monkeypatch.setattr(store_io, "fsync_dir", hold_the_first_round)
        stagings = [store.installer.begin(ArtifactIdentity.simple(f"group-{i}"),
                                          [StagedTensor("w", torch.float32, (64,))])
                    for i in range(8)]
        rounds_before, joined_before = sync.rounds, sync.joined
        barrier = threading.Barrier(len(stagings))
        records: list[object] = []

        def commit(staging) -> None:  # type: ignore[no-untyped-def]
            barrier.wait()
            records.append(store.installer.commit(staging))

        threads = [threading.Thread(target=commit, args=(s,)) for s in stagings]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert len(records) == 8
        assert sorted(os.listdir(store.root / "artifacts")) == sorted(s.key for s in stagings)
        rounds, joined = sync.rounds - rounds_before, sync.joined - joined_before
        assert (rounds, joined) == (2, 7), f"8 concurrent commits ran {rounds} directory fsyncs ({joined} joined)"
    with Store.open(short_tmp / "store") as reopened:  # every one validates after a restart
        assert len(reopened.records.artifacts()) == 8 and reopened.start_report == []


def test_a_mark_is_covered_only_by_a_round_that_started_after_it_and_succeeded(
        short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = GatedFsync(fail_call=2)
    monkeypatch.setattr(store_io, "fsync", fake)
    sync = GroupSync(short_tmp)
    results: dict[str, object] = {}
    first = _run(sync, results, "first")
    assert fake.started.acquire(timeout=10)  # round 1 is in flight
    mark = sync.mark()  # a rename made now may have missed round 1
    fake.calls[0].set()
    first.join(10)
    assert not sync.covered(mark), "a round in flight at the mark must not cover it"
    failing = _run(sync, results, "failing")
    assert fake.started.acquire(timeout=10)
    fake.calls[1].set()  # round 2 fails: still not covered
    failing.join(10)
    assert results["failing"] == errno.EIO and not sync.covered(mark)
    ok = _run(sync, results, "ok")
    assert fake.started.acquire(timeout=10)
    fake.calls[2].set()
    ok.join(10)
    assert sync.covered(mark) and not sync.covered(sync.mark())


def test_deleting_retired_artifacts_reuses_a_later_commits_fsync(short_tmp: Path) -> None:
    spec = [StagedTensor("w", torch.float32, (64,))]
    with Store.open(short_tmp / "store") as store:
        for name in ("old-a", "old-b", "new"):
            if name != "new":
                store.installer.commit(store.installer.begin(ArtifactIdentity.simple(name), spec))
        trash = [store.retirement.retire(ArtifactIdentity.simple(n).key) for n in ("old-a", "old-b")]
        rounds = store._artifacts_sync.rounds
        store.retirement.delete(trash[:1])  # nothing synced since its retirement: one round here
        assert store._artifacts_sync.rounds == rounds + 1 and not trash[0].exists()
        # its install syncs artifacts/
        store.installer.commit(store.installer.begin(ArtifactIdentity.simple("new"), spec))
        rounds = store._artifacts_sync.rounds
        store.retirement.delete(trash[1:])  # covered by the commit's round: no fsync of its own
        assert store._artifacts_sync.rounds == rounds and not trash[1].exists()
        assert os.listdir(store.root / "tmp") == []
    with Store.open(short_tmp / "store") as reopened:
        assert [r.key for r in reopened.records.artifacts()] == [ArtifactIdentity.simple("new").key]
