"""Store policies end to end: background scrub at a bandwidth cap, serialized admission, the pin
mlock budget, publications that wait for room held by publications in flight, and acquires and
pins that race evictions.

Real hwrd processes; the only timing assertions are lower bounds that a slow machine cannot break
(a capped scrub cannot finish faster than its cap allows) or generous upper bounds on waits.
"""

from __future__ import annotations

import functools
import json
import os
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hwr.client import ArtifactIdentity, Client, connect
from hwr.client.errors import ActiveBuildTimeout, ArtifactDenied, ArtifactNotFound, StoreLimitExceeded
from hwr.client.publisher import specs_for

from .helpers import rot_a_byte

MIB = 1 << 20


@pytest.mark.usefixtures("daemon_user")  # root and the unit's unprivileged user
def test_background_scrub_at_a_bandwidth_cap_quarantines_a_flipped_byte(spawn_daemon) -> None:
    daemon = spawn_daemon()
    with connect(daemon.socket) as client:
        good = client.publish(ArtifactIdentity.simple("scrub-good"), {"w": torch.ones(1 << 18)})
        bad = client.publish(ArtifactIdentity.simple("scrub-bad"), {"w": torch.full((1 << 20,), 2.0)})
    daemon.stop()
    rot_a_byte(Path(daemon.root) / "artifacts" / bad / "model-00001.safetensors", 3 * MIB)
    cap = 2.0  # MiB/s: the bad artifact's 4 MiB payload is hashed twice (file + tensor) = 8 MiB
    daemon = spawn_daemon("--scrub-bandwidth-mib-s", str(cap), "--scrub-interval-s", "1")  # same root
    started = time.monotonic()
    with connect(daemon.socket) as client:
        with client.acquire(bad):  # metadata still validates: only a re-hash can tell
            pass
        deadline = started + 60
        while True:
            try:
                with client.acquire(bad):
                    pass
            except ArtifactDenied:
                break
            assert time.monotonic() < deadline, "the scrub never caught the flipped byte"
            time.sleep(0.2)
        elapsed = time.monotonic() - started
        # The scrub paces itself: 8 MiB at 2 MiB/s cannot take less than ~4 s (+1 s first delay).
        assert elapsed >= 8 / cap * 0.8, elapsed
        assert any(e.startswith(bad) for e in os.listdir(Path(daemon.root) / "quarantine"))
        with client.acquire(good) as lease:
            assert float(lease.tensors["w"][0]) == 1.0


def test_serialized_admission_lets_one_publication_build_at_a_time(spawn_daemon) -> None:
    daemon = spawn_daemon("--serialized-admission", "true")
    tensors = {"w": torch.zeros(1024)}
    with connect(daemon.socket) as first, connect(daemon.socket) as second:
        pub = first.publisher(ArtifactIdentity.simple("serial-a"), specs_for(tensors))
        pub.write("w", tensors["w"])
        # Another identity cannot start while the first is building: a short wait times out, typed.
        with pytest.raises(ActiveBuildTimeout) as timed_out:
            second.publish(ArtifactIdentity.simple("serial-b"), tensors, wait_timeout=0.5)
        assert timed_out.value.details.get("serialized") is True
        done: list[str] = []
        waiter = threading.Thread(target=lambda: done.append(
            second.publish(ArtifactIdentity.simple("serial-c"), tensors, wait_timeout=30)))
        waiter.start()
        time.sleep(1.0)
        assert not done, "a second publication built while the first still held the slot"
        pub.commit()
        waiter.join(30)
        assert done == [ArtifactIdentity.simple("serial-c").key]
        assert second.status()["publications"] == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="mlock beyond RLIMIT_MEMLOCK needs root (CAP_IPC_LOCK)")
def test_pins_lock_pages_within_the_mlock_budget(spawn_daemon) -> None:
    size = 4 * MIB + 136  # one 1Mi-float32 tensor and its header
    daemon = spawn_daemon("--mlock-budget-bytes", str(size + size // 2))

    def vm_lck_kib() -> int:
        with open(f"/proc/{daemon.pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmLck:"))

    with connect(daemon.socket) as client:
        a = client.publish(ArtifactIdentity.simple("pin-a"), {"w": torch.ones(1 << 20)})
        b = client.publish(ArtifactIdentity.simple("pin-b"), {"w": torch.ones(1 << 20)})
        before = vm_lck_kib()
        first = client.pin(a)
        assert first["residency"] == "locked" and first["locked_bytes"] == size
        assert vm_lck_kib() - before >= size // 1024
        second = client.pin(b)  # does not fit in what is left of the budget: resident, not locked
        assert second["residency"] == "prefaulted" and second["locked_bytes"] == 0
        assert client.store_usage()["locked_bytes"] == size
        client.unpin(a)
        assert client.store_usage()["locked_bytes"] == 0
        assert vm_lck_kib() <= before
        client.unpin(b)


@pytest.mark.usefixtures("daemon_user")  # root and the unit's unprivileged user
def test_a_publication_waits_for_room_held_by_publications_in_flight(spawn_daemon) -> None:
    art = 2 * MIB + 136
    limit = art + art // 2
    daemon = spawn_daemon("--store-limit-bytes", str(limit))
    big = {"w": torch.zeros(1 << 19)}  # 2 MiB: two of them do not fit under the limit at once
    with connect(daemon.socket) as first, connect(daemon.socket) as second:
        pub = first.publisher(ArtifactIdentity.simple("room-a"), specs_for(big))
        pub.write("w", big["w"])
        # Reserve a second 2 MiB: 2 + 2 > 3 MiB with nothing committed to evict. Without a wait it
        # is refused at once (typed); with one it proceeds as soon as the first commits (its
        # bytes become committed and, unused, evictable).
        with pytest.raises(StoreLimitExceeded):
            second.publish(ArtifactIdentity.simple("room-c"), big, wait_timeout=0)
        t0 = time.monotonic()
        with pytest.raises(StoreLimitExceeded):
            second.publish(ArtifactIdentity.simple("room-c"), big, wait_timeout=0.6)
        assert time.monotonic() - t0 >= 0.5  # it waited for its timeout before giving up
        done: list[str] = []
        waiter = threading.Thread(target=lambda: done.append(
            second.publish(ArtifactIdentity.simple("room-d"), big, wait_timeout=30)))
        waiter.start()
        time.sleep(0.5)
        assert not done
        key_a = pub.commit()
        waiter.join(30)
        assert done == [ArtifactIdentity.simple("room-d").key]
        usage = second.store_usage()
        assert usage["store_bytes"] <= limit and usage["reserved_bytes"] == 0
        # The first, committed and unused, was evicted (LRU) to make room for the waiter.
        assert {a["key"] for a in usage["artifacts"]} == {done[0]} and key_a != done[0]


ELEMENTS = 1 << 12  # float32 elements of the race tests' artifacts (16 KiB)


def _publish_until(daemon, stop: float, seed: int, keys: list[str], failures: list[BaseException],
                   before_each: Callable[[Client], None] = lambda client: None) -> None:
    """One client publishing new artifacts until ``stop`` (appending their keys), each publication
    evicting in a store with room for a few; ``before_each`` runs first each time."""
    try:
        with connect(daemon.socket) as client:
            n = 0
            while time.monotonic() < stop:
                before_each(client)
                n += 1
                keys.append(client.publish(ArtifactIdentity.simple(f"race-{seed}-{n}"),
                                           {"w": torch.full((ELEMENTS,), float(n))}, wait_timeout=30))
    except BaseException as exc:  # reported by the caller's assertion
        failures.append(exc)


def _run_threads(*targets: Callable[[], None]) -> None:
    threads = [threading.Thread(target=t) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)


@pytest.mark.usefixtures("daemon_user")  # root and the unit's unprivileged user
def test_acquires_racing_evictions_never_deny_an_artifact(spawn_daemon) -> None:
    """Clients acquire artifacts that other clients' publications are evicting (a store with
    room for 4): an acquire either leases the artifact or gets ArtifactNotFound. An eviction
    caught half done by a lookup once wrote a deny marker (MANIFEST_CORRUPT, "artifact changed
    since it was validated"), after which the identity could not be published again."""
    daemon = spawn_daemon("--store-limit-bytes", str(4 * (ELEMENTS * 4 + 136)))
    keys: list[str] = []
    counts = {"leased": 0, "not_found": 0}
    failures: list[BaseException] = []

    def acquire_newest(client: Client) -> None:
        for key in keys[-6:]:  # the newest: most are about to be evicted, some are gone
            try:
                with client.acquire(key):
                    counts["leased"] += 1
            except ArtifactNotFound:
                counts["not_found"] += 1

    stop = time.monotonic() + 6.0
    _run_threads(*(functools.partial(_publish_until, daemon, stop, i, keys, failures, acquire_newest)
                   for i in range(4)))
    assert not failures, failures
    assert len(keys) > 20 and counts["leased"] > 20, (len(keys), counts)
    assert sorted(os.listdir(Path(daemon.root) / "deny")) == [], "an eviction was mistaken for corruption"
    with connect(daemon.socket) as client:
        # Every identity can still be published (evicted ones again: nothing was denied).
        for seed in range(4):
            client.publish(ArtifactIdentity.simple(f"race-{seed}-1"), {"w": torch.full((ELEMENTS,), 1.0)})


def test_republished_identities_racing_evictions_are_never_denied(spawn_daemon) -> None:
    """Six clients publish and acquire the same ten identities in a store with room for five,
    so each key is evicted and published again all the time. A lookup that inspected the
    evicted directory could cache its record over the new one's; every later lookup then found
    the artifact "changed since it was validated" and denied it (3 identities in 30 s)."""
    daemon = spawn_daemon("--store-limit-bytes", str(5 * (ELEMENTS * 4 + 136)))
    failures: list[BaseException] = []
    counts = {"published": 0, "leased": 0}
    stop = time.monotonic() + 8.0

    def client_loop(seed: int) -> None:
        rng = random.Random(seed)
        try:
            with connect(daemon.socket) as client:
                while time.monotonic() < stop:
                    n = rng.randrange(10)
                    identity = ArtifactIdentity.simple(f"republished-{n}")
                    if rng.random() < 0.5:
                        client.publish(identity, {"w": torch.full((ELEMENTS,), float(n))}, wait_timeout=30)
                        counts["published"] += 1
                        continue
                    try:
                        with client.acquire(identity) as lease:
                            assert float(lease.tensors["w"][3]) == float(n)
                            counts["leased"] += 1
                    except ArtifactNotFound:
                        pass
        except BaseException as exc:  # reported by the assertion below
            failures.append(exc)

    _run_threads(*(functools.partial(client_loop, i) for i in range(6)))
    assert not failures, failures[:3]
    assert counts["published"] > 50 and counts["leased"] > 20, counts
    assert sorted(os.listdir(Path(daemon.root) / "deny")) == []


def test_pins_racing_evictions_pin_a_present_artifact_or_nothing(spawn_daemon) -> None:
    """An operator pins the newest artifact while publications evict (room for 5): a pin that
    succeeds keeps its artifact until unpinned, and a pin that fails (the artifact was evicted
    first) leaves no pin behind. Before the fix, a pin added between an eviction's choice and
    its rename failed with ArtifactNotFound yet stayed in pins.json, for an artifact gone."""
    daemon = spawn_daemon("--store-limit-bytes", str(5 * (ELEMENTS * 4 + 136)))
    pins_file = Path(daemon.root) / "pins.json"
    keys: list[str] = []
    failures: list[BaseException] = []
    counts = {"pinned": 0, "not_found": 0}
    problems: list[str] = []
    stop = time.monotonic() + 6.0

    def pinner() -> None:
        try:
            with connect(daemon.socket) as client:
                while time.monotonic() < stop:
                    if not keys:
                        time.sleep(0.01)
                        continue
                    key = keys[-1]
                    try:
                        client.pin(key)
                    except ArtifactNotFound:
                        counts["not_found"] += 1
                        if pins_file.exists() and key in json.loads(pins_file.read_text())["pins"]:
                            problems.append(f"a failed pin of {key[:12]} stayed in pins.json")
                            client.unpin(key)
                        continue
                    counts["pinned"] += 1
                    time.sleep(0.005)  # publications keep evicting meanwhile
                    if key not in {a["key"] for a in client.list_artifacts()}:
                        problems.append(f"pinned {key[:12]} was evicted")
                    client.unpin(key)
        except BaseException as exc:  # reported by the assertion below
            failures.append(exc)

    _run_threads(pinner, *(functools.partial(_publish_until, daemon, stop, i, keys, failures) for i in range(4)))
    assert not failures, failures
    assert counts["pinned"] > 10, counts
    assert not problems, (problems[:5], len(problems), counts)
    assert json.loads(pins_file.read_text())["pins"] == []
