"""The one key-prefix resolver (pure): what resolves, and the typed error of each refusal."""

from __future__ import annotations

import pytest

from hwr.client.errors import ArtifactNotFound, CheckpointNotFound, InvalidRequest
from hwr.daemon.checkpoints.files import resolve_checkpoint_prefix
from hwr.daemon.policy.key_prefix import is_prefix, unique_prefix

A = "ab" * 32
B = "ac" * 32


def test_a_unique_prefix_or_the_whole_key_resolves() -> None:
    assert unique_prefix("abab", [A, B]) == A
    assert unique_prefix(A, [A, B]) == A
    assert unique_prefix("abab", [A, A]) == A  # a key listed twice (two sources) is one key


@pytest.mark.parametrize("text", ["aba", "ABAB", "abxz", "a" * 65, ""])
def test_a_malformed_prefix_is_invalid_request_naming_the_field(text: str) -> None:
    assert not is_prefix(text)
    with pytest.raises(InvalidRequest) as info:
        unique_prefix(text, [A])
    assert info.value.details == {"key": text[:80]}


def test_no_match_and_ambiguous_are_distinct_typed_errors() -> None:
    with pytest.raises(ArtifactNotFound) as missing:
        unique_prefix("dddd", [A, B])
    assert missing.value.details == {"key": "dddd"}
    with pytest.raises(InvalidRequest) as ambiguous:
        unique_prefix("abab", [A, "abab" + "0" * 60])
    assert ambiguous.value.details["matches"] == 2


def test_checkpoint_ids_use_the_same_resolver_with_their_own_errors() -> None:
    assert resolve_checkpoint_prefix("abab", [A, B]) == A
    with pytest.raises(CheckpointNotFound):
        resolve_checkpoint_prefix("dddd", [A])
    with pytest.raises(InvalidRequest, match="ambiguous checkpoint id prefix"):
        resolve_checkpoint_prefix("abab", [A, "abab" + "1" * 60])
    with pytest.raises(InvalidRequest, match="nor an absolute registered path") as info:
        resolve_checkpoint_prefix("xyz!", [A])
    assert info.value.details == {"checkpoint": "xyz!"}
