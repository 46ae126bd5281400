"""``LruIndex``: its walks give exactly ``sorted((last use, key))`` of the live keys, however notes,
forgets, partial walks and restores interleave (hypothesis), and its heap stays bounded."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from hwr.daemon.policy.recency import LruIndex

KEYS = st.sampled_from([f"k{i}" for i in range(12)])
TIMES = st.integers(0, 20).map(float)  # few values: ties (broken by key) are common
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("note"), KEYS, TIMES),
        st.tuples(st.just("forget"), KEYS, st.just(0.0)),
        # walk n entries, noting (key, time) halfway through, then restore what was walked
        st.tuples(st.just("walk"), st.integers(0, 14), st.tuples(KEYS, TIMES)),
    ),
    max_size=60,
)


def _full_walk(index: LruIndex) -> list[tuple[float, str]]:
    walk = index.pop_in_order()
    entries = list(walk)
    index.restore(entries)
    return entries


@settings(max_examples=300, deadline=None)
@given(OPS)
def test_walks_follow_the_sorted_order_of_the_live_keys(ops: list[tuple[str, object, object]]) -> None:
    index = LruIndex()
    model: dict[str, float] = {}
    for op, a, b in ops:
        if op == "note":
            index.note(a, b)  # type: ignore[arg-type]
            model[a] = b  # type: ignore[index,assignment]
        elif op == "forget":
            index.forget(a)  # type: ignore[arg-type]
            model.pop(a, None)  # type: ignore[call-overload]
        else:
            expected = sorted((t, k) for k, t in model.items())
            walk = index.pop_in_order()
            got = []
            rest: list[tuple[float, str]] = []
            for _ in range(a):  # type: ignore[call-overload]
                entry = next(walk, None)
                if entry is None:
                    break
                got.append(entry)
                if len(got) == 1:  # a use noted while the walk is under way
                    key, when = b  # type: ignore[misc]
                    index.note(key, when)
                    model[key] = when
                    # What follows: the live entries but the first key's (a new entry of it,
                    # noted just now, waits for the restore), the new note included.
                    rest = sorted((t, k) for k, t in model.items() if k != entry[1])
            walk.close()
            assert got[:1] == expected[: min(1, len(got))]
            assert got[1:] == rest[: len(got) - 1]
            index.restore(got)
        assert _full_walk(index) == sorted((t, k) for k, t in model.items())
        assert len(index) == len(model)


def test_stale_entries_are_dropped_so_the_heap_stays_bounded() -> None:
    index = LruIndex()
    for i in range(100):
        index.note(f"k{i}", float(i))
    for n in range(50_000):  # a busy node: every acquire re-notes a key
        index.note(f"k{n % 100}", 100.0 + n)
    assert len(index._heap) <= 2 * len(index) + LruIndex.SLACK + 1
    order = _full_walk(index)
    assert [k for _t, k in order] == [f"k{(50_000 - 100 + i) % 100}" for i in range(100)]


def test_a_forgotten_key_is_not_walked_and_a_renoted_one_only_at_its_new_place() -> None:
    index = LruIndex()
    for i, key in enumerate("abcd"):
        index.note(key, float(i))
    index.forget("b")
    index.note("a", 10.0)
    index.note("c", 2.0)  # the same time again: no second entry
    assert len(index._heap) == 3 + 2  # c, d, a live; the stale a@0 and the forgotten b wait
    assert _full_walk(index) == [(2.0, "c"), (3.0, "d"), (10.0, "a")]
    assert len(index._heap) == 3  # the walk dropped the stale ones
