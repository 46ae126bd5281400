"""hwrd and hwrctl start without importing torch (start time and the daemon's memory)."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    "modules",
    [
        "hwr.daemon.main, hwr.daemon.server",
        "hwr.daemon.ctl, hwr.daemon.ctl_checkpoints, hwr.daemon.ctl_store_admin, hwr.client",
    ],
)
def test_no_torch_import(modules: str) -> None:
    code = f"import sys, {modules}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False", f"{modules} imported torch"
