"""``python -m hwr.demo`` fails in one line naming what is missing, never with a traceback.

The demo runs as the user runs it (a subprocess, real files); the fault is injected at the
environment's boundary: a package made unimportable (``sys.modules[name] = None``, what a venv
without it looks like to ``import``), or a store hwrd cannot use.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(180)


def demo(work: Path, *args: str, block: str = "") -> subprocess.CompletedProcess[str]:
    prelude = f"sys.modules[{block!r}] = None; " if block else ""
    code = f"import sys; {prelude}from hwr.demo import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, "--size-mb", "2", "--hidden", "64", "--workers", "1",
                           "--workdir", str(work), *args], capture_output=True, text=True, timeout=150)


def test_a_missing_package_is_one_line_naming_it_and_the_fix(short_tmp: Path) -> None:
    # The demo's first step writes its checkpoint with safetensors, which imports numpy.
    result = demo(short_tmp / "demo", block="numpy")
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert "Traceback" not in result.stderr, result.stderr
    assert lines[-1].startswith("hwr.demo: the Python package 'numpy' is missing"), lines
    assert "bash scripts/setup.sh" in lines[-1]


def test_a_daemon_that_cannot_start_is_one_line_naming_its_log(short_tmp: Path) -> None:
    work = short_tmp / "demo"
    work.mkdir()
    (work / "store").write_text("a file where hwrd's store directory should be\n")
    result = demo(work)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"hwr.demo: hwrd did not start on {work / 'store'}"), last
    assert "hwrd-store.log" in last
