"""Every name, key and digest validator refuses a trailing newline (``re.match`` with ``$``
accepts ``"name\\n"``; the validators match the whole string)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hwr.client.channels import check_channel_name, valid_channel_name
from hwr.client.errors import ConfigError, InvalidRequest, ManifestCorrupt
from hwr.client.identity import is_key
from hwr.client.manifest import _check_sha, is_payload_name
from hwr.daemon.checkpoints.files import hf_blob_link
from hwr.daemon.policy.remote_location import parse_location
from hwr.daemon.system.metrics import label_value

KEY = "a" * 64


@pytest.mark.parametrize("tail", ["\n", "\r\n", "\n\n"])
def test_a_trailing_newline_is_refused_everywhere(tail: str) -> None:
    assert valid_channel_name("flux") and not valid_channel_name("flux" + tail)
    with pytest.raises(InvalidRequest):
        check_channel_name("flux" + tail)
    assert is_key(KEY) and not is_key(KEY + tail)
    assert is_payload_name("model-00001.safetensors") and not is_payload_name("model-00001.safetensors" + tail)
    _check_sha("sha256", KEY)
    with pytest.raises(ManifestCorrupt):
        _check_sha("sha256", KEY + tail)
    assert label_value("ok") == "ok"
    with pytest.raises(ValueError):
        label_value("ok" + tail)
    assert parse_location("s3://bucket-a/models").bucket == "bucket-a"
    for url in ("s3://bucket-a" + tail + "/models", "s3://bucket-a/models" + tail):
        try:  # urlsplit drops newlines itself; what comes out must hold none
            location = parse_location(url)
        except ConfigError:
            continue
        assert "\n" not in location.bucket + location.prefix and "\r" not in location.bucket + location.prefix


def test_a_hugging_face_link_with_a_trailing_newline_is_not_a_blob_link(tmp_path: Path) -> None:
    rev, blob = "0" * 40, "b" * 64
    entry = tmp_path / "models--org--name" / "snapshots" / rev / "model.safetensors"
    assert hf_blob_link(entry, f"../../blobs/{blob}") is not None
    assert hf_blob_link(entry, f"../../blobs/{blob}\n") is None
    assert hf_blob_link(tmp_path / "models--org--name" / "snapshots" / (rev + "\n") / "model.safetensors",
                        f"../../blobs/{blob}") is None
