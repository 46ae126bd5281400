"""Strict manifest and marker documents."""

from __future__ import annotations

import json

import pytest

from hwr.client.errors import ManifestCorrupt, ManifestIncompatible
from hwr.client.identity import ArtifactIdentity
from hwr.client.manifest import FileRecord, Manifest, ReadyMarker, TensorRecord, content_digest

IDENTITY = ArtifactIdentity.simple("m")


def _tensor(name: str, file: str = "model-00001.safetensors") -> TensorRecord:
    return TensorRecord(
        name,
        "parameter",
        "weight",
        file=file,
        storage_key=name,
        shape=(2, 3),
        dtype="torch.bfloat16",
        stride=(3, 1),
        nbytes=12,
        sha256="a" * 64,
    )


def _manifest() -> Manifest:
    files = [FileRecord(name="model-00001.safetensors", size=100, sha256="b" * 64)]
    return Manifest.build(IDENTITY, [_tensor("b"), _tensor("a")], files)


def test_round_trip_and_upstream_field_names() -> None:
    m = _manifest()
    data = m.to_json()
    assert Manifest.from_json(data) == m and m.key == IDENTITY.key
    doc = json.loads(data)
    assert set(doc) == {
        "schema_version",
        "artifact_key",
        "identity",
        "producer_schema",
        "restorer_schema",
        "tensors",
        "files",
        "artifact_content_sha256",
        "format_metadata",
    }
    assert set(doc["tensors"][0]) == {
        "name",
        "kind",
        "role",
        "file_name",
        "storage_key",
        "shape",
        "dtype",
        "stride",
        "nbytes",
        "sha256",
    }
    marker = ReadyMarker.for_manifest(data, m, "pub")
    assert ReadyMarker.from_json(marker.to_json()) == marker


def test_digest_ignores_file_split() -> None:
    assert content_digest([_tensor("a"), _tensor("b")]) == content_digest([_tensor("b", "x.safetensors"), _tensor("a")])


def _mutate(edit) -> bytes:
    doc = json.loads(_manifest().to_json())
    edit(doc)
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


@pytest.mark.parametrize("edit", [
    lambda d: d["tensors"][0].update(nbytes=10),
    lambda d: d["tensors"][0].update(stride=[1, 2]),
    lambda d: d["tensors"][0].update(dtype="torch.complex64"),
    lambda d: d["tensors"][0].update(file_name="../x.safetensors"),
    lambda d: d["tensors"][0].update(sha256="c" * 64),  # content digest no longer matches
    lambda d: d["tensors"][0].update(extra=1),
    lambda d: d["tensors"][0].update(shape=[2, True]),
    lambda d: d.update(artifact_key="0" * 64),
    lambda d: d["tensors"].reverse(),
    lambda d: d["files"][0].update(file_name="READY.json"),
    lambda d: d["identity"]["source"].update(model_id=7),
    lambda d: d.pop("files"),
])  # fmt: skip
def test_inconsistent_manifests_are_corrupt(edit) -> None:
    with pytest.raises(ManifestCorrupt):
        Manifest.from_json(_mutate(edit))


def test_non_canonical_and_other_schema() -> None:
    data = _manifest().to_json()
    with pytest.raises(ManifestCorrupt):
        Manifest.from_json(data + b" ")
    with pytest.raises(ManifestIncompatible):
        Manifest.from_json(_mutate(lambda d: d.update(schema_version=2, newfield=1)))
