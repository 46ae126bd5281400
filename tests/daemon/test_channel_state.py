"""Channel state transitions (pure) and what a restart keeps of them: property tests over random
sequences of durable and non-durable changes, checked against a plain model."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hwr.client.channels import valid_channel_name
from hwr.daemon.policy.channel_state import HISTORY, ChannelState, document, moved, protected_keys, restored

KEYS = [f"{i:064x}" for i in range(1, 7)]
NAMES = ["flux-rl", "a", "b.c_d-9"]

changes = st.lists(st.tuples(st.sampled_from(NAMES), st.sampled_from(KEYS), st.booleans()), max_size=40)


def apply(seq: list[tuple[str, str, bool]]) -> tuple[dict[str, ChannelState], int]:
    states: dict[str, ChannelState] = {}
    counter = 0
    for name, key, durable in seq:
        counter += 1
        states[name] = moved(states.get(name), name, key, counter, float(counter), "operator", durable)
    return states, counter


@given(changes)
def test_a_restart_keeps_exactly_the_last_durable_key_of_each_channel(seq: list[tuple[str, str, bool]]) -> None:
    states, counter = apply(seq)
    # the model: per channel, its last durable key, and whether a non-durable change came after it
    last_durable: dict[str, str] = {}
    after: dict[str, bool] = {}
    for name, key, durable in seq:
        if durable:
            last_durable[name] = key
        after[name] = not durable
    doc = json.loads(json.dumps(document(states.values(), counter)))  # what the file holds
    result = restored(doc, now=1e9)
    assert {n: s.key for n, s in result.states.items()} == last_durable
    assert sorted(result.fell_back) == sorted(n for n in last_durable if after[n])
    assert sorted(result.vanished) == sorted(n for n in after if n not in last_durable)
    assert not result.malformed
    # generations only grow: a fallback is a new change, above every generation seen before
    assert result.counter == counter + len(result.fell_back)
    for name in result.fell_back:
        state = result.states[name]
        assert state.generation > counter and state.history[-1].set_by == "fallback" and state.durable
    for name, state in result.states.items():
        # The history survives whole (non-durable entries marked so), plus the fallback entry.
        kept = states[name].history
        assert state.history == ((*kept, state.history[-1])[-HISTORY:] if name in result.fell_back else kept)
        assert len(state.history) <= HISTORY
        assert [e.generation for e in state.history] == sorted(e.generation for e in state.history)


@given(changes)
def test_the_current_and_the_last_durable_key_of_each_channel_are_protected(
        seq: list[tuple[str, str, bool]]) -> None:
    states, _ = apply(seq)
    expected = {s.key for s in states.values()} | {s.durable_key for s in states.values() if s.durable_key}
    assert protected_keys(states.values()) == expected
    for state in states.values():
        assert state.history[-1].key == state.key
        assert len(state.history) == min(HISTORY, state.switches)


def test_a_document_that_is_not_one_is_refused_and_a_malformed_entry_dropped() -> None:
    for doc in ([], {"schema_version": 2, "generation": 0, "channels": {}}, {"schema_version": 1}):
        with pytest.raises(ValueError):
            restored(doc, 0.0)
    states, counter = apply([("a", KEYS[0], True)])
    doc = document(states.values(), counter)
    doc["channels"]["../etc"] = dict(doc["channels"]["a"])
    doc["channels"]["b"] = {**doc["channels"]["a"], "history": [{"key": "x"}]}
    result = restored(doc, 0.0)
    assert list(result.states) == ["a"] and sorted(result.malformed) == ["../etc", "b"]


@pytest.mark.parametrize("name, ok", [("flux-rl", True), ("a", True), ("9.x_y-z", True), ("x" * 64, True),
                                      ("x" * 65, False), ("", False), ("Flux", False), ("-a", False),
                                      (".a", False), ("a/b", False), ("a b", False), ("ä", False), (7, False)])
def test_channel_names_are_a_small_safe_alphabet(name: object, ok: bool) -> None:
    assert valid_channel_name(name) is ok
