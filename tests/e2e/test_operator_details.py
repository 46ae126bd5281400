"""What an operator meets on a real node, each against a real hwrd: a checkpoint the daemon's user
cannot read, ``hwrctl | head``, a publication larger than the whole filesystem, user and group
names in the allow-lists, and ``hwrd --help``.
"""

from __future__ import annotations

import grp
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hwr.client import ArtifactIdentity, connect
from hwr.client.errors import ExceedsFilesystem
from hwr.client.publisher import TensorSpec
from hwr.daemon.app.launcher import DaemonProcess
from hwr.daemon.app.main import _parser
from hwr.daemon.system.config import field_names
from hwr.daemon.system.config_help import HELP
from tests.daemon_proc import HWRD, STRANGER, RunAs, as_user, finish_daemon, make_daemon

pytestmark = pytest.mark.timeout(180)

HWRCTL = [sys.executable, "-m", "hwr.daemon.ctl.cli"]


def test_checkpoints_add_by_root_names_the_daemon_user_who_cannot_read_the_file(short_tmp: Path) -> None:
    daemon = make_daemon(short_tmp, user=HWRD).start()
    try:
        ckpt = short_tmp / "ckpt"
        ckpt.mkdir(mode=0o755)
        secret = ckpt / "model.safetensors"
        secret.write_bytes(b"\0" * 64)
        secret.chmod(0o600)  # root's alone: the unit's user cannot read it
        result = subprocess.run([*HWRCTL, "--socket", str(daemon.socket), "checkpoints", "add", str(ckpt)],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 1, result
        line = result.stderr.strip()
        assert line.startswith("hwrctl: PERMISSION_DENIED: cannot open model.safetensors: Permission denied")
        assert f"uid {HWRD.uid}" in line and "cannot read it" in line, line
        result = subprocess.run([*HWRCTL, "--socket", str(daemon.socket), "checkpoints", "add", str(secret)],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 1 and f"uid {HWRD.uid}" in result.stderr, result
    finally:
        finish_daemon(daemon, [])


@pytest.mark.parametrize("command", [["status"], ["status", "--json"], ["ls"], ["--help"]])
def test_hwrctl_whose_reader_is_gone_ends_quietly(hwrd: DaemonProcess, command: list[str]) -> None:
    """stdout is a pipe whose reader has closed (``hwrctl ... | head -1`` after head exits)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = subprocess.run([*HWRCTL, "--socket", str(hwrd.socket), *command], stdout=write_end,
                                stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(write_end)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""  # no BrokenPipeError traceback, no "Exception ignored"


def test_hwrctl_piped_into_head_prints_no_traceback(hwrd: DaemonProcess) -> None:
    with connect(hwrd.socket) as client:
        for i in range(40):  # a listing longer than what head reads
            client.publish(ArtifactIdentity.simple(f"head/{i}"), {"w": torch.full((4,), float(i))})
    ctl = " ".join([*HWRCTL, "--socket", str(hwrd.socket)])
    for _ in range(5):
        result = subprocess.run(["bash", "-c", f"set -o pipefail; {ctl} ls | head -1; {ctl} status | head -1"],
                                capture_output=True, text=True, timeout=120)
        assert "Traceback" not in result.stderr and "BrokenPipe" not in result.stderr, result.stderr
        assert result.returncode == 0, result.stderr


def test_a_publication_larger_than_the_whole_filesystem_is_not_retryable(hwrd: DaemonProcess) -> None:
    st = os.statvfs(hwrd.root)
    too_big = st.f_blocks * st.f_frsize * 2
    with connect(hwrd.socket) as client, pytest.raises(ExceedsFilesystem) as refused:
        client.publisher(ArtifactIdentity.simple("too/big"), [TensorSpec("w", torch.uint8, (too_big,))],
                         wait_timeout=30)
    error = refused.value
    assert error.code == "EXCEEDS_FILESYSTEM" and error.retryable is False
    assert "can never fit" in error.message
    assert error.details["need_bytes"] >= too_big  # the payload plan rounds each tensor up to its alignment
    assert 0 < error.details["filesystem_bytes"] < too_big
    with connect(hwrd.socket) as client:  # nothing reserved or staged was left behind
        assert client.status()["artifacts"] == 0


def _group() -> grp.struct_group:
    """A group of this host that is not root's (its gid is the test client's only group)."""
    for name in ("users", "nogroup", "daemon"):
        try:
            group = grp.getgrnam(name)
        except KeyError:
            continue
        if group.gr_gid != 0:
            return group
    pytest.skip("no non-root group with a name on this host")


def _status_as(user: RunAs, sock: Path) -> subprocess.CompletedProcess[str]:
    code = "import sys; from hwr.daemon.ctl.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run(as_user(user, ["python", "-c", code, "--socket", str(sock), "status", "--json"]),
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("how", ["flag", "env", "toml"])
def test_the_allow_list_takes_a_group_name(short_tmp: Path, how: str) -> None:
    group = _group()
    member = RunAs(STRANGER.uid, group.gr_gid, umask=0o022)  # in the group, not on any uid list
    short_tmp.chmod(0o755)  # the member must reach the socket
    extra: list[str] = ["--socket-mode", "666"]
    env: dict[str, str] = {}
    if how == "flag":
        extra += ["--allow-gid", group.gr_name]
    elif how == "env":
        env["HWR_ALLOW_GIDS"] = f"{group.gr_name}"
    else:
        config = short_tmp / "hwrd.toml"
        config.write_text(f'allow_gids = ["{group.gr_name}"]\n')
        extra += ["--config", str(config)]
    daemon = DaemonProcess(short_tmp / "store", short_tmp / "hwrd.sock", *extra, env=env).start()
    try:
        result = _status_as(member, daemon.socket)
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout)["root"] == str(daemon.root)
        stranger = _status_as(STRANGER, daemon.socket)  # not in the group: refused as before
        assert stranger.returncode == 1 and "PERMISSION_DENIED" in stranger.stderr, stranger
    finally:
        finish_daemon(daemon, [])


def test_the_allow_lists_take_user_names_and_refuse_unknown_names(short_tmp: Path) -> None:
    def check(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "hwr.daemon.app.main", "--root", str(short_tmp / "s"),
                               "--socket", str(short_tmp / "s.sock"), *args, "--check-config"],
                              capture_output=True, text=True, timeout=60, env={**os.environ, **(env or {})})

    ok = check("--allow-uid", "root", "--allow-uid", "65534", "--operator-gids", "root")
    assert ok.returncode == 0, ok.stderr
    assert "allow_uids = [0, 65534]" in ok.stdout and "operator_gids = [0]" in ok.stdout
    for args, env, where in ((("--allow-gid", "no-such-group-hwr"), None, "flag --allow-gid"),
                             ((), {"HWR_PUBLISH_UIDS": "root,no-such-user-hwr"}, "env HWR_PUBLISH_UIDS")):
        bad = check(*args, env=env)
        assert bad.returncode == 2, bad
        line = bad.stderr.strip()
        assert "no-such-" in line and "on this host" in line and where in line, line
        assert "Traceback" not in line
    config = short_tmp / "bad.toml"
    config.write_text('allow_gids = ["no-such-group-hwr"]\n')
    bad = check("--config", str(config))
    assert bad.returncode == 2 and f"{config}:1" in bad.stderr and "no group named" in bad.stderr, bad


def test_every_hwrd_option_has_a_description() -> None:
    assert set(HELP) | {"root", "socket", "socket_mode", "allow_uids", "allow_gids", "log_level"} == set(field_names())
    for action in _parser()._actions:
        assert action.help and not action.help.startswith("(env"), action.option_strings
    shown = subprocess.run([sys.executable, "-m", "hwr.daemon.app.main", "--help"], capture_output=True,
                           text=True, timeout=60)
    assert shown.returncode == 0 and "--remote-stall-timeout-s" in shown.stdout


_WRITER = """
import sys, torch
from hwr.client import connect
with connect(sys.argv[1]) as client:
    lease = client.acquire(sys.argv[2], copy_on_write=sys.argv[3] == "cow")
    w = lease.tensors["w"]
    print("leased", flush=True)
    w.add_(1)  # a write into the lease's pages
    print("wrote", float(w[0]), flush=True)
    lease.close()
"""


def test_a_write_into_a_lease_tensor_kills_the_writer_and_copy_on_write_allows_it(hwrd: DaemonProcess) -> None:
    """What the README says of lease tensors: the read-only mapping is the protection."""
    import signal

    with connect(hwrd.socket) as client:
        key = client.publish(ArtifactIdentity.simple("write/me"), {"w": torch.zeros(1024)})
        crashed = subprocess.run([sys.executable, "-c", _WRITER, str(hwrd.socket), key, "shared"],
                                 capture_output=True, text=True, timeout=60)
        assert crashed.returncode == -signal.SIGSEGV, crashed
        assert crashed.stdout.splitlines() == ["leased"]
        cow = subprocess.run([sys.executable, "-c", _WRITER, str(hwrd.socket), key, "cow"],
                             capture_output=True, text=True, timeout=60)
        assert cow.returncode == 0 and cow.stdout.splitlines() == ["leased", "wrote 1.0"], cow
        with client.acquire(key) as lease:  # every other worker still sees the published bytes
            assert torch.equal(lease.tensors["w"], torch.zeros(1024))
