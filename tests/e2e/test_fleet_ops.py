"""The operator's side of the fleet tier, on a ``file://`` remote (a shared directory).

``hwrctl remote ls``, ``pull KEY`` and ``push KEY`` in both output modes against two real
nodes; deny markers stay local and a locally denied key is neither pulled nor pushed; the
file backend publishes each object under a temporary name first, so the key's directory never
shows a partial object.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hwr.client import ArtifactIdentity, connect
from hwr.client.errors import ArtifactDenied
from hwr.daemon.ctl import cli as ctl

from .fleet_fixtures import artifact_dirs, node
from .helpers import digests


@pytest.fixture
def file_fleet(short_tmp: Path) -> Iterator[dict[str, Any]]:
    shared = short_tmp / "shared"
    shared.mkdir()
    remote = f"file://{shared}"
    nodes = {"a": node(short_tmp, "a", remote), "b": node(short_tmp, "b", remote),
             "quiet": node(short_tmp, "q", remote, "--remote-push", "false")}
    yield {"shared": shared, "remote": remote, **nodes}
    for proc in nodes.values():
        if proc.proc is not None and proc.proc.poll() is None:
            proc.stop()


def hwrctl(capsys: pytest.CaptureFixture[str], daemon: Any, *argv: str) -> tuple[int, Any, str]:
    code = ctl.main(["--socket", str(daemon.socket), *argv])
    out, err = capsys.readouterr()
    return code, json.loads(out) if "--json" in argv and code == 0 else out, err


def wait_complete(shared: Path, key: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not (shared / "artifacts" / key / "READY.json").exists():
        assert time.monotonic() < deadline, "the push never completed"
        time.sleep(0.05)


@pytest.mark.timeout(180)
def test_hwrctl_remote_ls_pull_push_on_a_file_remote(file_fleet: dict[str, Any],
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    a, b, shared = file_fleet["a"].start(), file_fleet["b"].start(), file_fleet["shared"]
    tensors = {"w": torch.arange(1 << 16, dtype=torch.float32)}
    with connect(a.socket) as client:
        key = client.publish(ArtifactIdentity.simple("fleet/ops"), tensors)
    wait_complete(shared, key)
    files = sorted(os.listdir(shared / "artifacts" / key))
    assert files == ["READY.json", "manifest.json", "model-00001.safetensors"]  # no temporary names left

    code, listed, _ = hwrctl(capsys, b, "remote", "ls", "--json")
    assert code == 0 and [(x["key"], x["state"], x["local"]) for x in listed] == [(key, "complete", False)]
    code, text, _ = hwrctl(capsys, b, "remote", "ls")
    assert code == 0 and key[:16] in text and file_fleet["remote"] in text

    code, pulled, err = hwrctl(capsys, b, "pull", key[:12], "--json", "--progress")
    assert code == 0, err
    assert pulled["key"] == key and pulled["outcome"] == "pulled" and pulled["size_bytes"] > 0
    assert "100%" in err  # the progress bar on stderr
    code, again, _ = hwrctl(capsys, b, "pull", key, "--json")
    assert code == 0 and again["outcome"] == "already_present"
    with connect(b.socket) as client, client.acquire(key) as lease:
        assert digests(lease.tensors) == digests(tensors)

    code, pushed, _ = hwrctl(capsys, a, "push", key[:12], "--json")
    assert code == 0 and pushed["outcome"] == "already_present"
    code, status, _ = hwrctl(capsys, b, "status", "--json")
    assert status["remote"]["url"] == file_fleet["remote"] and status["remote"]["reachable"] is True
    assert status["remote"]["bytes_pulled"] == pulled["size_bytes"]
    code, text, _ = hwrctl(capsys, b, "status")
    assert "remote:" in text and "reachable" in text
    code, shown, _ = hwrctl(capsys, b, "show", key[:12], "--json")
    assert code == 0 and shown["remote_state"] == "present"


@pytest.mark.timeout(180)
def test_a_locally_denied_key_is_neither_pulled_nor_pushed(file_fleet: dict[str, Any],
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    a, b, shared = file_fleet["a"].start(), file_fleet["b"].start(), file_fleet["shared"]
    quiet = file_fleet["quiet"].start()  # push off: publishes stay local until pushed by hand
    with connect(a.socket) as client:
        key = client.publish(ArtifactIdentity.simple("fleet/denied"), {"w": torch.ones(4096)})
    wait_complete(shared, key)
    # node B pulls it, then its operator denies and evicts it: the deny marker stays (local only)
    assert hwrctl(capsys, b, "pull", key)[0] == 0
    assert hwrctl(capsys, b, "deny", key, "--reason", "bad weights")[0] == 0
    assert hwrctl(capsys, b, "evict", key)[0] == 0
    assert artifact_dirs(b.root) == []
    code, _out, err = hwrctl(capsys, b, "pull", key)
    assert code == 1 and "ARTIFACT_DENIED" in err
    with connect(b.socket) as client, pytest.raises(ArtifactDenied):
        client.acquire(key)
    assert artifact_dirs(b.root) == []
    assert not any("deny" in name for name in os.listdir(shared))  # nothing about it went remote

    with connect(quiet.socket) as client:
        local = client.publish(ArtifactIdentity.simple("fleet/denied-local"), {"w": torch.zeros(4096)})
    assert hwrctl(capsys, quiet, "deny", local, "--reason", "not for the fleet")[0] == 0
    code, _out, err = hwrctl(capsys, quiet, "push", local)
    assert code == 1 and "ARTIFACT_DENIED" in err
    assert not (shared / "artifacts" / local).exists()
    assert hwrctl(capsys, quiet, "allow", local)[0] == 0
    code, pushed, err = hwrctl(capsys, quiet, "push", local, "--json")
    assert code == 0 and pushed["outcome"] == "pushed", err
    assert (shared / "artifacts" / local / "READY.json").exists()
