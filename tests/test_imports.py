"""hwrd and hwrctl start without importing torch (start time and the daemon's memory)."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    "modules",
    [
        "hwr.daemon.app.main, hwr.daemon.app.server",
        # what the daemon imports when it runs (not only at module import): store, leases, peer
        "hwr.daemon.store.root, hwr.daemon.service.capacity, hwr.daemon.service.publishing, "
        "hwr.daemon.peer.server, hwr.daemon.service.leasing, hwr.daemon.checkpoints.registry, "
        "hwr.daemon.rpc.checkpoints, hwr.daemon.rpc.store_admin",
        "hwr.daemon.ctl.cli, hwr.daemon.ctl.checkpoints, hwr.daemon.ctl.store_admin, hwr.client",
    ],
)
def test_no_torch_import(modules: str) -> None:
    code = f"import sys, {modules}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False", f"{modules} imported torch"


def test_a_serving_daemon_never_loads_torch(short_tmp) -> None:
    """Module imports are not enough: the daemon loads store and lease code at run time. After a
    publication and a lease, its address space must hold no torch library (producers run in
    their own processes)."""
    import torch
    from daemon_proc import DaemonProcess, finish_daemon

    from hwr.client import ArtifactIdentity, connect

    daemon = DaemonProcess(short_tmp / "store", short_tmp / "hwrd.sock").start()
    try:
        with connect(daemon.socket) as client:
            key = client.publish(ArtifactIdentity.simple("no-torch"), {"w": torch.ones(8)})
            with client.acquire(key) as lease:
                assert float(lease.tensors["w"][3]) == 1.0
        with open(f"/proc/{daemon.pid}/maps") as f:
            torch_maps = [line for line in f if "libtorch" in line or "/torch/" in line]
    finally:
        finish_daemon(daemon)
    assert not torch_maps, torch_maps[:3]
