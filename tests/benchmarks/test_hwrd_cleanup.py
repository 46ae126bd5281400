"""benchmarks/common.hwrd: a benchmark killed with SIGTERM still stops its daemon (by default
SIGTERM ends Python without running ``finally`` blocks, and hwrd outlived the benchmark)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from .helpers import alive, exits_within

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(f"""
    import signal, sys, time
    sys.path.insert(0, {str(REPO)!r})
    from benchmarks.common import hwrd
    with hwrd(None) as daemon:
        print(daemon.pid, daemon.root, flush=True)
        time.sleep(120)
    print("not reached", flush=True)
""")


def test_sigterm_to_the_benchmark_stops_its_daemon_and_removes_the_store() -> None:
    bench = subprocess.Popen([sys.executable, "-c", SCRIPT], stdout=subprocess.PIPE, text=True)
    daemon_pid = 0
    try:
        assert bench.stdout is not None
        pid_text, root = bench.stdout.readline().split()
        daemon_pid = int(pid_text)
        assert alive(daemon_pid) and Path(root).is_dir()
        os.kill(bench.pid, signal.SIGTERM)
        assert bench.wait(30) == 128 + signal.SIGTERM
        assert bench.stdout.read() == ""  # the block was left by the signal, not by its end
        assert exits_within(daemon_pid, 5), "hwrd outlived the benchmark that started it"
        assert not Path(root).exists()
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
        if daemon_pid:  # a failed run must not leave its daemon behind
            exits_within(daemon_pid, 0)


def test_the_previous_sigterm_handler_is_back_after_the_block() -> None:
    script = textwrap.dedent(f"""
        import signal, sys
        sys.path.insert(0, {str(REPO)!r})
        from benchmarks.common import hwrd
        before = signal.getsignal(signal.SIGTERM)
        with hwrd(None):
            inside = signal.getsignal(signal.SIGTERM)
        print(before is signal.SIG_DFL, inside is not signal.SIG_DFL, signal.getsignal(signal.SIGTERM) is before)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "True", "True"]
