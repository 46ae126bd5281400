"""Shared helpers for hwr benchmarks: tables, percentiles, fresh-process workers, a real hwrd, PSS.

Every benchmark prints markdown tables for people and ends with ONE JSON line (``json_line``) for
scripts. Timed work runs in fresh processes (``run_worker``) so that nothing is cached in the
measuring process; a worker prints its result as the last line of its stdout.

Nothing here mocks hwr: ``hwrd()`` starts the real daemon through ``tests/daemon_proc.py``.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
PAGE = 4096

__all__ = [
    "PAGE",
    "REPO",
    "Daemon",
    "fmt_ms",
    "fmt_ratio",
    "hwrd",
    "json_line",
    "md_table",
    "median",
    "percentile",
    "pss_kib",
    "run_worker",
    "short_tmpdir",
    "summarize",
    "touch_pages",
    "wait_until",
]


# --- formatting ------------------------------------------------------------------------------
def md_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub markdown table; cells are ``str()``-ed, ``None`` prints as an empty cell."""
    def cell(value: object) -> str:
        return "" if value is None else str(value).replace("|", "\\|")

    lines = ["| " + " | ".join(cell(h) for h in headers) + " |",
             "| " + " | ".join("---" for _ in headers) + " |"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def fmt_ms(value_ms: float | None, digits: int | None = None) -> str:
    """Milliseconds with a precision that suits the magnitude (``-`` for missing)."""
    if value_ms is None or (isinstance(value_ms, float) and math.isnan(value_ms)):
        return "-"
    if digits is None:
        digits = 3 if value_ms < 1 else 2 if value_ms < 10 else 1 if value_ms < 100 else 0
    return f"{value_ms:,.{digits}f} ms"


def fmt_ratio(baseline: float | None, value: float | None) -> str:
    """``baseline / value`` as ``12.3x`` (how many times faster ``value`` is)."""
    if not baseline or not value:
        return "-"
    ratio = baseline / value
    return f"{ratio:,.0f}x" if ratio >= 100 else f"{ratio:,.1f}x" if ratio >= 10 else f"{ratio:.2f}x"


def json_line(results: dict[str, Any], json_out: str | os.PathLike[str] | None = None) -> str:
    """Print ``results`` as one compact JSON line (the last line of a benchmark's output)."""
    line = json.dumps(results, separators=(",", ":"), sort_keys=True, default=str)
    if json_out:
        Path(json_out).write_text(line + "\n")
    print(line, flush=True)
    return line


# --- statistics ------------------------------------------------------------------------------
def percentile(values: Sequence[float], p: float) -> float:
    """Linear-interpolated percentile (``p`` in 0..100), like ``numpy.percentile``'s default."""
    if not values:
        return math.nan
    ordered = sorted(values)
    if len(ordered) == 1:
        return float(ordered[0])
    rank = (len(ordered) - 1) * min(max(p, 0.0), 100.0) / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return float(ordered[low] + (ordered[high] - ordered[low]) * (rank - low))


def median(values: Sequence[float]) -> float:
    return percentile(values, 50.0)


def summarize(values: Sequence[float]) -> dict[str, float]:
    """n, min, p50, p90, p99, max and mean of a sample."""
    if not values:
        return {"n": 0}
    return {"n": len(values), "min": float(min(values)), "p50": percentile(values, 50),
            "p90": percentile(values, 90), "p99": percentile(values, 99),
            "max": float(max(values)), "mean": float(sum(values) / len(values))}


# --- processes -------------------------------------------------------------------------------
def run_worker(argv: Sequence[str], *, timeout: float = 300.0, env: dict[str, str] | None = None) -> Any:
    """Run ``python ARGV...`` in a fresh process; return the JSON of its last stdout line.

    Raises ``RuntimeError`` with the worker's stderr tail when it fails or prints no JSON.
    """
    proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})}, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"worker {' '.join(argv[:3])} failed with {proc.returncode}:\n"
                           f"{proc.stderr[-3000:]}{proc.stdout[-1000:]}")
    try:
        return json.loads(lines[-1])
    except ValueError:
        raise RuntimeError(f"worker printed no JSON result: {lines[-1][:500]!r}\n{proc.stderr[-2000:]}") from None


def pss_kib(pid: int | str = "self") -> dict[str, int]:
    """Rss/Pss (and their anon/file/shmem parts) of a process in KiB, from ``smaps_rollup``."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name in {"Rss", "Pss", "Pss_Anon", "Pss_File", "Pss_Shmem", "Anonymous"}:
                    out[name] = int(rest.split()[0])
    except OSError:
        pass
    return out


# --- memory ----------------------------------------------------------------------------------
def touch_pages(tensors: Any) -> int:
    """Read one byte per 4 KiB page of every tensor (plus its last byte); returns a checksum.

    Faults in every page of mapped tensors, the way a worker's first use would. The checksum (a
    sum of the sampled bytes, in name order) must be equal for the same bytes loaded any way.
    Tensors must be contiguous (loaders here return contiguous tensors).
    """
    total = 0
    for name in sorted(tensors):
        tensor = tensors[name]
        if tensor.numel() == 0:
            continue
        flat = tensor.reshape(-1).view(torch.uint8)
        total += int(flat[::PAGE].sum()) + int(flat[-1])
    return total


# --- daemon ----------------------------------------------------------------------------------
@contextlib.contextmanager
def _exit_on_sigterm() -> Iterator[None]:
    """SIGTERM raises ``SystemExit(143)`` in the main thread inside the block (the previous
    handler is restored after); off the main thread, or when someone else already handles
    SIGTERM, nothing changes."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, _sigterm_exit):
        yield
        return
    previous = signal.signal(signal.SIGTERM, _sigterm_exit)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _sigterm_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$")


def scrape_metrics(path: Path, timeout: float = 10.0) -> dict[str, float]:
    """``name{labels}`` -> value, from one ``GET /metrics`` of hwrd's metrics listener on the
    Unix socket ``path`` (``hwrd --metrics-listen unix:PATH``)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(str(path))
        sock.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        chunks = []
        while chunk := sock.recv(1 << 16):
            chunks.append(chunk)
    head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.") or b" 200 " not in head.split(b"\r\n", 1)[0]:
        raise RuntimeError(f"metrics scrape failed: {head[:200]!r}")
    samples = {}
    for line in body.decode().splitlines():
        match = _SAMPLE.match(line)
        if match:
            samples[match.group(1) + (match.group(2) or "")] = float(match.group(3))
    return samples


def histogram_window(before: dict[str, float], after: dict[str, float], name: str,
                     label: str) -> dict[str, dict[str, float]]:
    """Per value of ``label``: observations of histogram ``name`` between two scrapes, as n, mean
    and p50/p90/p99 in ms. Quantiles are estimated from the buckets as Prometheus'
    ``histogram_quantile`` does (linear within a bucket), so they are only as fine as the buckets;
    one that falls in the +Inf bucket is reported as the largest finite bound."""
    series: dict[str, list[tuple[float, float]]] = {}
    prefix = f"{name}_bucket{{{label}=\""
    for key, value in after.items():
        if key.startswith(prefix):
            which, _, le = key[len(prefix):].partition('",le="')
            bound = math.inf if le.startswith("+Inf") else float(le.rstrip('"}'))
            series.setdefault(which, []).append((bound, value - before.get(key, 0.0)))
    out = {}
    for which, buckets in sorted(series.items()):
        buckets.sort()
        n = buckets[-1][1]
        if n <= 0:
            continue
        total = after.get(f'{name}_sum{{{label}="{which}"}}', 0.0) - before.get(f'{name}_sum{{{label}="{which}"}}', 0.0)
        row = {"n": n, "mean_ms": total / n * 1e3}
        for q in (0.5, 0.9, 0.99):
            rank, lower, below, estimate = q * n, 0.0, 0.0, 0.0
            for bound, cumulative in buckets:
                if cumulative >= rank:
                    if math.isinf(bound):
                        estimate = lower
                    else:
                        share = (rank - below) / (cumulative - below) if cumulative > below else 1.0
                        estimate = lower + (bound - lower) * share
                    break
                lower, below = bound, cumulative
            row[f"p{round(q * 100)}_ms"] = estimate * 1e3
        out[which] = row
    return out


def short_tmpdir(prefix: str = "hwb-") -> Path:
    """A private (0700) directory directly under /tmp, short enough for Unix socket paths."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))


@dataclass
class Daemon:
    """A running hwrd: its socket, store root, pid and log file."""

    socket: Path
    root: Path
    pid: int
    log: Path
    proc: Any


@contextlib.contextmanager
def hwrd(root: Path | None = None, *extra: str, keep: bool = False,
         env: dict[str, str] | None = None) -> Iterator[Daemon]:
    """Run a real hwrd on a fresh store root (``root``, or one under a temp dir) and a /tmp socket.

    The socket lives in its own short /tmp directory (Unix socket paths are limited to 107
    bytes). The daemon is stopped with SIGTERM on exit; temp dirs are removed unless ``keep``.
    While it runs, a SIGTERM to the benchmark itself (from the main thread's view) raises
    ``SystemExit(143)`` so this cleanup still runs: by default SIGTERM ends Python without
    unwinding, and the daemon would outlive its benchmark.
    """
    tests_dir = str(REPO / "tests")
    if tests_dir not in sys.path:
        sys.path.insert(0, tests_dir)
    from daemon_proc import DaemonProcess

    sock_dir = short_tmpdir("hwb-")
    made_root = root is None
    if root is None:
        root = sock_dir / "root"
    proc = DaemonProcess(root, sock_dir / "hwrd.sock", *extra, env=env)
    stack = contextlib.ExitStack()
    stack.enter_context(_exit_on_sigterm())
    stack.callback(proc.stop)
    try:
        proc.start()
        yield Daemon(socket=sock_dir / "hwrd.sock", root=root, pid=proc.pid, log=proc.log, proc=proc)
    finally:
        stack.close()  # stop the daemon, then restore the SIGTERM handler
        if not keep:
            shutil.rmtree(sock_dir, ignore_errors=True)
            if made_root:
                shutil.rmtree(root, ignore_errors=True)


def freeze_startup_heap() -> None:
    """Collect and freeze the startup garbage of a client process (importing torch leaves
    ~10^5 objects): afterwards the cyclic collector never walks them again, so a full
    collection (~100+ ms in a fresh torch process, holding the GIL) does not land inside a timed
    operation by chance. vLLM does the same in its workers after start-up
    (``vllm.utils.gc_utils.freeze_gc_heap``), so this is the client a real deployment runs."""
    gc.collect()
    gc.freeze()


def wait_until(deadline: float, clock: Callable[[], float] = time.monotonic) -> None:
    """Sleep until ``clock()`` reaches the deadline (a barrier, or a paced loop's slot).

    No busy spin: with many clients on few cores spinning would steal the CPU being measured;
    the cost is the kernel's timer slack (tens of microseconds).
    """
    left = deadline - clock()
    while left > 0:
        time.sleep(left)
        left = deadline - clock()
