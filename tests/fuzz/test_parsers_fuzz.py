"""Fuzzing the parsers of untrusted bytes: safetensors headers, manifest.json, READY.json and
identity JSON. Each must return a value or raise its typed error (``ManifestCorrupt``,
``ManifestIncompatible``, ``IdentityError``: all ``HwrError``), never anything else, and a value
it accepts must round-trip.

Quick size (CI): 150 examples per property. Long size::

    HWR_FUZZ_EXAMPLES=20000 .venv/bin/python -m pytest tests/fuzz -q
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hwr.client.errors import HwrError
from hwr.client.identity import ArtifactIdentity
from hwr.client.manifest import FileRecord, Manifest, ReadyMarker, TensorRecord
from hwr.client.safetensors_header import parse_header

from .fuzzkit import checked

EXAMPLES = int(os.environ.get("HWR_FUZZ_EXAMPLES", "150"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)


def _mutate(document: Any, path: list[Any], value: Any) -> Any:
    """Replace (or delete, for ``value is _DELETE``) the node at ``path`` in a JSON document."""
    if not path:
        return None if value is _DELETE else value
    head, rest = path[0], path[1:]
    if isinstance(document, dict) and document:
        key = sorted(document)[head % len(document)]
        out = dict(document)
        if not rest and value is _DELETE:
            del out[key]
        else:
            out[key] = _mutate(document[key], rest, value)
        return out
    if isinstance(document, list) and document:
        out = list(document)
        if not rest and value is _DELETE:
            del out[head % len(out)]
        else:
            out[head % len(out)] = _mutate(document[head % len(document)], rest, value)
        return out
    return None if value is _DELETE else value


_DELETE = object()
mutation = st.tuples(st.lists(st.integers(0, 50), min_size=1, max_size=4), json_values | st.just(_DELETE))


# ------------------------------------------------------------------------------ safetensors header
def _header(entries: dict[str, Any], pad: int = 0) -> bytes:
    raw = json.dumps(entries).encode() + b" " * pad
    return struct.pack("<Q", len(raw)) + raw


# Raw bytes almost never carry a plausible length prefix and an opening brace, so half the inputs
# are framed that way: the JSON decoding itself then sees the random bytes too.
_framed = st.binary(max_size=400).map(lambda body: struct.pack("<Q", len(body) + 1) + b"{" + body)


@FUZZ
@given(st.binary(max_size=400) | _framed, st.integers(0, 1 << 20))
def test_header_parser_on_random_bytes(data: bytes, extra: int) -> None:
    with checked("safetensors header (random bytes)"):
        try:
            parse_header(data, len(data) + extra)
        except HwrError as exc:
            assert exc.code == "MANIFEST_CORRUPT"


@FUZZ
@given(st.dictionaries(st.text(max_size=8), st.fixed_dictionaries({
    "dtype": st.sampled_from(["F32", "BF16", "F16", "I64", "U8", "F8_E4M3", "BOOL", "X", ""]) | json_values,
    "shape": st.lists(st.integers(-2, 70), max_size=3) | json_values,
    "data_offsets": st.lists(st.integers(-8, 600), min_size=0, max_size=3) | json_values,
}), max_size=4), st.integers(0, 9), st.integers(0, 700))
def test_header_parser_on_structured_headers(entries: dict[str, Any], pad: int, data_size: int) -> None:
    with checked("safetensors header (structured)"):
        head = _header(entries, pad)
        try:
            header = parse_header(head, len(head) + data_size)
        except HwrError as exc:
            assert exc.code == "MANIFEST_CORRUPT"
            return
        # Accepted: the entries tile the data section exactly.
        assert sum(e.end - e.begin for e in header.entries) == data_size


# ------------------------------------------------------------------------------ manifest / marker
def _valid_manifest() -> Manifest:
    identity = ArtifactIdentity.simple("fuzz-model")
    tensors = [TensorRecord("w", "parameter", "weight", "model-00001.safetensors", "w", (2, 2), "torch.float32",
                            (2, 1), 16, "a" * 64)]
    files = [FileRecord("model-00001.safetensors", 100, "b" * 64)]
    return Manifest.build(identity, tensors, files)


VALID = _valid_manifest()
VALID_DOC = json.loads(VALID.to_json())


def test_the_seed_documents_parse() -> None:
    assert Manifest.from_json(VALID.to_json()).key == VALID.key
    marker = ReadyMarker.for_manifest(VALID.to_json(), VALID, "p1")
    assert ReadyMarker.from_json(marker.to_json()) == marker


@FUZZ
@given(mutation)
def test_manifest_parser_on_mutated_manifests(change: tuple[list[int], Any]) -> None:
    path, value = change
    try:
        data = json.dumps(_mutate(VALID_DOC, path, value), sort_keys=True, separators=(",", ":")).encode()
    except ValueError:
        return  # not JSON-encodable (NaN etc.): nothing to parse, not counted
    with checked("manifest.json (mutated)"):
        try:
            manifest = Manifest.from_json(data)
        except HwrError as exc:
            assert exc.code in ("MANIFEST_CORRUPT", "MANIFEST_INCOMPATIBLE"), exc
            return
        assert manifest.to_json() == data


@FUZZ
@given(st.binary(max_size=300) | json_values.map(lambda v: json.dumps(v).encode()))
def test_manifest_and_marker_parsers_on_random_documents(data: bytes) -> None:
    with checked("manifest.json / READY.json (random)"):
        for parse in (Manifest.from_json, ReadyMarker.from_json):
            try:
                parse(data)
            except HwrError as exc:
                assert exc.code in ("MANIFEST_CORRUPT", "MANIFEST_INCOMPATIBLE"), exc


# ------------------------------------------------------------------------------ identity JSON
IDENTITY_DOC = ArtifactIdentity.simple("fuzz-model").to_dict()


@FUZZ
@given(mutation | json_values.map(lambda v: ([], v)))
def test_identity_from_dict_on_mutated_and_random_json(change: tuple[list[int], Any]) -> None:
    with checked("identity JSON"):
        path, value = change
        document = _mutate(IDENTITY_DOC, path, value)
        try:
            identity = ArtifactIdentity.from_dict(document)
        except HwrError as exc:
            assert exc.code == "INVALID_IDENTITY", exc
            return
        again = ArtifactIdentity.from_dict(json.loads(json.dumps(identity.to_dict())))
        assert again.key == identity.key and len(identity.key) == 64
