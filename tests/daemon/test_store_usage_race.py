"""Regression: ``StoreService.usage`` never misses a commit that lands while it reads the disk.

A publication renames its artifact into ``artifacts/`` and only then drops its reservation. When
the usage read the disk first and the reservations afterwards, a commit landing in between was
in neither, and a concurrent publication could reserve past the store limit (seen as four 1 MiB
artifacts on disk under a three-artifact limit in tests/e2e/test_store_service.py). Here the
commit is made to land exactly in that window, deterministically, with a real store.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from types import SimpleNamespace

import torch

from hwr.client.identity import ArtifactIdentity
from hwr.daemon.sessions import Registry
from hwr.daemon.store import Store
from hwr.daemon.store_service import StoreService
from hwr.daemon.store_staging import TensorSpec, write_tensor


def test_a_commit_between_the_disk_read_and_the_reservation_drop_is_still_counted(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "root")
    config = SimpleNamespace(store_limit_bytes=0, artifact_limit_bytes=0, min_free_bytes=0,
                             serialized_admission=False, mlock_budget_bytes=0)
    tensor = torch.ones(1 << 12)

    async def scenario() -> tuple[int, int]:
        service = StoreService(config, store, Registry())
        loop = asyncio.get_running_loop()
        identity = ArtifactIdentity.simple("racing")
        staging = store.begin(identity, [TensorSpec("w", tensor.dtype, tuple(tensor.shape))])
        write_tensor(staging, "w", tensor)
        reservation = service.reservations.add(identity.key, staging.files[0][2])
        real = store.usage_by_key

        def listing_then_commit() -> dict[str, int]:
            sizes = real()  # the artifact is still staging: not in this listing
            store.commit(staging)  # ... it lands right after, and the publication finishes
            dropped = threading.Event()
            loop.call_soon_threadsafe(lambda: (service.reservations.drop(reservation), dropped.set()))
            # ``usage`` reads the disk on the loop itself (then the drop can only run after it
            # returns, which is the point) or in a worker thread (then the drop lands now).
            if threading.current_thread() is not threading.main_thread():
                assert dropped.wait(10)
            return sizes

        store.usage_by_key = listing_then_commit  # type: ignore[method-assign]
        try:
            usage = await service.usage()
        finally:
            store.usage_by_key = real  # type: ignore[method-assign]
            service.journal.close()
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
    from hwr.daemon.capacity import Reservations
    from hwr.daemon.store_service import Ticket

    store = Store.open(tmp_path / "root")
    config = SimpleNamespace(store_limit_bytes=0, artifact_limit_bytes=0, min_free_bytes=0,
                             serialized_admission=False, mlock_budget_bytes=0, scrub_bandwidth_mib_s=0)
    tensor = torch.ones(64)
    for name in ("a", "b"):
        staging = store.begin(ArtifactIdentity.simple(name), [TensorSpec("w", tensor.dtype, tuple(tensor.shape))])
        write_tensor(staging, "w", tensor)
        store.commit(staging)

    async def scenario() -> tuple[list[str], list[str]]:
        service = StoreService(config, store, Registry())
        ledger = Reservations()
        first = Ticket("k1", False, ledger.add("k1", 1), [store.retire(ArtifactIdentity.simple("a").key)], True)
        service.reservations = ledger
        service.finished(first, committed=False)
        service._purge_pool.shutdown(wait=True)  # the deletion ran in the pool
        after_first = sorted(p.name for p in (store.root / "tmp").iterdir())
        second = Ticket("k2", False, ledger.add("k2", 1), [store.retire(ArtifactIdentity.simple("b").key)], True)
        service.finished(second, committed=False)  # pool shut down: no exception, trash stays
        service.journal.close()
        return after_first, sorted(p.name for p in (store.root / "tmp").iterdir())

    try:
        after_first, after_second = asyncio.run(scenario())
    finally:
        store.close()
    assert after_first == []
    assert len(after_second) == 1 and ".removed." in after_second[0]
    with Store.open(tmp_path / "root") as reopened:  # the next start wipes it
        assert list((reopened.root / "tmp").iterdir()) == [] and reopened.artifacts() == []
