"""Where the plugin finds hwrd: HWR_SOCKET, else <runtime root>/hwrd.json; strict marker parsing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("vllm_omni")

from hwr.client.errors import ConfigError
from hwr.dlo_backend.vllm_plugin.config import resolve_target


def _marker(root: Path, doc: object) -> Path:
    path = root / "hwrd.json"
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return path


def test_nothing_configured(tmp_path):
    assert resolve_target(tmp_path, {}) is None
    assert resolve_target(None, {}) is None


def test_environment_wins_over_the_marker(tmp_path):
    _marker(tmp_path, {"socket": "/run/other.sock"})
    target = resolve_target(tmp_path, {"HWR_SOCKET": "/run/hwrd/hwrd.sock"})
    assert target.socket == Path("/run/hwrd/hwrd.sock") and target.origin == "$HWR_SOCKET"


def test_marker(tmp_path):
    path = _marker(tmp_path, {"socket": "/run/hwrd/hwrd.sock", "connect_timeout_s": 2.5})
    target = resolve_target(tmp_path, {})
    assert (target.socket, target.origin, target.connect_timeout_s) == (Path("/run/hwrd/hwrd.sock"), str(path), 2.5)


@pytest.mark.parametrize("value", ["0", "false", "off"])
def test_disable_switch(tmp_path, value):
    _marker(tmp_path, {"socket": "/run/hwrd/hwrd.sock"})
    assert resolve_target(tmp_path, {"HWR_SOCKET": "/x.sock", "HWR_VLLM_PLUGIN": value}) is None


@pytest.mark.parametrize(("doc", "needle"), [
    ({"socket": "relative.sock"}, "socket"),
    ({"socket": "/a.sock", "timeout": 3}, "timeout"),
    ({"socket": "/a.sock", "connect_timeout_s": 0}, "connect_timeout_s"),
    ({}, "socket"),
    ("{not json", "invalid"),
])
def test_malformed_marker_names_the_file_and_field(tmp_path, doc, needle):
    path = _marker(tmp_path, doc)
    with pytest.raises(ConfigError) as info:
        resolve_target(tmp_path, {})
    assert str(path) in info.value.message and needle in info.value.message


def test_marker_must_be_a_regular_file(tmp_path):
    (tmp_path / "hwrd.json").mkdir()
    with pytest.raises(ConfigError):
        resolve_target(tmp_path, {})
