"""The fleet tier's pure parts: the ``remote`` setting and the verdict on a remote's documents.

``plan_from_documents`` decides, from READY.json and manifest.json alone, whether a remote
artifact may be fetched; the documents here come from a real store's publication.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from hwr.client.errors import ConfigError, ManifestCorrupt
from hwr.client.identity import ArtifactIdentity
from hwr.daemon.fleet.pull import plan_from_documents
from hwr.daemon.fleet.remote import RemoteObjectInvalid, parse_location
from hwr.daemon.store.root import Store


def test_locations_parse_and_print_without_secrets() -> None:
    s3 = parse_location("s3://models-cache/fleet/v1/", endpoint_url="http://127.0.0.1:9000", region="eu-west-1")
    assert (s3.scheme, s3.bucket, s3.prefix, s3.display) == ("s3", "models-cache", "fleet/v1",
                                                             "s3://models-cache/fleet/v1")
    assert s3.object_name("a" * 64, "READY.json") == f"fleet/v1/artifacts/{'a' * 64}/READY.json"
    assert parse_location("s3://models-cache").object_name("b" * 64, "m.safetensors") == \
        f"artifacts/{'b' * 64}/m.safetensors"
    f = parse_location("file:///mnt/shared/hwr/")
    assert (f.scheme, f.prefix, f.display) == ("file", "/mnt/shared/hwr", "file:///mnt/shared/hwr")
    with pytest.raises(ValueError):
        s3.object_name("../etc", "x")
    with pytest.raises(ValueError):
        s3.object_name("a" * 64, "../x")


@pytest.mark.parametrize("url", [
    "s3://AKIAEXAMPLE:secret@bucket/p",  # credentials never in the URL
    "s3://user@bucket/p",
    "s3://B/p",  # not a bucket name
    "s3://bucket/a/../b",
    "http://bucket/p",
    "file://relative/path",
    "file:///a/../b",
    "s3://bucket/p?x=1",
])
def test_bad_locations_are_refused_naming_the_key(url: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_location(url)
    assert info.value.details["key"] == "remote"
    assert "secret" not in str(info.value)


def test_endpoint_with_credentials_is_refused() -> None:
    with pytest.raises(ConfigError) as info:
        parse_location("s3://bucket/p", endpoint_url="http://k:s@127.0.0.1:9000")
    assert info.value.details["key"] == "remote_endpoint_url"


def _published(tmp: Path, model: str) -> tuple[str, bytes, bytes]:
    with Store.open(tmp / model.replace("/", "-")) as store:
        record = store.installer.publish(ArtifactIdentity.simple(model), {"w": torch.arange(4096, dtype=torch.float32),
                                                                          "b": torch.ones(16, dtype=torch.bfloat16)})
        path = store.root / "artifacts" / record.key
        return record.key, (path / "READY.json").read_bytes(), (path / "manifest.json").read_bytes()


def test_documents_of_a_real_publication_give_its_layout(tmp_path: Path) -> None:
    key, ready, manifest = _published(tmp_path, "remote/plan")
    plan = plan_from_documents(key, ready, manifest, "s3://b/p")
    assert plan.manifest.key == key
    assert [name for name, _ in plan.files] == ["model-00001.safetensors"]
    assert plan.size_bytes == plan.manifest.files[0].size
    assert sorted(s.name for s in plan.specs) == ["b", "w"]


def test_refusals(tmp_path: Path) -> None:
    key, ready, manifest = _published(tmp_path, "remote/one")
    _other, other_ready, other_manifest = _published(tmp_path, "remote/two")
    cases = {
        "swapped manifest": (key, ready, other_manifest),
        "another identity": (key, other_ready, other_manifest),
        "missing manifest": (key, ready, None),
        "malformed READY.json": (key, b"{not json", manifest),
        "malformed manifest": (key, _marker_for(b"{}"), b"{}"),
    }
    for why, (k, r, m) in cases.items():
        with pytest.raises(RemoteObjectInvalid) as info:
            plan_from_documents(k, r, m, "s3://b/p")
        assert isinstance(info.value, ManifestCorrupt), why
        assert info.value.details == {"key": k, "remote": "s3://b/p"}, why
        assert "s3://b/p" in info.value.message, why


def test_a_layout_hwrd_would_not_write_is_refused(tmp_path: Path) -> None:
    key, _ready, manifest = _published(tmp_path, "remote/layout")
    doc = json.loads(manifest)
    doc["files"][0]["size"] += 8  # a consistent-looking manifest whose payload is not the planned one
    changed = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    with pytest.raises(RemoteObjectInvalid, match="layout"):
        plan_from_documents(key, _marker_for(changed, doc["artifact_content_sha256"]), changed, "file:///x")


def _marker_for(manifest: bytes, content: str = "0" * 64) -> bytes:
    doc = {"artifact_content_sha256": content, "integrity_mode": "full_checksum",
           "manifest_sha256": hashlib.sha256(manifest).hexdigest(), "publication_id": "p", "schema_version": 1}
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
