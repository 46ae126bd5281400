"""The unprivileged-daemon fixtures themselves: hwrd as the unit's ``User=hwrd`` (its own uid and
gid, no groups, no capabilities, the unit's umask) on directories it owns, and attackers as yet
another uid. Every test that runs a daemon as ``daemon_proc.HWRD`` relies on what is checked here.
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch
from daemon_proc import HWRD, STRANGER, DaemonProcess, as_user

from hwr.client import ArtifactIdentity, connect


def _status(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/status", encoding="ascii") as fh:
        return dict(line.rstrip("\n").split(":\t", 1) for line in fh if ":\t" in line)


def test_the_daemon_runs_as_the_units_user_on_directories_it_owns(unprivileged_hwrd: DaemonProcess) -> None:
    status = _status(unprivileged_hwrd.pid)
    assert status["Uid"].split() == [str(HWRD.uid)] * 4
    assert status["Gid"].split() == [str(HWRD.gid)] * 4
    assert status["Groups"].strip() == ""
    assert int(status["CapEff"], 16) == 0 and int(status["CapPrm"], 16) == 0
    assert os.stat(f"/proc/{unprivileged_hwrd.pid}").st_uid == HWRD.uid  # as after an exec by that user
    store = os.stat(unprivileged_hwrd.root)
    assert (store.st_uid, store.st_mode & 0o777) == (HWRD.uid, 0o700)
    for sub in ("artifacts", "tmp", "quarantine", "deny", "locks"):
        assert os.stat(unprivileged_hwrd.root / sub).st_uid == HWRD.uid
    sock = os.stat(unprivileged_hwrd.socket)
    assert sock.st_uid == HWRD.uid and os.stat(unprivileged_hwrd.socket.parent).st_uid == HWRD.uid
    with connect(unprivileged_hwrd.socket) as client:  # root may connect to its daemon
        key = client.publish(ArtifactIdentity.simple("unprivileged/fixture"), {"w": torch.arange(8.0)})
        with client.acquire(key) as lease:
            assert lease.tensors["w"].tolist() == list(range(8))
    artifact = os.stat(unprivileged_hwrd.root / "artifacts" / key)
    assert artifact.st_uid == HWRD.uid


def test_an_attacker_runs_as_another_uid(unprivileged_hwrd: DaemonProcess) -> None:
    code = "import os, sys; print(os.getuid(), os.getgid(), os.getgroups(), sys.argv[1:])"
    out = subprocess.run(as_user(STRANGER, [sys.executable, "-c", code, "x"]), capture_output=True,
                         text=True, timeout=60, check=True)
    assert out.stdout.split("\n")[0] == f"{STRANGER.uid} {STRANGER.gid} [] ['x']"
    probe = subprocess.run(as_user(STRANGER, [sys.executable, "-c", "import os, sys; os.listdir(sys.argv[1])",
                                              str(unprivileged_hwrd.root)]), capture_output=True, text=True,
                           timeout=60)
    assert probe.returncode != 0 and "PermissionError" in probe.stderr  # the store is private
