"""The demo worker processes behind ``hwr.demo`` and ``benchmarks/startup.py``, against a real hwrd.

A cold worker loads canonically and publishes; a warm worker leases, restores and streams with the
CPU zero-copy binding; both report the same output bits and the fields the benchmark reads.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hwr.demo import run_workers, worker_threads
from hwr.demo_model import DemoConfig, canonical_checkpoint

CFG = DemoConfig(hidden=64, depth=3, heads=4)


@pytest.mark.timeout(180)
def test_cold_then_warm_demo_workers_report_what_the_benchmark_reads(hwrd, short_tmp: Path) -> None:  # type: ignore[no-untyped-def]
    checkpoint = canonical_checkpoint(CFG, short_tmp / "ckpt" / "model.safetensors")
    (cold,) = run_workers("preferred", 1, None, hwrd.socket, checkpoint, CFG)
    assert cold["outcome"] == "canonical_fallback"
    assert cold["publication"]["outcome"] == "published"
    (warm,) = run_workers("preferred", 1, None, hwrd.socket, checkpoint, CFG, threads=1)
    assert warm["outcome"] == "local_hit" and warm["publication"] is None
    assert cold["offload_mode"] == warm["offload_mode"] == "bind"  # CPU: no slot copies
    assert warm["output_sha256"] == cold["output_sha256"]
    assert cold["repeatable"] and warm["repeatable"]
    assert warm["threads"] == 1 and cold["threads"] == worker_threads(1)
    for report in (cold, warm):
        assert 0 < report["startup_s"] < report["first_forward_s"]
        assert report["second_forward_s"] > 0 and report["pss_kib"] > report["baseline_kib"] > 0
    (plain,) = run_workers("preferred", 1, None, hwrd.socket, checkpoint, CFG, offload=False)
    assert plain["offload_mode"] == "none" and plain["output_sha256"] == cold["output_sha256"]


def test_worker_threads_split_the_cores() -> None:
    import os

    cores = os.cpu_count() or 1
    assert worker_threads(1) == cores
    assert worker_threads(cores * 4) == 1
    assert all(worker_threads(n) * n <= max(cores, n) for n in range(1, 9))
