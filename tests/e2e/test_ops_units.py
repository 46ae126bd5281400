"""Operations: the systemd units pass ``systemd-analyze verify``, the sysusers/tmpfiles snippets
apply to a scratch root, and gRPC server reflection lists hwr's service (the grpcurl view)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from hwr.daemon.app.launcher import DaemonProcess

SYSTEMD = Path(__file__).resolve().parents[2] / "systemd"
HWRD_BIN = Path(sys.executable).parent / "hwrd"

needs_systemd = pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                                   reason="systemd-analyze missing (.ci/run installs it from Debian's systemd)")


@needs_systemd
def test_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    # verify requires ExecStart's binary to exist: point it at this environment's hwrd script.
    assert HWRD_BIN.exists()
    for name in ("hwrd.service", "hwrd.socket"):
        text = (SYSTEMD / name).read_text()
        if name == "hwrd.service":
            assert "ExecStart=/usr/local/bin/hwrd --config /etc/hwrd/hwrd.toml\n" in text
        (tmp_path / name).write_text(text.replace("/usr/local/bin/hwrd", str(HWRD_BIN)))
    result = subprocess.run(["systemd-analyze", "verify", "--man=no", str(tmp_path / "hwrd.service"),
                             str(tmp_path / "hwrd.socket")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and not result.stderr.strip(), result.stderr


def test_service_declares_what_the_issue_requires() -> None:
    text = (SYSTEMD / "hwrd.service").read_text()
    for line in ("Type=notify", "WatchdogSec=", "Restart=on-failure", "User=hwrd", "RuntimeDirectory=hwrd",
                 "CacheDirectory=hwr", "LimitMEMLOCK=infinity", "NoNewPrivileges=yes", "ProtectSystem=strict",
                 "ReadWritePaths=/var/cache/hwr", "PrivateTmp=yes", "ProtectHome=read-only",
                 "RestrictAddressFamilies=AF_UNIX", "ExecReload=/bin/sh -c 'kill -HUP $MAINPID'"):
        assert line in text, line
    assert "=/bin/kill" not in text  # procps, absent from a minimal Debian
    assert "imports torch" not in text


@needs_systemd
def test_sysusers_and_tmpfiles_apply_to_a_scratch_root(tmp_path: Path) -> None:
    (tmp_path / "etc").mkdir()
    subprocess.run(["systemd-sysusers", f"--root={tmp_path}", str(SYSTEMD / "sysusers.d/hwrd.conf")],
                   check=True, capture_output=True, timeout=60)
    passwd = (tmp_path / "etc/passwd").read_text()
    assert passwd.startswith("hwrd:") or "\nhwrd:" in passwd
    assert "hwr:" in (tmp_path / "etc/group").read_text()
    subprocess.run(["systemd-tmpfiles", f"--root={tmp_path}", "--create", str(SYSTEMD / "tmpfiles.d/hwrd.conf")],
                   check=True, capture_output=True, timeout=60)
    assert (tmp_path / "var/cache/hwr").stat().st_mode & 0o777 == 0o700
    assert (tmp_path / "run/hwrd").is_dir()


def test_example_config_is_valid() -> None:
    result = subprocess.run([sys.executable, "-m", "hwr.daemon.app.main", "--config", str(SYSTEMD / "hwrd.toml"),
                             "--check-config"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert 'metrics_listen = "unix:/run/hwrd/metrics.sock"' in result.stdout


def test_reflection_lists_the_service(spawn_daemon: Callable[..., DaemonProcess]) -> None:
    daemon = spawn_daemon()
    with grpc.insecure_channel(f"unix:{daemon.socket}") as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        services = set(db.get_services())
        assert {"hwr.v1.HostWeightRuntime", "grpc.health.v1.Health"} <= services
        proto = db.FindFileContainingSymbol("hwr.v1.HostWeightRuntime")
        methods = {m.name for s in proto.service for m in s.method}
        assert {"Acquire", "Release", "ListArtifacts", "GetStatus"} <= methods


def test_journald_log_format_has_priority_and_no_timestamp(tmp_path: Path) -> None:
    import logging
    import os

    from hwr.daemon.system import logs

    path = tmp_path / "log"
    with open(path, "w") as stream:
        st = os.fstat(stream.fileno())
        assert logs.configure("info", stream, {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}) is True
        logging.getLogger("hwrd.test").warning("lease refused", extra=logs.fields(pid=7, reason="not allowed"))
        assert logs.configure("info", stream, {}) is False  # a stream journald does not read
        logging.getLogger("hwrd.test").info("plain")
    first, second = path.read_text().splitlines()
    assert first == '<4>hwrd.test: lease refused pid=7 reason="not allowed"'
    assert second[:4].isdigit() and second.endswith("INFO hwrd.test: plain")
    logs.configure("info")


def test_progress_bar_and_completion_scripts() -> None:
    from hwr.daemon.ctl.cli import build_parser
    from hwr.daemon.ctl.completion import completion_script
    from hwr.daemon.ctl.progress import render

    assert render("verify", 512 << 20, 1 << 30, "bytes").endswith(" 50.0% 512.0 MiB/1.0 GiB")
    for shell in ("bash", "zsh"):
        script = completion_script(shell, build_parser())
        assert "status" in script and "--json" in script
        if shutil.which(shell):
            subprocess.run([shell, "-n"], input=script, text=True, check=True, timeout=30)
