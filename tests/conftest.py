from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from daemon_proc import DaemonProcess


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A short temp dir (Unix socket paths are limited to 107 bytes)."""
    with tempfile.TemporaryDirectory(prefix="hwr-") as d:
        os.chmod(d, 0o700)
        yield Path(d)


@pytest.fixture
def hwrd(short_tmp: Path) -> Iterator[DaemonProcess]:
    root = short_tmp / "store"
    daemon = DaemonProcess(root, short_tmp / "hwrd.sock")
    daemon.start()
    try:
        yield daemon
    finally:
        daemon.stop()
