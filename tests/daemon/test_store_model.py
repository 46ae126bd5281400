"""A hypothesis state machine of the lease/eviction/pin/admission model (pure policies).

The model keeps artifacts with sizes and last-access times, leases, pins, mappings and
reservations; publications ask ``capacity.assess`` for room and evict with ``eviction.plan``.
Invariants: nothing leased, pinned or mapped is ever evicted; committed + reserved bytes never
exceed the store limit; what is evicted is always the least recently used evictable artifact.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hwr.client.errors import ArtifactTooLarge, StoreLimitExceeded
from hwr.daemon.policy.capacity import CapacityPolicy, Reservations, Usage, assess
from hwr.daemon.policy.deadline import overdue
from hwr.daemon.policy.eviction import Candidate, plan

LIMIT = 100


class StoreModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.policy = CapacityPolicy(store_limit_bytes=LIMIT, artifact_limit_bytes=60)
        self.sizes: dict[str, int] = {}
        self.access: dict[str, float] = {}
        self.leases: dict[str, int] = {}
        self.pins: set[str] = set()
        self.mapped: set[str] = set()
        self.reservations = Reservations()
        self.live_reservations: list = []
        self.clock = 0.0
        self.counter = 0

    def _tick(self) -> float:
        self.clock += 1.0
        return self.clock

    def _usage(self) -> Usage:
        return Usage(sum(self.sizes.values()), self.reservations.reserved_bytes,
                     self.reservations.unallocated_bytes, 10**9)

    @rule(size=st.integers(1, 70))
    def publish(self, size: int) -> None:
        key = f"k{self.counter}"
        self.counter += 1
        try:
            shortfall = assess(self.policy, self._usage(), size, key=key)
        except (ArtifactTooLarge, StoreLimitExceeded):
            assert size > 60
            return
        if shortfall:
            candidates = [Candidate(k, n, self.access[k], leased=self.leases.get(k, 0) > 0, pinned=k in self.pins,
                                    mapped=k in self.mapped) for k, n in self.sizes.items()]
            chosen = plan(candidates, shortfall)
            evictable = sorted((c for c in candidates if not (c.leased or c.pinned or c.mapped)),
                               key=lambda c: (c.last_access, c.key))
            assert list(chosen.keys) == [c.key for c in evictable[:len(chosen.keys)]]  # LRU prefix
            for k in chosen.keys:
                assert not self.leases.get(k) and k not in self.pins and k not in self.mapped
                del self.sizes[k]
            if not chosen.fits:
                assert assess(self.policy, self._usage(), size, key=key) > 0
                return
        assert assess(self.policy, self._usage(), size, key=key) == 0
        reservation = self.reservations.add(key, size)
        self.live_reservations.append((reservation, key, size))

    @precondition(lambda self: self.live_reservations)
    @rule(data=st.data(), commit=st.booleans())
    def finish_publication(self, data: st.DataObject, commit: bool) -> None:
        i = data.draw(st.integers(0, len(self.live_reservations) - 1))
        reservation, key, size = self.live_reservations.pop(i)
        self.reservations.drop(reservation)
        if commit:
            self.sizes[key] = size
            self.access[key] = self._tick()

    @precondition(lambda self: self.sizes)
    @rule(data=st.data())
    def acquire(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.sizes)))
        self.leases[key] = self.leases.get(key, 0) + 1
        self.access[key] = self._tick()

    @precondition(lambda self: any(self.leases.values()))
    @rule(data=st.data(), keep_mapping=st.booleans())
    def release(self, data: st.DataObject, keep_mapping: bool) -> None:
        key = data.draw(st.sampled_from(sorted(k for k, n in self.leases.items() if n)))
        self.leases[key] -= 1
        if keep_mapping:  # the process mapped it and its session died
            self.mapped.add(key)

    @precondition(lambda self: self.mapped)
    @rule(data=st.data())
    def process_exits(self, data: st.DataObject) -> None:
        self.mapped.discard(data.draw(st.sampled_from(sorted(self.mapped))))

    @precondition(lambda self: self.sizes)
    @rule(data=st.data(), pin=st.booleans())
    def toggle_pin(self, data: st.DataObject, pin: bool) -> None:
        key = data.draw(st.sampled_from(sorted(self.sizes)))
        (self.pins.add if pin else self.pins.discard)(key)

    @invariant()
    def never_over_limit(self) -> None:
        assert sum(self.sizes.values()) + self.reservations.reserved_bytes <= LIMIT

    @invariant()
    def in_use_artifacts_exist(self) -> None:
        for key, n in self.leases.items():
            if n:
                assert key in self.sizes
        assert self.mapped <= set(self.sizes)


StoreModel.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestStoreModel = StoreModel.TestCase


@pytest.mark.parametrize(("started", "now", "deadline", "expected"), [
    ([("a", 0.0), ("b", 5.0)], 10.0, 6.0, ["a"]),
    ([("a", 0.0)], 10.0, 0.0, []),
])
def test_overdue(started: list[tuple[str, float]], now: float, deadline: float, expected: list[str]) -> None:
    assert overdue(started, now, deadline) == expected
