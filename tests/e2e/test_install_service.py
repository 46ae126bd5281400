"""``hwrd install-service`` lays the service out from the installed package, and ``producer_python``
names the interpreter of prewarm's producers (hwrd's own install has no torch).

The install is exercised under ``--prefix`` (no root, no systemd needed): the files it writes, the
unit's ``ExecStart``, the gid in a new configuration (which then passes ``--check-config``), an
operator's configuration kept, and the sandbox drop-in that follows the configured remote. The
real install as root under systemd, from README's block, is ``scripts/systemd-test.sh``.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import hwr.client as hc
from hwr.client.errors import ProducerFailed
from hwr.daemon.app.launcher import DaemonProcess

pytestmark = pytest.mark.timeout(180)
HWRD = [sys.executable, "-m", "hwr.daemon.app.main"]
UNIT_DIR = Path("etc/systemd/system")
DROPIN = UNIT_DIR / "hwrd.service.d/remote.conf"


def install(prefix: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*HWRD, "install-service", "--prefix", str(prefix), *extra],
                          capture_output=True, text=True, timeout=120, check=False)


def test_install_service_writes_every_file_with_execstart_and_the_gid(tmp_path: Path) -> None:
    result = install(tmp_path, "--hwrd", "/opt/hwr/bin/hwrd", "--allow-gid", "4242")
    assert result.returncode == 0, result.stderr
    written = {UNIT_DIR / "hwrd.service", UNIT_DIR / "hwrd.socket", Path("etc/sysusers.d/hwrd.conf"),
               Path("etc/tmpfiles.d/hwrd.conf"), Path("etc/hwrd/hwrd.toml")}
    for rel in written:
        mode = stat.S_IMODE((tmp_path / rel).stat().st_mode)
        assert mode == 0o644, (rel, oct(mode))
        assert f"wrote {tmp_path / rel}" in result.stdout
    assert {p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file()} == written  # no drop-in
    unit = (tmp_path / UNIT_DIR / "hwrd.service").read_text()
    assert "\nExecStart=/opt/hwr/bin/hwrd --config /etc/hwrd/hwrd.toml\n" in unit
    config = tmp_path / "etc/hwrd/hwrd.toml"
    assert "\nallow_gids = [4242]  # the group hwr\n" in config.read_text()
    check = subprocess.run([*HWRD, "--config", str(config), "--check-config"], capture_output=True, text=True,
                           timeout=120, check=False)
    assert check.returncode == 0, check.stderr
    assert "allow_gids = [4242]" in check.stdout


def test_the_default_execstart_is_the_hwrd_beside_this_python(tmp_path: Path) -> None:
    assert install(tmp_path).returncode == 0
    unit = (tmp_path / UNIT_DIR / "hwrd.service").read_text()
    assert f"\nExecStart={Path(sys.executable).parent / 'hwrd'} --config /etc/hwrd/hwrd.toml\n" in unit


def test_an_operators_config_is_kept_and_the_dropin_follows_the_remote(tmp_path: Path) -> None:
    config = tmp_path / "etc/hwrd/hwrd.toml"
    config.parent.mkdir(parents=True)
    config.write_text('remote = "s3://bucket/fleet"\nallow_gids = [7]\n')
    result = install(tmp_path, "--allow-gid", "8")
    assert result.returncode == 0, result.stderr
    assert f"kept {config}" in result.stdout
    assert "does not list the gid 8" in result.stderr  # an operator's file that would refuse the group
    assert config.read_text() == 'remote = "s3://bucket/fleet"\nallow_gids = [7]\n'
    dropin = (tmp_path / DROPIN).read_text()
    assert "\nPrivateNetwork=no\nRestrictAddressFamilies=AF_UNIX AF_INET AF_INET6\n" in dropin
    assert "ReadWritePaths" not in dropin

    remote_dir = tmp_path / "shared remote"  # a space cannot be named in a unit: refused, typed
    config.write_text(f'remote = "file://{remote_dir}"\n')
    refused = install(tmp_path)
    assert refused.returncode == 1 and "spaces" in refused.stderr

    remote_dir = tmp_path / "remote"
    config.write_text(f'remote = "file://{remote_dir}"\n')
    missing = install(tmp_path)
    assert missing.returncode == 0 and "does not exist yet" in missing.stderr
    dropin = (tmp_path / DROPIN).read_text()
    assert f"\nReadWritePaths={remote_dir}\n" in dropin and "PrivateNetwork" not in dropin

    config.write_text('metrics_listen = "127.0.0.1:9464"\n')  # a TCP metrics port needs the network too
    assert install(tmp_path).returncode == 0
    assert "PrivateNetwork=no" in (tmp_path / DROPIN).read_text()

    config.write_text("allow_gids = [7]\n")  # no remote any more: the drop-in goes
    result = install(tmp_path)
    assert result.returncode == 0 and not (tmp_path / DROPIN).exists()
    assert f"removed {tmp_path / DROPIN}" in result.stdout


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze missing")
def test_the_written_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    hwrd = Path(sys.executable).parent / "hwrd"
    assert install(tmp_path / "root", "--hwrd", str(hwrd)).returncode == 0
    units = tmp_path / "root" / UNIT_DIR
    result = subprocess.run(["systemd-analyze", "verify", "--man=no", str(units / "hwrd.service"),
                             str(units / "hwrd.socket")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and not result.stderr.strip(), result.stderr


def test_install_service_usage_errors_exit_2(tmp_path: Path) -> None:
    result = subprocess.run([*HWRD, "install-service", "--allow-gid", "hwr"], capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 2 and "--allow-gid" in result.stderr
    relative = install(tmp_path, "--hwrd", "bin/hwrd")
    assert relative.returncode == 1 and "absolute" in relative.stderr


def test_help_names_install_service_and_producer_python() -> None:
    out = subprocess.run([*HWRD, "--help"], capture_output=True, text=True, timeout=120, check=True).stdout
    assert "hwrd install-service" in out and "--producer-python" in out and "hwr[worker]" in out


def _checkpoint(path: Path) -> None:
    path.mkdir(parents=True)
    save_file({"w": torch.randn(32, 32, generator=torch.Generator().manual_seed(3))}, path / "model.safetensors")


def test_producer_python_runs_the_named_interpreter(short_tmp: Path,
                                                   spawn_daemon: Callable[..., DaemonProcess]) -> None:
    # A wrapper interpreter that leaves a mark, then runs this venv's python (which has torch).
    mark = short_tmp / "ran"
    wrapper = short_tmp / "python"
    wrapper.write_text(f'#!/bin/sh\necho "$@" >> {mark}\nexec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    _checkpoint(short_tmp / "ckpt")
    daemon = spawn_daemon("--producer-python", str(wrapper))
    with hc.connect(daemon.socket) as client:
        ckpt = client.add_checkpoint(short_tmp / "ckpt")["checkpoint_id"]
        [built] = client.prewarm(ckpt, "cast", dtype="bf16")
        assert built["outcome"] == "built"
    assert "-m hwr.daemon.producers.worker" in mark.read_text()


def test_producer_python_without_torch_or_absent_is_a_typed_failure_naming_it(
        short_tmp: Path, spawn_daemon: Callable[..., DaemonProcess]) -> None:
    # An interpreter without hwr[worker] (a bare venv: no hwr, no torch), then one that does not exist.
    bare = short_tmp / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True, timeout=120)
    _checkpoint(short_tmp / "ckpt")
    for python, says in ((bare / "bin/python", "set producer_python"),
                         (short_tmp / "no-such/python", "cannot be run")):
        daemon = spawn_daemon("--producer-python", str(python), root=short_tmp / f"root-{python.parent.name}",
                              sock=short_tmp / f"{python.parent.name}.sock")
        with hc.connect(daemon.socket) as client:
            ckpt = client.add_checkpoint(short_tmp / "ckpt")["checkpoint_id"]
            with pytest.raises(ProducerFailed) as failed:
                client.prewarm(ckpt, "cast", dtype="bf16")
        assert str(python) in str(failed.value) and says in str(failed.value), str(failed.value)
        assert not os.listdir(daemon.root / "tmp")  # the failed build left no staging
