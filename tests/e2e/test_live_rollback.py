"""Live updates, rollbacks: a channel that goes back to the revision workers run is followed.

Real hwrd, real worker processes (``live_worker.py``, as in ``test_live_updates.py``), real gloo
groups for AllGather. A channel goes A -> B -> A while the workers still hold B as a pending
revision (prepared, not yet run): the return to A cancels B, whose lease is released at once, and
no pass ever runs on B. Under load (a pass every ~20 ms) the channel flips between two revisions
many times and settles: every worker converges to the channel's final key within a bounded time,
no pass fails, every pass equals a fresh model of the revision it says it ran on, and the
abandoned revision is evictable.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from hwr.client import connect
from hwr.daemon.app.launcher import DaemonProcess

from .test_live_updates import Publisher, live_workers, until

# A worker holds B pending for up to this long (its pause between passes): time enough for the
# channel to go back before B would run.
SLOW_PACE_S = 1.5
FAST_PACE_S = 0.02
FLIPS = 12
# After the channel's last change every worker runs its key within this bound (a watch's
# announcement, an acquire, a prepare and one pass; generous for a loaded 2-core CI machine).
CONVERGE_S = 20.0


def lease_keys(client: Any, pids: Sequence[int]) -> dict[int, set[str]]:
    """The keys each worker pid holds a lease on, as hwrd reports them."""
    held: dict[int, set[str]] = {pid: set() for pid in pids}
    for lease in client.leases():
        if lease["pid"] in held:
            held[lease["pid"]].add(lease["key"])
    return held


def check_outputs(result: dict[str, Any], seed: int, publisher: Publisher) -> None:
    """No failed pass; each pass equals a fresh model of the revision it ran on."""
    assert result["failures"] == []
    for key, out, _, _ in result["passes"]:
        assert key in publisher.want, f"a pass ran on {key}, which was never a good revision"
        assert out == publisher.want[key][seed], f"worker {seed}: a pass on {key[:12]} differs from a fresh model"


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("allgather", [False, True], ids=["rank-local", "allgather-dp2"])
def test_a_return_to_the_running_revision_cancels_the_pending_one(
    hwrd: DaemonProcess, short_tmp: Path, allgather: bool
) -> None:
    seeds = [41, 42]
    channel = f"rollback{'-ag' if allgather else ''}"
    with connect(hwrd.socket) as client:
        publisher = Publisher(client, channel, seeds)
        first = publisher.publish(0)
        with live_workers(hwrd, short_tmp, channel, seeds, allgather=allgather,
                          **{f"worker{r}": {"pace_s": SLOW_PACE_S} for r in range(len(seeds))}) as running:
            pids = [w.proc.pid for w in running]
            until(lambda: all(w.on == first for w in running), "every worker runs A")
            second = publisher.publish(1)
            # Every worker acquired B (its follower prepares it as pending) ...
            until(lambda: all(second in keys for keys in lease_keys(client, pids).values()),
                  "every worker holds B", timeout=60)
            # ... and the channel goes straight back to A, before the workers' next pass.
            client.set_channel(channel, first)
            until(lambda: all(keys == {first} for keys in lease_keys(client, pids).values()),
                  "every worker released B", timeout=60)
            client.evict(second)  # raises ActiveLease if a worker still held or mapped B
            time.sleep(2 * SLOW_PACE_S)  # more passes: still on A
            assert all(w.on == first for w in running)
            results = [worker.stop() for worker in running]
    for seed, result in zip(seeds, results, strict=True):
        check_outputs(result, seed, publisher)
        assert {key for key, *_ in result["passes"]} == {first}, "a pass ran on the abandoned revision"
        assert result["key"] == first and result["switches"] == 0
        assert result["updates"] == 2  # B, then A handed over (the rollback), nothing more


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize("allgather", [False, True], ids=["rank-local", "allgather-dp2"])
@pytest.mark.parametrize("final", ["A", "B"])
def test_rapid_flips_under_load_settle_on_the_channels_last_key(
    hwrd: DaemonProcess, short_tmp: Path, allgather: bool, final: str
) -> None:
    seeds = [51, 52]
    channel = f"flips-{final.lower()}{'-ag' if allgather else ''}"
    rng = random.Random(7)
    with connect(hwrd.socket) as client:
        publisher = Publisher(client, channel, seeds)
        a = publisher.publish(0)
        b = publisher.publish(1)
        client.set_channel(channel, a)
        with live_workers(hwrd, short_tmp, channel, seeds, allgather=allgather,
                          **{f"worker{r}": {"pace_s": FAST_PACE_S} for r in range(len(seeds))}) as running:
            pids = [w.proc.pid for w in running]
            until(lambda: all(w.on == a for w in running), "every worker runs A")
            keys = [b, a] * FLIPS + ([b] if final == "B" else [])
            for key in keys:
                client.set_channel(channel, key)
                time.sleep(rng.uniform(0.0, 0.06))  # some flips land between passes, some inside one
            settled_at = time.monotonic()
            last, other = keys[-1], a if keys[-1] == b else b
            until(lambda: all(w.on == last for w in running), "every worker runs the channel's key", CONVERGE_S)
            until(lambda: all(held == {last} for held in lease_keys(client, pids).values()),
                  "the abandoned revision released", CONVERGE_S)
            client.evict(other)  # evictable: no worker holds or maps it
            converged_at = time.monotonic()
            time.sleep(1.0)  # about 50 more passes per worker
            results = [worker.stop() for worker in running]
    for seed, result in zip(seeds, results, strict=True):
        check_outputs(result, seed, publisher)
        assert result["key"] == last
        late = [began for key, _, began, _ in result["passes"] if key != last and began > converged_at]
        assert late == [], f"worker {seed}: {len(late)} passes on the superseded revision after the return"
        lag = max((began for key, _, began, _ in result["passes"] if key != last), default=settled_at) - settled_at
        print(f"worker {seed}: {len(result['passes'])} passes, {result['switches']} switches, last pass on the "
              f"superseded revision {max(lag, 0.0) * 1000:.0f} ms after the channel's last change")
    if allgather:  # the ranks switched at the same passes
        assert [p[0] for p in results[0]["passes"]] == [p[0] for p in results[1]["passes"]]
