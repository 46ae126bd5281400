"""Several hwrds on one host: none takes over, or removes, a socket another live hwrd serves, and
only the node's service reads the service's configuration file by itself.

Real daemons on temp sockets. The service's file is ``hwr.daemon.system.config.SYSTEM_CONFIG``
(``/etc/hwrd/hwrd.toml``); the tests point it at a temp file inside the started hwrd (``python -c``
that sets the module constant, then runs hwrd's ``main``), so the host's own ``/etc`` is never
read or written.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hwr.client import connect
from hwr.daemon.app.launcher import DaemonProcess, answers

pytestmark = pytest.mark.timeout(120)


def _hwrd(base: Path, name: str, *extra: str, sock: Path | None = None) -> DaemonProcess:
    base.mkdir(exist_ok=True)
    return DaemonProcess(base / f"store-{name}", sock or base / f"{name}.sock", *extra)


def _refused(daemon: DaemonProcess) -> subprocess.CompletedProcess[str]:
    """Run ``daemon``'s command to its end (it must refuse to start)."""
    return subprocess.run(daemon.command(), capture_output=True, text=True, timeout=60, env=daemon.env)


def _scrape(path: Path) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(str(path))
        s.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def test_a_second_hwrd_on_a_served_socket_refuses_and_the_first_keeps_serving(short_tmp: Path) -> None:
    first = _hwrd(short_tmp, "first").start()
    try:
        second = _hwrd(short_tmp, "second", sock=first.socket)  # another root, the same socket
        result = _refused(second)
        assert result.returncode == 1, result.stderr
        assert f"another daemon is serving on {first.socket}" in result.stderr
        assert "Traceback" not in result.stderr
        for path in (first.socket, Path(f"{first.socket}.peer"), Path(f"{first.socket}.grpc")):
            assert answers(path), f"{path} was taken from the first hwrd"
        with connect(first.socket, timeout=10) as client:  # served end to end: peer socket and gRPC
            assert client.status()["root"] == str(first.root)
    finally:
        assert first.stop() == 0
    assert not first.socket.exists()  # the first removes its own sockets at exit


def test_a_second_hwrd_on_a_served_metrics_socket_refuses_and_leaves_it(short_tmp: Path) -> None:
    metrics = short_tmp / "metrics.sock"
    first = _hwrd(short_tmp, "first", "--metrics-listen", f"unix:{metrics}").start()
    try:
        result = _refused(_hwrd(short_tmp, "second", "--metrics-listen", f"unix:{metrics}"))
        assert result.returncode == 1, result.stderr
        assert f"another daemon is serving on {metrics}" in result.stderr
        assert b"200 OK" in _scrape(metrics).split(b"\r\n", 1)[0]  # still the first's endpoint
        assert not (short_tmp / "second.sock").exists()  # the refused one left nothing behind
    finally:
        assert first.stop() == 0
    assert not metrics.exists()


def test_an_hwrd_leaves_a_socket_path_another_hwrd_took_over_since(short_tmp: Path) -> None:
    """The first's metrics socket file is removed behind its back and a second hwrd binds the
    path: the first, when it stops, must not unlink the second's socket."""
    metrics = short_tmp / "metrics.sock"
    first = _hwrd(short_tmp, "first", "--metrics-listen", f"unix:{metrics}").start()
    second = None
    try:
        metrics.unlink()
        second = _hwrd(short_tmp, "second", "--metrics-listen", f"unix:{metrics}").start()
        assert first.stop() == 0
        assert answers(metrics), "the first hwrd unlinked the second's metrics socket"
        assert b"200 OK" in _scrape(metrics).split(b"\r\n", 1)[0]
    finally:
        first.stop()
        if second is not None:
            assert second.stop() == 0
    assert not metrics.exists()


def _main_with_service_config(system_config: Path) -> list[str]:
    """A command that runs hwrd's ``main`` with the service's file at ``system_config``."""
    code = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        import hwr.daemon.system.config as config
        config.SYSTEM_CONFIG = Path({str(system_config)!r})
        from hwr.daemon.app.main import main
        sys.exit(main(sys.argv[1:]))
    """)
    return [sys.executable, "-c", code]


def _check_config(system_config: Path, *args: str, env: dict[str, str] | None = None) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in ("HWR_ROOT", "HWR_SOCKET", "HWR_CONFIG")}
    result = subprocess.run([*_main_with_service_config(system_config), *args, "--check-config"],
                            capture_output=True, text=True, timeout=60, env={**clean, **(env or {})})
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_only_the_node_service_reads_the_service_configuration_by_itself(short_tmp: Path) -> None:
    service = short_tmp / "hwrd.toml"
    service.write_text("allow_gids = [4242]\n")
    own = ["--root", str(short_tmp / "store"), "--socket", str(short_tmp / "own.sock")]
    # The node's service: no root or socket named anywhere.
    assert "allow_gids = [4242]" in _check_config(service)
    # An hwrd given a place of its own, by flag or by environment, reads no file.
    for args, env in ((own, None), (own[:2], None), (own[2:], None),
                      ((), {"HWR_ROOT": str(short_tmp / "store")}),
                      ((), {"HWR_SOCKET": str(short_tmp / "own.sock")})):
        text = _check_config(service, *args, env=env)
        assert "4242" not in text and str(service) not in text, (args, env, text)
    # Told to, it reads it (--config or HWR_CONFIG), whatever else is given.
    assert "allow_gids = [4242]" in _check_config(service, "--config", str(service), *own)
    assert "allow_gids = [4242]" in _check_config(service, *own, env={"HWR_CONFIG": str(service)})


def test_a_hand_started_hwrd_does_not_bind_the_service_metrics_socket(short_tmp: Path) -> None:
    """The service's file names a metrics socket; an hwrd started on a root and socket of its own
    serves without it (it neither binds nor unlinks the service's endpoint)."""
    service_metrics = short_tmp / "service-metrics.sock"
    service = short_tmp / "hwrd.toml"
    service.write_text(f'metrics_listen = "unix:{service_metrics}"\n')

    class Hand(DaemonProcess):
        def command(self) -> list[str]:
            return [*_main_with_service_config(service), "--root", str(self.root), "--socket", str(self.socket)]

    daemon = Hand(short_tmp / "store", short_tmp / "own.sock").start()
    try:
        assert not service_metrics.exists()
    finally:
        assert daemon.stop() == 0
