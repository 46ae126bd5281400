"""benchmarks/common.histogram_window: a histogram's observations between two scrapes, with
quantiles estimated from the buckets as Prometheus' histogram_quantile does."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from hwr.daemon.system.metrics import Histogram

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))  # as test_run_all does: "benchmarks" is this package

from common import histogram_window  # noqa: E402


def _samples(h: Histogram) -> dict[str, float]:
    out = {}
    for line in h.lines():
        if not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_only_the_window_counts_and_quantiles_interpolate_within_a_bucket() -> None:
    h = Histogram("p_seconds", "p", buckets=(0.001, 0.01, 0.1), label="phase")
    h.observe(0.05, "commit")  # before the window: must not count
    h.touch("admission")  # no observation in the window: left out
    before = _samples(h)
    for _ in range(50):
        h.observe(0.0005, "commit")  # bucket (0, 1 ms]
    for _ in range(50):
        h.observe(0.005, "commit")  # bucket (1, 10 ms]
    window = histogram_window(before, _samples(h), "p_seconds", "phase")
    assert set(window) == {"commit"}
    row = window["commit"]
    assert row["n"] == 100
    assert row["mean_ms"] == pytest.approx(2.75)
    assert row["p50_ms"] == pytest.approx(1.0)  # the 50th lies at the top of the first bucket
    assert row["p90_ms"] == pytest.approx(1.0 + 9.0 * 40 / 50)  # 80 % of the way through (1, 10]
    assert row["p99_ms"] == pytest.approx(1.0 + 9.0 * 49 / 50)


def test_a_quantile_past_the_last_bound_reports_that_bound() -> None:
    h = Histogram("p_seconds", "p", buckets=(0.001, 0.01), label="phase")
    before = _samples(h)
    for value in (0.0005, 5.0, 5.0, 5.0):
        h.observe(value, "commit")
    row = histogram_window(before, _samples(h), "p_seconds", "phase")["commit"]
    assert row["n"] == 4 and row["p99_ms"] == pytest.approx(10.0)
    assert row["mean_ms"] == pytest.approx((0.0005 + 15.0) / 4 * 1e3)
