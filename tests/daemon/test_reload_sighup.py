"""SIGHUP: a new allow-list applies to new connections while existing leases stay held; keys that
need a restart are kept and reported; an invalid file changes nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ops_helpers import NotifySocket, started, wait_for

from hwr.client import ArtifactIdentity, connect
from hwr.daemon.app.launcher import DaemonProcess
from hwr.daemon.app.reload import plan_reload
from hwr.daemon.system.config import load_config

NOBODY = 65534


def test_plan_reload_applies_reloadable_and_refuses_the_rest() -> None:
    old = load_config(None, env={"HWR_ROOT": "/r", "HWR_SOCKET": "/s"})
    new = load_config(None, env={"HWR_ROOT": "/other", "HWR_SOCKET": "/s", "HWR_ALLOW_UIDS": "7",
                                 "HWR_LOG_LEVEL": "debug"})
    plan = plan_reload(old, new, lambda key: key in ("allow_uids", "log_level"))
    assert set(plan.applied) == {"allow_uids", "log_level"} and plan.refused == ("root",)
    assert (plan.config.allow_uids, plan.config.log_level, plan.config.root) == ((7,), "debug", "/r")


AS_NOBODY = """
import os, sys
import grpc  # loaded before the privileges go
import grpc._channel  # grpc imports it lazily; the checkout may be private (0700)
import hwr.client.lease  # noqa: F401 - the stdlib extensions it needs are not readable as nobody
from hwr.client import connect
from hwr.client.errors import HwrError
os.setgid(65534); os.setgroups([]); os.setuid(65534)
try:
    with connect(sys.argv[1], timeout=60) as client, client.acquire(sys.argv[2]) as lease:
        print("connected", os.getuid(), len(lease.tensors))
except HwrError as exc:
    print("refused", os.getuid(), exc.code)
"""


def _nobody_connects(sock: Path, key: str) -> bool:
    """Connect and acquire as uid nobody in a fresh process; True when allowed."""
    out = subprocess.run([sys.executable, "-c", AS_NOBODY, str(sock), key], capture_output=True,
                         text=True, timeout=120)
    words = out.stdout.split()
    assert len(words) == 3 and words[1] == str(NOBODY), (out.stdout, out.stderr)
    if words[0] == "refused":
        assert words[2] == "PERMISSION_DENIED"
    return words[0] == "connected"


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping to another uid needs root")
@pytest.mark.timeout(240)
def test_sighup_applies_allow_list_without_dropping_leases(short_tmp: Path) -> None:
    short_tmp.chmod(0o755)  # the store stays 0700; the sockets become reachable for nobody
    config = short_tmp / "hwrd.toml"
    config.write_text("socket_mode = 0o666\nallow_uids = []\n")
    notify = NotifySocket(short_tmp / "notify")
    daemon = DaemonProcess(short_tmp / "store", short_tmp / "hwrd.sock", "--config", str(config),
                           env={"NOTIFY_SOCKET": str(notify.path)})
    try:
        with started(daemon), connect(daemon.socket) as client:
            notify.until("READY", 60)
            key = client.publish(ArtifactIdentity.simple("reload/model"), {"w": torch.arange(64.0)})
            lease = client.acquire(key)
            assert not _nobody_connects(daemon.socket, key)

            config.write_text("socket_mode = 0o600\nallow_uids = [65534]\nlog_level = \"debug\"\n")
            os.kill(daemon.pid, signal.SIGHUP)
            ready, seen = notify.until("READY", 60)
            assert any(m.get("RELOADING") == "1" for m in seen) and ready["STATUS"].startswith("serving")
            assert _nobody_connects(daemon.socket, key)
            # The lease taken before the reload is intact and still listed.
            assert float(lease.tensors["w"].sum()) == float(torch.arange(64.0).sum())
            assert lease.lease_id in [x["lease_id"] for x in client.leases()]
            assert os.stat(daemon.socket).st_mode & 0o777 == 0o666  # socket_mode needs a restart
            log = daemon.log.read_text()
            assert "cannot reload socket_mode without a restart" in log and "configuration reloaded" in log

            config.write_text("allow_uids = [\n")  # broken: nothing changes, daemon keeps serving
            os.kill(daemon.pid, signal.SIGHUP)
            failed, _ = notify.until("STATUS", 60)
            assert failed["STATUS"].startswith("reload failed")
            wait_for(lambda: "reload failed" in daemon.log.read_text(), 30, "reload failure logged")
            assert _nobody_connects(daemon.socket, key)
            lease.close()
    finally:
        notify.close()
