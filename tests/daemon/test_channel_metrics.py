"""Channels in the metrics: aggregate gauges and a switch counter, never a name or key as a label."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from ops_helpers import parse_samples, scrape_unix, started

from hwr.client import ArtifactIdentity, connect
from hwr.daemon.app.launcher import DaemonProcess


@pytest.mark.timeout(180)
def test_channels_watchers_and_switches_are_counted(short_tmp: Path) -> None:
    metrics = short_tmp / "metrics.sock"
    with started(DaemonProcess(short_tmp / "store", short_tmp / "hwrd.sock", "--metrics-listen",
                               f"unix:{metrics}")) as daemon, connect(daemon.socket) as client:
        before = parse_samples(scrape_unix(metrics))
        assert (before["hwr_channels"], before["hwr_channel_switches_total"]) == (0, 0)
        for i in range(3):
            client.publish(ArtifactIdentity.simple(f"metrics/ch{i}"), {"w": torch.full((64,), float(i))},
                           channel="metrics-a", durable=i != 2)
        client.publish(ArtifactIdentity.simple("metrics/other"), {"w": torch.ones(64)}, channel="metrics-b")
        with client.watch_channel("metrics-a"), client.watch_channel("metrics-b"):
            text = scrape_unix(metrics)
        samples = parse_samples(text)
        assert samples["hwr_channels"] == 2
        assert samples["hwr_channel_watchers"] == 2
        assert samples["hwr_channels_non_durable"] == 1
        assert samples["hwr_channel_switches_total"] == 4
        assert "metrics-a" not in text and client.inspect_channel("metrics-a")["key"] not in text
