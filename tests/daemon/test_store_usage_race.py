"""Regression: ``Capacity.usage`` never misses a commit that lands while it reads the store.

A publication renames its artifact into ``artifacts/`` and only then drops its reservation. When
the usage read the disk first and the reservations afterwards, a commit landing in between was
in neither, and a concurrent publication could reserve past the store limit (seen as four 1 MiB
artifacts on disk under a three-artifact limit in the concurrent-publications test, now in
tests/service/test_store_lifecycle.py). Here the commit is made to land exactly in that window,
deterministically, with a real store.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import threading
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest
import torch

from hwr.client.identity import ArtifactIdentity
from hwr.daemon.app.graph import ServiceGraph
from hwr.daemon.service.capacity import Capacity
from hwr.daemon.service.housekeeping import Housekeeping
from hwr.daemon.service.settings import RunningSettings
from hwr.daemon.store.root import Store
from hwr.daemon.store.staging import StagedTensor, write_tensor
from hwr.daemon.system.config import load_config


def test_a_commit_between_the_disk_read_and_the_reservation_drop_is_still_counted(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "root")
    config = SimpleNamespace(store_limit_bytes=0, artifact_limit_bytes=0, min_free_bytes=0,
                             serialized_admission=False, mlock_budget_bytes=0)
    tensor = torch.ones(1 << 12)

    async def scenario() -> tuple[int, int]:
        service = _capacity(config, store)
        loop = asyncio.get_running_loop()
        identity = ArtifactIdentity.simple("racing")
        staging = store.installer.begin(identity, [StagedTensor("w", tensor.dtype, tuple(tensor.shape))])
        write_tensor(staging, "w", tensor)
        reservation = service.reservations.add(identity.key, staging.files[0][2])
        real = store.usage.total

        def count_then_commit() -> int:
            counted = real()  # the artifact is still staging: not in this count
            store.installer.commit(staging)  # ... it lands right after, and the publication finishes
            dropped = threading.Event()
            loop.call_soon_threadsafe(lambda: (service.reservations.drop(reservation), dropped.set()))
            # ``usage`` reads the count on the loop itself (then the drop can only run after it
            # returns, which is the point) or in a worker thread (then the drop lands now).
            if threading.current_thread() is not threading.main_thread():
                assert dropped.wait(10)
            return counted

        store.usage.total = count_then_commit  # type: ignore[method-assign]
        try:
            usage = await service.usage()
        finally:
            store.usage.total = real  # type: ignore[method-assign]
            service.evictor.holds.close()
        return usage.committed_bytes + usage.reserved_bytes, staging.files[0][2]

    try:
        counted, size = asyncio.run(scenario())
    finally:
        store.close()
    assert size > 0 and counted >= size


def test_retired_bytes_of_a_publication_that_never_commits_are_deleted_or_left_for_the_next_start(
        tmp_path: Path) -> None:
    """``finished`` deletes the trash a failed/aborted publication still holds (purge pool); once
    the service is stopped it leaves it in ``tmp/`` (wiped at the next start) instead of raising."""
    from hwr.daemon.service.capacity import Claim

    store = Store.open(tmp_path / "root")
    config = SimpleNamespace(store_limit_bytes=0, artifact_limit_bytes=0, min_free_bytes=0,
                             serialized_admission=False, mlock_budget_bytes=0, scrub_bandwidth_mib_s=0)
    tensor = torch.ones(64)
    for name in ("a", "b"):
        staging = store.installer.begin(ArtifactIdentity.simple(name),
                                        [StagedTensor("w", tensor.dtype, tuple(tensor.shape))])
        write_tensor(staging, "w", tensor)
        store.installer.commit(staging)

    async def scenario() -> tuple[list[str], list[str]]:
        service = _capacity(config, store)
        ledger = service.reservations
        first = Claim("k1", False, ledger.add("k1", 1),
                      [store.retirement.retire(ArtifactIdentity.simple("a").key)], True)
        service.finished(first, committed=False)
        service.purger.pool.shutdown(wait=True)  # the deletion ran in the pool
        after_first = sorted(p.name for p in (store.root / "tmp").iterdir())
        second = Claim("k2", False, ledger.add("k2", 1),
                       [store.retirement.retire(ArtifactIdentity.simple("b").key)], True)
        service.finished(second, committed=False)  # pool shut down: no exception, trash stays
        service.evictor.holds.close()
        return after_first, sorted(p.name for p in (store.root / "tmp").iterdir())

    try:
        after_first, after_second = asyncio.run(scenario())
    finally:
        store.close()
    assert after_first == []
    assert len(after_second) == 1 and ".removed." in after_second[0]
    with Store.open(tmp_path / "root") as reopened:  # the next start wipes it
        assert list((reopened.root / "tmp").iterdir()) == [] and reopened.records.artifacts() == []


def _capacity(config: SimpleNamespace, store: Store) -> Capacity:
    """The store's ``Capacity`` as hwrd builds it (``ServiceGraph.build``), under ``config``'s values."""
    running = load_config(env={"HWR_ROOT": str(store.root), "HWR_SOCKET": str(store.root / "hwrd.sock")})
    settings = RunningSettings(msgspec.structs.replace(running, **vars(config)))
    return ServiceGraph.build(settings, store).capacity


def _publish(store: Store, name: str, elements: int) -> str:
    tensor = torch.full((elements,), 1.0)
    staging = store.installer.begin(ArtifactIdentity.simple(name),
                                    [StagedTensor("w", tensor.dtype, tuple(tensor.shape))])
    write_tensor(staging, "w", tensor)
    return store.installer.commit(staging).key


def _on_disk(store: Store) -> dict[str, int]:
    """Payload bytes per artifacts/ entry, read from the files (what the accounting must equal)."""
    out = {}
    for entry in (store.root / "artifacts").iterdir():
        out[entry.name] = sum(f.stat().st_size for f in entry.iterdir() if f.name.endswith(".safetensors"))
    return out


def test_the_in_memory_usage_equals_the_disk_under_concurrent_commits_retirements_and_rescans(
        tmp_path: Path, caplog: object) -> None:
    """Four threads publish and retire while a fifth rescans: a committed artifact is counted as
    soon as ``commit`` returns and until ``retire`` returns, and at the end the accounting is the
    disk's, with no rescan ever finding a difference (no "behind the daemon's back" warning)."""
    store = Store.open(tmp_path / "root")
    errors: list[str] = []
    stop = threading.Event()

    def worker(n: int) -> None:
        try:
            for i in range(25):
                key = _publish(store, f"w{n}-{i}", 256 * (1 + (i % 4)))
                if key not in store.usage.by_key():
                    errors.append(f"{key[:12]} committed but not counted")
                if i % 2:
                    store.retirement.delete([store.retirement.retire(key)])
                    if key in store.usage.by_key():
                        errors.append(f"{key[:12]} retired but still counted")
        except Exception as exc:  # reported on the main thread
            errors.append(repr(exc))

    def rescanner() -> None:
        while not stop.is_set():
            store.rescan_usage()

    caplog.set_level(logging.WARNING, logger="hwrd.store")  # type: ignore[attr-defined]
    scan = threading.Thread(target=rescanner)
    scan.start()
    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        stop.set()
        scan.join()
    try:
        assert errors == []
        expected = _on_disk(store)
        assert len(expected) == 4 * 12 + 4 * (25 % 2)  # the even-numbered ones stay
        assert store.usage.by_key() == expected
        assert store.usage.total() == sum(expected.values())
        assert "behind the daemon" not in caplog.text  # type: ignore[attr-defined]
    finally:
        store.close()


def test_a_rescan_counts_what_changed_behind_the_daemons_back(tmp_path: Path, caplog: object) -> None:
    store = Store.open(tmp_path / "root")
    try:
        kept = _publish(store, "kept", 1024)
        gone = _publish(store, "gone", 2048)
        counted = store.usage.total()
        assert counted == sum(_on_disk(store).values()) > 4 * (1024 + 2048)
        stray = ArtifactIdentity.simple("copied in").key
        shutil.copytree(store.root / "artifacts" / kept, store.root / "artifacts" / stray)
        (store.root / "artifacts" / gone).chmod(0o755)  # as an operator with rights would
        shutil.rmtree(store.root / "artifacts" / gone)
        assert store.usage.total() == counted  # memory only until a rescan
        caplog.set_level(logging.WARNING, logger="hwrd.store")  # type: ignore[attr-defined]
        sizes = store.rescan_usage()
        assert set(sizes) == {kept, stray}
        assert sizes[stray] >= 4 * 1024  # an unvalidated entry counts every file in it
        assert store.usage.total() == sum(sizes.values())
        assert "1 entries appeared" in caplog.text and "1 vanished" in caplog.text  # type: ignore[attr-defined]
    finally:
        store.close()


def test_publishing_and_retiring_leave_no_per_key_files_in_locks(tmp_path: Path) -> None:
    """Key exclusion is in memory: months of churn must not grow ``locks/`` by one file per key
    (earlier versions did; their leftovers are deleted at the next start)."""
    root = tmp_path / "root"
    with Store.open(root) as store:
        for i in range(20):
            key = _publish(store, f"k{i}", 64)
            if i % 2:
                store.remove(key)
        assert sorted(p.name for p in (root / "locks").iterdir()) == ["daemon.lock"]
    leftover = root / "locks" / f"{ArtifactIdentity.simple('old').key}.artifact"
    leftover.write_bytes(b"")
    (root / "locks" / "unrelated.lock").write_bytes(b"")  # not ours to delete
    with Store.open(root) as store:
        assert sorted(p.name for p in (root / "locks").iterdir()) == ["daemon.lock", "unrelated.lock"]
        assert len(store.records.artifacts()) == 10


def test_publications_waiting_for_room_are_woken_one_at_a_time_in_arrival_order(tmp_path: Path) -> None:
    """When room appears, only the oldest waiter tries again (and passes the turn on when it
    leaves), and a request that arrives while others wait queues behind them without a try:
    eight waiters cost about one futile try per hand-over, and they get their reservations in
    the order they arrived."""
    store = Store.open(tmp_path / "root")
    unit = 1 << 20
    config = SimpleNamespace(store_limit_bytes=unit, artifact_limit_bytes=0, min_free_bytes=0,
                             serialized_admission=False, mlock_budget_bytes=0, scrub_bandwidth_mib_s=0)

    async def scenario() -> tuple[list[str], list[int]]:
        service = _capacity(config, store)
        tries = 0
        real = service.evictor.round

        async def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
            nonlocal tries  # one eviction round per try that finds no room
            tries += 1
            return await real(*args, **kwargs)

        service.evictor.round = counted  # type: ignore[method-assign]
        holder = service.reservations.add("holder", unit)  # all the room, in flight
        served: list[str] = []

        async def publication(name: str) -> None:
            reservation, _, _ = await service.reserve(name, unit, wait_timeout=30)
            served.append(name)
            await asyncio.sleep(0.01)
            service.reservations.drop(reservation)  # as ``finished`` does
            service.signal_room()

        names = [f"p{i}" for i in range(8)]
        tasks = []
        for name in names:
            tasks.append(asyncio.create_task(publication(name)))
            await asyncio.sleep(0.005)  # arrival order
        await asyncio.sleep(0.05)
        waiting_tries = tries
        tries = 0
        service.reservations.drop(holder)
        service.signal_room()
        await asyncio.wait_for(asyncio.gather(*tasks), 30)
        service.evictor.holds.close()
        return served, [waiting_tries, tries]

    try:
        served, (waiting_tries, tries) = asyncio.run(scenario())
    finally:
        store.close()
    assert served == [f"p{i}" for i in range(8)]
    assert waiting_tries == 1  # the first tries and waits; the others queue behind it untried
    # Only tries that find no room run an eviction round: each hand-over lets the next waiter
    # try once while the one served still holds the room (7), then succeed. Waking every waiter
    # at each release costs 7 + 6 + ... + 1 = 28 (measured with the earlier wake-all code, which
    # also tried each arrival: 8 before the first release).
    assert 7 <= tries <= 9, tries


def test_a_lookup_that_races_a_quarantine_reports_the_deny_not_a_missing_artifact(tmp_path: Path, monkeypatch) -> None:
    """Regression (seen once in CI under load): a lookup that passed the deny check while a
    scrub was denying and quarantining the artifact found it gone and said ArtifactNotFound.
    It must hand back the record and let ``open_payloads`` say what the artifact is now."""
    import hwr.daemon.store.records as store_module
    from hwr.client.errors import ArtifactDenied, ChecksumMismatch

    store = Store.open(tmp_path / "root")
    try:
        key = _publish(store, "raced", 1024)
        real = store_module.inspect_artifact

        def inspect_then_quarantine(path, key_, euid):  # type: ignore[no-untyped-def]
            record = real(path, key_, euid)
            # The scrub's verify lands here: deny first, then move the directory aside.
            store.records.deny_for(key_, ChecksumMismatch("flipped", details={"key": key_}))
            store.denylist.quarantine(path, "checksum", key_)
            return record

        store.records.drop(key)  # as verify does first: the next lookup inspects the disk
        monkeypatch.setattr(store_module, "inspect_artifact", inspect_then_quarantine)
        record = store.records.lookup(key)
        with pytest.raises(ArtifactDenied):
            store.records.open_payloads(record)
        assert key not in store.usage.by_key()
    finally:
        store.close()


def test_a_failed_rescan_keeps_the_accounting_and_the_next_one_works(tmp_path: Path, monkeypatch) -> None:
    store = Store.open(tmp_path / "root")
    try:
        key = _publish(store, "kept", 256)
        before = store.usage.by_key()
        real = store._scan_sizes

        def failing() -> dict[str, int]:
            raise OSError(5, "EIO")

        monkeypatch.setattr(store, "_scan_sizes", failing)
        with pytest.raises(OSError):
            store.rescan_usage()
        monkeypatch.setattr(store, "_scan_sizes", real)
        assert store.usage.by_key() == before and store.usage._touched is None
        assert store.rescan_usage() == before and key in before
    finally:
        store.close()


def test_the_reservation_ledger_keeps_its_sums_and_key_index_exact() -> None:
    """The running sums (read at every admission) equal a recount after any mix of adds, marks
    (repeated ones included), drops (repeated ones and unknown ones included)."""
    import random

    from hwr.daemon.policy.capacity import Reservations

    rng = random.Random(7)
    ledger = Reservations()
    live = []
    for _ in range(2000):
        action = rng.random()
        if action < 0.4 or not live:
            live.append(ledger.add(f"k{rng.randrange(5)}", rng.randrange(1, 1000)))
        elif action < 0.7:
            ledger.mark_allocated(rng.choice(live))
        else:
            gone = live.pop(rng.randrange(len(live)))
            ledger.drop(gone)
            ledger.drop(gone if rng.random() < 0.5 else None)  # idempotent
            ledger.mark_allocated(gone)  # a late mark of an ended reservation changes nothing
        assert ledger.reserved_bytes == sum(r.nbytes for r in live)
        assert ledger.unallocated_bytes == sum(r.nbytes for r in live if not r.allocated)
        assert {k for k in (f"k{i}" for i in range(5)) if ledger.holds(k)} == {r.key for r in live}
        assert len(ledger) == len(live)


def test_take_added_names_each_new_record_once_and_listed_hides_denied_ones(tmp_path: Path) -> None:
    """The daemon's LRU index learns of artifacts from ``take_added`` (every key validated at
    start, then each commit or lookup that adds one) and reads them with ``listed``."""
    root = tmp_path / "root"
    with Store.open(root) as store:
        first = _publish(store, "first", 256)
        assert store.records.take_added() == [first]
        assert store.records.take_added() == []
        second = _publish(store, "second", 256)
        store.deny(first, "bad")
        assert store.records.listed(first) is None and store.records.listed(second) is not None
        assert store.records.take_added() == [second]
        store.records.allow(first)
        store.records.lookup(first)  # re-validated: a record again
        assert store.records.take_added() == [first] and store.records.listed(first) is not None
    with Store.open(root) as reopened:
        assert sorted(reopened.records.take_added()) == sorted([first, second])


def test_housekeeping_feeds_the_lru_index_without_eviction_rounds(tmp_path: Path) -> None:
    """With no store limit no eviction round runs; the housekeeping tick still drains the store's
    added keys into the LRU index, so that list does not grow with every commit."""
    store = Store.open(tmp_path / "root")
    config = SimpleNamespace(store_limit_bytes=0, artifact_limit_bytes=0, min_free_bytes=0,
                             serialized_admission=False, mlock_budget_bytes=0, scrub_bandwidth_mib_s=0.0,
                             housekeeping_interval_s=0.05, publication_deadline_s=3600.0)

    async def scenario() -> tuple[list[str], int]:
        service = _capacity(config, store)
        tick = asyncio.get_running_loop().create_task(
            Housekeeping(config, store, service.evictor.holds, service.recency).run(None))
        try:
            for i in range(5):
                await asyncio.to_thread(_publish, store, f"kept-{i}", 256)
            await asyncio.sleep(0.3)  # several ticks
            return store.records.take_added(), len(service.recency.lru)
        finally:
            tick.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await tick
            service.recency.access.flush()
            service.evictor.holds.close()
            service.close()

    try:
        left, indexed = asyncio.run(scenario())
    finally:
        store.close()
    assert left == [] and indexed == 5
