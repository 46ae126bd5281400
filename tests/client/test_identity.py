"""Identity: canonical JSON, exact fields, and keys equal to vLLM-Omni's rule."""

from __future__ import annotations

import hashlib
import json
import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hwr.client.errors import HwrError, IdentityError, error_from_code
from hwr.client.identity import ArtifactIdentity, canonical_json, is_key, parse_canonical

BASE = ArtifactIdentity.simple("org/model", tp_size=4, tp_rank=3).to_dict()

json_scalars = st.none() | st.booleans() | st.integers(-(2**63), 2**63) | st.text(max_size=8) | st.floats(
    allow_nan=False, allow_infinity=False
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)


def _reference_key(d: dict) -> str:
    """The key rule written out independently: SHA-256 of sorted, compact, ASCII JSON."""
    data = json.dumps(d, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return hashlib.sha256(data.encode()).hexdigest()


@settings(max_examples=200, deadline=None)
@given(meta=json_values, model=st.text(min_size=1, max_size=20), rank=st.integers(0, 7))
def test_key_is_sha256_of_canonical_json(meta: object, model: str, rank: int) -> None:
    d = json.loads(json.dumps(BASE))
    d["source"]["model_id"] = model
    d["source"]["metadata"] = meta
    d["layout"]["tensor_parallel_size"] = 8
    d["layout"]["tensor_parallel_rank"] = rank
    identity = ArtifactIdentity.from_dict(d)
    assert identity.key == _reference_key(d)
    assert is_key(identity.key)
    assert ArtifactIdentity.from_canonical_bytes(identity.canonical_bytes) == identity
    assert ArtifactIdentity.from_dict(identity.to_dict()) == identity


@settings(max_examples=200, deadline=None)
@given(value=json_values)
def test_canonical_json_is_a_fixed_point(value: object) -> None:
    encoded = canonical_json(value)
    assert parse_canonical(encoded) == json.loads(encoded)
    assert canonical_json(json.loads(encoded)) == encoded


@pytest.mark.parametrize(
    "data",
    [b'{"a": 1}', b'{"b":1,"a":2}', b'{"a":"\xc3\xa9"}', b"[1,2,]", b'{"a":NaN}', b" {}"],
)
def test_non_canonical_bytes_are_rejected_not_reencoded(data: bytes) -> None:
    with pytest.raises(IdentityError):
        parse_canonical(data)


def _mutated(path: tuple[str, ...], value: object) -> dict:
    d = json.loads(json.dumps(BASE))
    node = d
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value
    return d


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("schema_version",), "1"),  # no coercion
        (("schema_version",), True),
        (("schema_version",), 0),
        (("layout", "tensor_parallel_rank"), 4),  # rank == size
        (("layout", "tensor_parallel_rank"), -1),
        (("layout", "tensor_parallel_size"), 0),
        (("layout", "tensor_parallel_size"), 4.0),
        (("source", "model_id"), ""),
        (("source", "model_id"), 7),
        (("adaptation", "kind"), "lora"),  # non-base without fingerprint
        (("source", "metadata"), float("nan")),
        (("source", "metadata"), {1: "x"}),
    ],
)
def test_invalid_fields_are_typed_errors(path: tuple[str, ...], value: object) -> None:
    with pytest.raises(IdentityError):
        ArtifactIdentity.from_dict(_mutated(path, value))


@pytest.mark.parametrize("section", [None, "source", "layout", "producer"])
def test_unknown_and_missing_fields_are_rejected(section: str | None) -> None:
    d = json.loads(json.dumps(BASE))
    target = d if section is None else d[section]
    target["dp_rank"] = 0
    with pytest.raises(IdentityError, match="unexpected"):
        ArtifactIdentity.from_dict(d)
    del target["dp_rank"]
    target.pop(next(iter(target)))
    with pytest.raises(IdentityError, match="missing"):
        ArtifactIdentity.from_dict(d)


def test_identity_is_frozen_and_hashable() -> None:
    a = ArtifactIdentity.from_dict(BASE)
    b = ArtifactIdentity.from_dict(json.loads(json.dumps(BASE)))
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    with pytest.raises(AttributeError):
        a.schema_version = 2  # type: ignore[misc]


def test_errors_pickle_and_map_back_from_codes() -> None:
    err = error_from_code("LOCAL_MISS", "no artifact", {"key": "ab"})
    assert type(err).__name__ == "ArtifactNotFound" and isinstance(err, LookupError)
    clone = pickle.loads(pickle.dumps(err))
    assert type(clone) is type(err) and clone.message == "no artifact" and clone.details == {"key": "ab"}
    unknown = error_from_code("SOMETHING_NEW", "later version")
    assert type(unknown) is HwrError and unknown.details["code"] == "SOMETHING_NEW"
