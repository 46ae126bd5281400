"""Clients find the node's hwrd service with no configuration (``hwr.client.paths.client_socket``).

A "service" hwrd runs as the unit's unprivileged user (``daemon_proc.HWRD``) in a directory laid
out like the unit's ``/run/hwrd``; its socket stands in for ``/run/hwrd/hwrd.sock``
(``hwr.client.paths.SERVICE_SOCKET``, set inside each client process by the ``-c`` program
below). Clients are real processes of another user (``STRANGER``, on the service's allow-list as
a member of its group would be) with no ``HWR_SOCKET`` and an empty ``XDG_RUNTIME_DIR`` of their
own: ``connect()``, ``hwrctl status`` (its ``main``) and the vLLM-Omni plugin's target.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.daemon_proc import (
    HWRD,
    NOBODY,
    STRANGER,
    DaemonProcess,
    as_user,
    finish_daemon,
    make_daemon,
    needs_root,
    own,
)

pytestmark = pytest.mark.timeout(180)

CLIENT = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import hwr.client.paths as paths
    paths.SERVICE_SOCKET = Path(sys.argv[2])
    what = sys.argv[1]
    if what == "hwrctl":
        from hwr.daemon.ctl.cli import main
        sys.exit(main(["status", "--json"]))
    from hwr.client import connect
    from hwr.client.errors import DaemonUnavailable
    socket = None
    if what == "plugin":
        from hwr.dlo_backend.vllm_plugin.config import resolve_target
        target = resolve_target(None)
        if target is None:
            print(json.dumps({"target": None}))
            sys.exit(0)
        socket = target.socket
    try:
        with connect(socket, timeout=10) as client:
            print(json.dumps({"socket": str(client.socket_path), "root": client.status()["root"]}))
    except DaemonUnavailable as exc:
        print(json.dumps({"error": exc.code, "message": exc.message, "details": exc.details}))
""")


def _run(what: str, service: Path, home: Path, *, user=STRANGER) -> subprocess.CompletedProcess[str]:  # type: ignore[no-untyped-def]
    env = {k: v for k, v in os.environ.items() if k not in ("HWR_SOCKET", "HWR_VLLM_PLUGIN")}
    env["XDG_RUNTIME_DIR"] = str(home)
    command = ["python", "-c", CLIENT, what, str(service)]
    return subprocess.run(as_user(user, command) if user is not None else [sys.executable, *command[1:]],
                          capture_output=True, text=True, timeout=120, env=env)


def _json(result: subprocess.CompletedProcess[str]) -> dict:  # type: ignore[type-arg]
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)  # the one JSON document the client printed


@pytest.fixture
def service(short_tmp: Path) -> Iterator[DaemonProcess]:
    """The "service": hwrd as the unit's user, its socket in a directory root made for it."""
    needs_root()
    daemon = make_daemon(short_tmp, "--allow-uid", str(STRANGER.uid), "--socket-mode", "666", user=HWRD)
    daemon.start()
    try:
        yield daemon
    finally:
        finish_daemon(daemon, [])


@pytest.fixture
def runtime_dir(short_tmp: Path) -> Path:
    """The client user's own (empty) ``XDG_RUNTIME_DIR``."""
    return own(short_tmp / "xdg", STRANGER, 0o700)


def test_a_client_with_no_configuration_uses_the_service(service: DaemonProcess, runtime_dir: Path) -> None:
    reply = _json(_run("connect", service.socket, runtime_dir))
    assert reply == {"socket": str(service.socket), "root": str(service.root)}


def test_hwrctl_with_no_configuration_uses_the_service(service: DaemonProcess, runtime_dir: Path) -> None:
    status = _json(_run("hwrctl", service.socket, runtime_dir))
    assert status["root"] == str(service.root)


def test_the_vllm_plugin_with_no_configuration_uses_the_service(service: DaemonProcess, runtime_dir: Path) -> None:
    reply = _json(_run("plugin", service.socket, runtime_dir))
    assert reply == {"socket": str(service.socket), "root": str(service.root)}


def test_a_root_client_uses_the_service(service: DaemonProcess, runtime_dir: Path) -> None:
    reply = _json(_run("connect", service.socket, runtime_dir, user=None))
    assert reply["root"] == str(service.root)


def test_a_users_own_hwrd_comes_before_the_service(service: DaemonProcess, runtime_dir: Path,
                                                   short_tmp: Path) -> None:
    base = short_tmp / "mine"
    base.mkdir()
    mine = make_daemon(base, sock=runtime_dir / "hwrd.sock", root=base / "store", user=STRANGER)
    mine.start()
    try:
        reply = _json(_run("connect", service.socket, runtime_dir))
        assert reply == {"socket": str(runtime_dir / "hwrd.sock"), "root": str(mine.root)}
    finally:
        finish_daemon(mine, [])


def test_with_nothing_running_the_errors_name_every_place_looked_at(short_tmp: Path, runtime_dir: Path) -> None:
    needs_root()
    short_tmp.chmod(0o755)
    absent = short_tmp / "run" / "hwrd.sock"
    ctl = _run("hwrctl", absent, runtime_dir)
    assert ctl.returncode == 3, ctl.stderr
    line = ctl.stderr.strip()
    assert "\n" not in line and "Traceback" not in line
    assert f"hwrd is not running on {runtime_dir / 'hwrd.sock'}" in line
    assert str(absent) in line and "$HWR_SOCKET" in line
    reply = _json(_run("connect", absent, runtime_dir))
    assert reply["error"] == "DAEMON_UNAVAILABLE"
    assert str(absent) in reply["message"] and str(runtime_dir / "hwrd.sock") in reply["message"]
    assert "$HWR_SOCKET" in reply["message"]
    assert reply["details"]["looked"] == [str(runtime_dir / "hwrd.sock"), str(absent)]
    assert _json(_run("plugin", absent, runtime_dir)) == {"target": None}


def test_a_service_socket_reached_through_a_strangers_links_is_not_used(service: DaemonProcess, runtime_dir: Path,
                                                                 short_tmp: Path) -> None:
    """The service's path reached through symlinks a third user owns (they could point them at
    a daemon of their own): the client does not use it, falls back to its own default and says
    where it looked."""
    open_dir = short_tmp / "links"
    open_dir.mkdir()
    for name, target in (("hwrd.sock", service.socket), ("hwrd.sock.peer", Path(f"{service.socket}.peer"))):
        (open_dir / name).symlink_to(target)
        os.lchown(open_dir / name, NOBODY.uid, NOBODY.gid)
    ctl = _run("hwrctl", open_dir / "hwrd.sock", runtime_dir)
    assert ctl.returncode == 3, ctl.stderr
    assert f"hwrd is not running on {runtime_dir / 'hwrd.sock'}" in ctl.stderr
    assert str(open_dir / "hwrd.sock") in ctl.stderr
    assert _json(_run("plugin", open_dir / "hwrd.sock", runtime_dir)) == {"target": None}
