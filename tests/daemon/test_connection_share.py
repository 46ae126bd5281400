"""The node-wide connection budget shared between uids (``hwr.daemon.policy.connection_share``)."""

from __future__ import annotations

from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from hwr.daemon.policy.connection_share import ShareVerdict, connection_budget, share_verdict


def test_the_budget_is_a_share_of_the_open_files_limit() -> None:
    assert connection_budget(2048, 3, 0.5, 16) == 341
    assert connection_budget(1024, 3, 0.5, 16) == 170
    assert connection_budget(20, 3, 0.5, 16) == 16  # never below the minimum


def test_below_the_budget_everyone_gets_in() -> None:
    assert share_verdict({1: 5, 2: 3}, 3, 10) == ShareVerdict(True)


def test_at_the_budget_the_biggest_holder_gives_way_to_a_smaller_one() -> None:
    assert share_verdict({1: 7, 2: 3}, 3, 10) == ShareVerdict(True, 1)
    assert share_verdict({1: 4, 2: 3, 3: 3}, 3, 10) == ShareVerdict(False)  # 4 > 3 + 1 fails: fair already
    assert share_verdict({1: 10}, 1, 10) == ShareVerdict(False)  # the only holder: nobody to take from
    assert share_verdict({1: 5, 2: 5}, 3, 10) == ShareVerdict(True, 1)  # ties: the lowest uid


@given(st.lists(st.integers(min_value=0, max_value=7), min_size=1, max_size=400), st.integers(4, 40))
def test_held_stays_within_the_budget_and_a_smaller_holder_always_gets_in(arrivals: list[int], budget: int) -> None:
    held: Counter[int] = Counter()
    for uid in arrivals:
        bigger = any(count > held[uid] + 1 for other, count in held.items() if other != uid)
        verdict = share_verdict(held, uid, budget)
        assert verdict.admit == (sum(held.values()) < budget or bigger)
        if verdict.shed_uid is not None:
            assert verdict.shed_uid != uid and held[verdict.shed_uid] > held[uid] + 1
            held[verdict.shed_uid] -= 1
        if verdict.admit:
            held[uid] += 1
        assert sum(held.values()) <= budget
