"""A stop signal that arrives while hwrd is still starting is a clean stop, not a kill.

The sockets exist (and a supervisor or a test may signal) before ``start()`` returns, so the
SIGTERM handler must be installed before it: without one the default action killed the daemon
(status -15, no clean shutdown) in most tries of this test.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest


@pytest.mark.timeout(120)
def test_sigterm_as_soon_as_the_peer_socket_exists_is_a_clean_stop(short_tmp: Path) -> None:
    codes = []
    for attempt in range(3):
        root, sock = short_tmp / f"store{attempt}", short_tmp / f"s{attempt}.sock"
        argv = [sys.executable, "-m", "hwr.daemon.app.main", "--root", str(root), "--socket", str(sock)]
        proc = subprocess.Popen(argv,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while not os.path.exists(f"{sock}.peer") and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.001)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        codes.append(proc.returncode)
        assert proc.returncode == 0, (codes, err[-2000:])
