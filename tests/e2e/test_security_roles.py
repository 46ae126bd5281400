"""Acceptance: roles (acquire / publish / operator) and no confused deputy, with a second uid.

A client process drops to ``nobody`` (uid 65534) and runs every operation against two daemons
that both admit it (``--allow-uids 65534``): one where it may only acquire (``--publish-uids
0``, no operator role) and one where it is an operator (``--operator-uids 65534``). As an
operator it still gets nothing hwrd's own rights could read for it: a checkpoint symlink to a
root-only file, or a root-only file inside the directory, is refused, and a malformed header's
error does not echo the file's bytes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from hwr.client import ArtifactIdentity, connect
from hwr.daemon.app.launcher import DaemonProcess

NOBODY = 65534
WORKER = Path(__file__).with_name("role_worker.py")
OPERATOR_ACTIONS = ("deny", "pin", "evict", "gc", "verify", "pull", "push")

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="dropping to another uid needs root")


def run_as_nobody(sock: Path, plan: dict[str, Any]) -> dict[str, Any]:
    done = subprocess.run([sys.executable, str(WORKER), str(NOBODY), str(sock)], input=json.dumps(plan),
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def checkpoint_dirs(base: Path) -> dict[str, str]:
    secret_dir = base / "private"
    secret_dir.mkdir(mode=0o700)
    save_file({"secret": torch.full((16,), 42.0)}, secret_dir / "secret.safetensors")
    dirs = {name: base / name for name in ("escape", "inside", "readable", "garbage")}
    for path in dirs.values():
        path.mkdir(mode=0o755)
    os.symlink(secret_dir / "secret.safetensors", dirs["escape"] / "model.safetensors")
    save_file({"secret": torch.full((16,), 42.0)}, dirs["inside"] / "model.safetensors")
    os.chmod(dirs["inside"] / "model.safetensors", 0o600)  # root's: hwrd (root) could read it
    save_file({"w": torch.ones(16)}, dirs["readable"] / "model.safetensors")
    (dirs["garbage"] / "model.safetensors").write_bytes(b"\x93SECRET\x01 and more bytes of it")
    for path in (dirs["readable"] / "model.safetensors", dirs["garbage"] / "model.safetensors"):
        os.chmod(path, 0o644)
    return {name: str(path) for name, path in dirs.items()}


@pytest.mark.timeout(240)
def test_roles_separate_acquire_publish_and_operate_and_files_open_with_the_callers_rights(
    spawn_daemon: Callable[..., DaemonProcess], short_tmp: Path
) -> None:
    short_tmp.chmod(0o755)
    socks = {"acquirer": short_tmp / "a.sock", "operator": short_tmp / "o.sock"}
    extra = {"acquirer": ("--publish-uids", "0"), "operator": ("--operator-uids", str(NOBODY))}
    failures: list[BaseException] = []

    def start(name: str) -> None:
        try:
            spawn_daemon("--socket-mode", "666", "--allow-uid", str(NOBODY), *extra[name],
                         root=short_tmp / f"store-{name}", sock=socks[name])
        except BaseException as exc:
            failures.append(exc)

    starts = [threading.Thread(target=start, args=(name,)) for name in socks]
    for thread in starts:
        thread.start()
    for thread in starts:
        thread.join(90)
    assert not failures, failures
    keys = {}
    for name, sock in socks.items():
        with connect(sock) as client:  # root: every role
            keys[name] = client.publish(ArtifactIdentity.simple("roles/root"), {"w": torch.arange(64.0)})
    plan_dirs = checkpoint_dirs(short_tmp)

    acquirer = run_as_nobody(socks["acquirer"], {"key": keys["acquirer"], "checkpoints": plan_dirs})
    assert acquirer["uid"] == NOBODY
    assert acquirer["acquire"] == {"ok": True, "value": 1}
    for action in ("publish", "begin_rpc"):
        assert (acquirer[action]["code"], acquirer[action]["role"]) == ("PERMISSION_DENIED", "publish"), action
    for action in (*OPERATOR_ACTIONS, *(f"checkpoint:{n}" for n in plan_dirs)):
        assert (acquirer[action]["code"], acquirer[action]["role"]) == ("PERMISSION_DENIED", "operator"), action
    assert acquirer["acquire_after"]["ok"], acquirer  # the refused deny changed nothing
    with connect(socks["acquirer"]) as client:
        assert client.list_checkpoints() == []
        assert client.status()["artifacts"] == 1  # the refused publications left nothing behind

    operator = run_as_nobody(socks["operator"], {"key": keys["operator"], "checkpoints": plan_dirs})
    print("\nas an operator uid:", json.dumps({k: v.get("code", "ok") for k, v in operator.items()
                                              if isinstance(v, dict)}))
    assert operator["publish"]["ok"], operator["publish"]  # publish defaults to everyone admitted
    for name in ("escape", "inside"):
        result = operator[f"checkpoint:{name}"]
        assert result["code"] == "PERMISSION_DENIED", (name, result)
        assert "42" not in result["message"] and "secret" not in result["details"], result
    assert operator["checkpoint:readable"] == {"ok": True, "value": "['w']"}
    garbage = operator["checkpoint:garbage"]
    assert garbage["code"] == "MANIFEST_CORRUPT", garbage
    leaked = str(int.from_bytes(b"\x93SECRET\x01", "little"))
    assert leaked not in garbage["message"] and leaked not in garbage["details"], garbage
    assert operator["deny"]["ok"] and operator["acquire_after"]["code"] == "ARTIFACT_DENIED"
    with connect(socks["operator"]) as client:
        assert [c["path"] for c in client.list_checkpoints()] == [plan_dirs["readable"]]
