"""A client is never served another user's weights: squatting the default socket directory.

Without ``XDG_RUNTIME_DIR`` a user's default socket is ``/tmp/hwrd-$UID/hwrd.sock``, and any
local user can make that directory first. Here an attacker (``daemon_proc.STRANGER``) does so for
a victim uid, runs an hwrd of its own there and publishes "weights" under an identity the victim
will ask for. The victim's client (its default socket, and an explicit ``HWR_SOCKET`` as the
vLLM-Omni plugin uses) must refuse that daemon before asking it anything; the victim's own hwrd
must refuse to start in a directory the attacker owns or may write. Real daemons, real uids.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from daemon_proc import HWRD, STRANGER, DaemonProcess, RunAs, as_user, make_daemon, own

#: The victim: a uid of its own, so that its /tmp/hwrd-$UID is this test's alone.
VICTIM = RunAs(64303, 64303, umask=0o022)
SQUAT = Path(f"/tmp/hwrd-{VICTIM.uid}")

#: What the victim's process does: connect (its default socket unless HWR_SOCKET is set), ask the
#: daemon's pid and acquire the identity the attacker published; prints one JSON line.
VICTIM_CODE = """
import json, os
from hwr.client import ArtifactIdentity, connect
from hwr.client.errors import HwrError
out = {"uid": os.getuid()}
try:
    with connect(timeout=10) as client:
        out["daemon_pid"] = client.status()["pid"]
        with client.acquire(ArtifactIdentity.simple("victim/model").key) as lease:
            out["weights"] = lease.tensors["w"].tolist()
except HwrError as exc:
    out["error"] = exc.code
    out["details"] = exc.details
print(json.dumps(out))
"""

PUBLISH_CODE = """
import sys, torch
from hwr.client import ArtifactIdentity, connect
with connect(sys.argv[1]) as client:
    print(client.publish(ArtifactIdentity.simple("victim/model"), {"w": torch.full((4,), 666.0)}))
"""


def run_victim(env: dict[str, str]) -> dict:
    clean = {k: v for k, v in os.environ.items() if k not in ("HWR_SOCKET", "XDG_RUNTIME_DIR")}
    done = subprocess.run(as_user(VICTIM, [sys.executable, "-c", VICTIM_CODE]), capture_output=True, text=True,
                          timeout=120, env={**clean, **env}, cwd="/")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture
def squat() -> Iterator[Callable[[RunAs, int], Path]]:
    """``squat(owner, mode)``: the victim's default socket directory, made by ``owner``."""
    shutil.rmtree(SQUAT, ignore_errors=True)

    def make(owner: RunAs, mode: int) -> Path:
        return own(SQUAT, owner, mode)

    yield make
    shutil.rmtree(SQUAT, ignore_errors=True)


@pytest.fixture
def attacker(short_tmp: Path, squat: Callable[[RunAs, int], Path],
             spawn_daemon: Callable[..., DaemonProcess]) -> DaemonProcess:
    """The attacker's hwrd, serving from the victim's default socket directory with "weights"
    published under the identity the victim asks for."""
    where = squat(STRANGER, 0o755)
    daemon = make_daemon(short_tmp, "--allow-uid", str(VICTIM.uid), "--socket-mode", "666", user=STRANGER,
                         sock=where / "hwrd.sock")
    spawn_daemon(daemon=daemon)
    done = subprocess.run(as_user(STRANGER, [sys.executable, "-c", PUBLISH_CODE, str(daemon.socket)]),
                          capture_output=True, text=True, timeout=120, cwd="/")
    assert done.returncode == 0, done.stderr
    return daemon


@pytest.mark.timeout(240)
def test_the_victims_client_refuses_an_attackers_daemon_in_its_default_socket_directory(
        attacker: DaemonProcess) -> None:
    by_default = run_victim({})
    explicit = run_victim({"HWR_SOCKET": str(attacker.socket)})  # the vLLM-Omni plugin's way
    for seen in (by_default, explicit):
        assert seen["uid"] == VICTIM.uid
        assert "weights" not in seen and "daemon_pid" not in seen, seen
        assert seen["error"] == "UNTRUSTED_DAEMON", seen
        assert seen["details"]["daemon_uid"] == STRANGER.uid
        assert f"belongs to uid {STRANGER.uid}" in seen["details"]["reason"]


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("owner", "mode", "why"), [
    (STRANGER, 0o755, f"belongs to uid {STRANGER.uid}"),
    (STRANGER, 0o777, f"belongs to uid {STRANGER.uid}"),
    (VICTIM, 0o777, "writable by group or others"),
])
def test_the_victims_own_daemon_refuses_a_socket_directory_others_control(
        short_tmp: Path, squat: Callable[[RunAs, int], Path], owner: RunAs, mode: int, why: str) -> None:
    where = squat(owner, mode)
    daemon = make_daemon(short_tmp, user=VICTIM, sock=where / "hwrd.sock")
    with pytest.raises(RuntimeError, match="exited with 1") as failed:
        daemon.start(timeout=60)
    assert why in str(failed.value) and "socket directory" in str(failed.value)
    assert list(where.iterdir()) == []  # it bound nothing there


@pytest.mark.timeout(240)
def test_a_daemon_of_root_or_of_the_units_user_is_trusted_through_hwr_socket(
        short_tmp: Path, spawn_daemon: Callable[..., DaemonProcess]) -> None:
    short_tmp.chmod(0o755)  # root's directories, searchable by everyone (as /run is)
    for user, name in ((None, "root"), (HWRD, "unit")):
        base = short_tmp / name
        base.mkdir()
        daemon = spawn_daemon(daemon=make_daemon(base, "--allow-uid", str(VICTIM.uid), "--socket-mode", "666",
                                                 user=user))
        base.chmod(0o755)  # the root daemon's socket directory (its store below stays 0700)
        seen = run_victim({"HWR_SOCKET": str(daemon.socket)})
        assert seen.get("daemon_pid") == daemon.pid, seen
        assert seen["error"] == "LOCAL_MISS"  # nothing published: the daemon itself answered
