"""Who may create and repoint channels, the quotas, and the owner and uids in channels.json
(``hwr.daemon.policy.channel_rights``, ``channel_state``): pure."""

from __future__ import annotations

import json

import pytest

from hwr.client.errors import InvalidRequest, PermissionDeniedError
from hwr.daemon.policy.channel_rights import MAX_CHANNELS, MAX_OWNED_PER_UID, OPERATOR_RESERVE, Actor, owner_after
from hwr.daemon.policy.channel_state import document, moved, restored

ALICE, BOB = Actor(1000, False), Actor(1001, False)
OPERATOR = Actor(0, True)
KEY = "a" * 64


def test_a_publisher_owns_what_it_creates_and_repoints_only_that() -> None:
    assert owner_after(ALICE, "a", False, None, []) == 1000
    assert owner_after(ALICE, "a", True, 1000, [1000]) == 1000
    for owner in (1000, None):
        with pytest.raises(PermissionDeniedError) as refused:
            owner_after(BOB, "a", True, owner, [owner])
        assert refused.value.details["role"] == "operator" and refused.value.details["channel"] == "a"


def test_an_operator_repoints_anything_and_keeps_its_owner() -> None:
    assert owner_after(OPERATOR, "a", True, 1000, [1000]) == 1000
    assert owner_after(OPERATOR, "b", False, None, [1000]) is None
    assert owner_after(Actor(None, True), "a", True, None, [None]) is None


def test_quotas_one_uid_then_publishers_then_the_node() -> None:
    full = [1000] * MAX_OWNED_PER_UID
    with pytest.raises(InvalidRequest) as refused:
        owner_after(ALICE, "x", False, None, full)
    assert refused.value.details["reason"] == "CHANNELS_PER_UID"
    assert owner_after(BOB, "x", False, None, full) == 1001  # another uid is not charged for it
    publishers = [None] * (MAX_CHANNELS - OPERATOR_RESERVE)
    with pytest.raises(InvalidRequest) as refused:
        owner_after(BOB, "x", False, None, publishers)
    assert refused.value.details["reason"] == "CHANNELS_FOR_PUBLISHERS"
    assert owner_after(OPERATOR, "x", False, None, publishers) is None  # the operators' reserve
    with pytest.raises(InvalidRequest) as refused:
        owner_after(OPERATOR, "x", False, None, [None] * MAX_CHANNELS)
    assert refused.value.details["reason"] == "CHANNELS"
    assert owner_after(ALICE, "x", True, 1000, [1000] * MAX_CHANNELS) == 1000  # repointing is not creating


def test_owner_and_uids_survive_the_file_and_old_files_still_load() -> None:
    state = moved(None, "team", KEY, 1, 1.0, "publication", True, uid=1000, owner=1000)
    state = moved(state, "team", "b" * 64, 2, 2.0, "operator", True, uid=0, owner=None)
    assert state.owner == 1000  # an existing channel keeps its owner
    doc = json.loads(json.dumps(document([state], 2)))
    back = restored(doc, 3.0).states["team"]
    assert back.owner == 1000 and [e.uid for e in back.history] == [1000, 0]
    for item in doc["channels"].values():  # as written before owners and uids were recorded
        item.pop("owner")
        for entry in item["history"]:
            entry.pop("uid")
    old = restored(doc, 3.0)
    assert not old.malformed and old.states["team"].owner is None
    assert [e.uid for e in old.states["team"].history] == [None, None]


@pytest.mark.parametrize("field, value", [("owner", -1), ("owner", "1000"), ("owner", True), ("uid", 1 << 32)])
def test_a_bad_owner_or_uid_drops_that_channel_only(field: str, value: object) -> None:
    good = moved(None, "good", KEY, 1, 1.0, "publication", True, uid=5, owner=5)
    bad = moved(None, "bad", KEY, 2, 1.0, "publication", True, uid=5, owner=5)
    doc = json.loads(json.dumps(document([good, bad], 2)))
    target = doc["channels"]["bad"]
    if field == "owner":
        target["owner"] = value
    else:
        target["history"][0]["uid"] = value
    result = restored(doc, 3.0)
    assert result.malformed == ["bad"] and list(result.states) == ["good"]
