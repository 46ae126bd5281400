"""Metrics: the exposition format, loopback-only listening, label hygiene, and a scrape taken
while clients acquire and release in parallel shows counters consistent with each other."""

from __future__ import annotations

import itertools
import threading
from pathlib import Path

import pytest
import torch
from ops_helpers import parse_samples, scrape_unix, started

from hwr.client import ArtifactIdentity, connect
from hwr.daemon.app.launcher import DaemonProcess
from hwr.daemon.system.metrics import PUBLICATION_PHASES, Counter, Histogram, label_value, parse_listen


def test_histogram_buckets_are_cumulative() -> None:
    h = Histogram("x_seconds", "x", buckets=(0.1, 1.0))
    for v in (0.05, 0.5, 0.5, 5.0):
        h.observe(v)
    samples = parse_samples("\n".join(h.lines()))
    assert samples == {'x_seconds_bucket{le="0.1"}': 1, 'x_seconds_bucket{le="1"}': 3,
                       'x_seconds_bucket{le="+Inf"}': 4, "x_seconds_sum": 6.05, "x_seconds_count": 4}


def test_labelled_histogram_keeps_one_cumulative_series_per_label() -> None:
    h = Histogram("p_seconds", "p", buckets=(0.01, 1.0), label="phase")
    h.touch("admission")
    for v in (0.005, 0.5, 2.0):
        h.observe(v, "commit")
    samples = parse_samples("\n".join(h.lines()))
    assert samples == {
        'p_seconds_bucket{phase="admission",le="0.01"}': 0, 'p_seconds_bucket{phase="admission",le="1"}': 0,
        'p_seconds_bucket{phase="admission",le="+Inf"}': 0, 'p_seconds_sum{phase="admission"}': 0,
        'p_seconds_count{phase="admission"}': 0,
        'p_seconds_bucket{phase="commit",le="0.01"}': 1, 'p_seconds_bucket{phase="commit",le="1"}': 2,
        'p_seconds_bucket{phase="commit",le="+Inf"}': 3, 'p_seconds_sum{phase="commit"}': 2.505,
        'p_seconds_count{phase="commit"}': 3,
    }
    assert h.count == 3


@pytest.mark.parametrize("bad", ["/var/cache/hwr/artifacts", "org/model", "boom: it failed", ""])
def test_labels_refuse_paths_names_and_messages(bad: str) -> None:
    with pytest.raises(ValueError):
        label_value(bad)
    with pytest.raises(ValueError):
        Counter("c_total", "c", "code").inc(bad)
    with pytest.raises(ValueError):
        Histogram("h_seconds", "h", label="phase").observe(0.1, bad)


def test_listen_only_on_loopback_or_unix() -> None:
    assert parse_listen("127.0.0.1:9464") == ("127.0.0.1", 9464)
    assert parse_listen("[::1]:9464") == ("::1", 9464)
    assert parse_listen("unix:/run/hwrd/metrics.sock") == ("unix", "/run/hwrd/metrics.sock")
    for bad in ("0.0.0.0:9464", "10.0.0.1:80", "9464", "unix:relative"):
        with pytest.raises(ValueError):
            parse_listen(bad)


@pytest.mark.timeout(240)
def test_scrape_during_load_is_consistent(short_tmp: Path) -> None:
    metrics = short_tmp / "metrics.sock"
    with started(DaemonProcess(short_tmp / "store", short_tmp / "hwrd.sock", "--metrics-listen",
                               f"unix:{metrics}")) as daemon:
        _load_and_scrape(daemon, metrics, short_tmp)


def _load_and_scrape(daemon: DaemonProcess, metrics: Path, short_tmp: Path) -> None:
    before = parse_samples(scrape_unix(metrics))
    for phase in PUBLICATION_PHASES:  # exported (at zero) before the first publication
        assert before[f'hwr_publication_phase_seconds_count{{phase="{phase}"}}'] == 0
    with connect(daemon.socket) as client:
        key = client.publish(ArtifactIdentity.simple("metrics/model"), {"w": torch.ones(1024)})
        # Joining a finished artifact is no publication: no phase is observed for it.
        assert client.publish(ArtifactIdentity.simple("metrics/model"), {"w": torch.ones(1024)}) == key
    published = parse_samples(scrape_unix(metrics))
    for phase in PUBLICATION_PHASES:
        assert published[f'hwr_publication_phase_seconds_count{{phase="{phase}"}}'] == 1, phase
        assert published[f'hwr_publication_phase_seconds_bucket{{phase="{phase}",le="+Inf"}}'] == 1
    # A commit fsyncs: it takes time, and its phases' times fit inside the whole publication.
    assert 0 < published['hwr_publication_phase_seconds_sum{phase="commit"}'] < 60
    stop = threading.Event()
    errors: list[BaseException] = []

    def load() -> None:
        try:
            with connect(daemon.socket) as c:
                while not stop.is_set():
                    with c.acquire(key):
                        pass
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=load) for _ in range(3)]
    for t in threads:
        t.start()
    scrapes = []
    try:
        while len(scrapes) < 8 or scrapes[-1]["hwr_leases_granted_total"] < 20:
            scrapes.append(parse_samples(scrape_unix(metrics)))
            assert len(scrapes) < 2000
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert not errors, errors
    for s in scrapes:
        assert s["hwr_leases_granted_total"] - s["hwr_leases_released_total"] == s["hwr_leases"]
        assert s["hwr_acquire_duration_seconds_count"] == s["hwr_leases_granted_total"]
        assert s['hwr_acquire_duration_seconds_bucket{le="+Inf"}'] == s["hwr_acquire_duration_seconds_count"]
        buckets = [v for k, v in s.items() if k.startswith("hwr_acquire_duration_seconds_bucket")]
        assert buckets == sorted(buckets)
        assert s["hwr_artifacts"] == 1 and s["hwr_store_bytes"] > 4096
        assert s['hwr_publications_total{outcome="committed"}'] == 1
        assert s['hwr_publication_phase_seconds_count{phase="commit"}'] == 1
        assert 0 <= s["hwr_leases"] <= 3 and s["hwr_sessions"] >= 0
    for earlier, later in itertools.pairwise(scrapes):  # counters never go down
        for name in ("hwr_leases_granted_total", "hwr_leases_released_total"):
            assert later[name] >= earlier[name]
    final = parse_samples(scrape_unix(metrics))
    assert final["hwr_leases"] == 0 and final["hwr_leases_granted_total"] == final["hwr_leases_released_total"]
    text = scrape_unix(metrics)
    assert str(short_tmp) not in text and "metrics/model" not in text and key not in text
