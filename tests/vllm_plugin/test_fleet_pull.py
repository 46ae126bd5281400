"""vLLM-Omni's own runtime on a new node whose artifact is being pulled from the fleet tier.

Node A (on a real S3 server, moto's) publishes a vLLM-Omni artifact after a cold start and
pushes it; node B reaches the same server through ``SlowLink`` (a throttled relay), so its
pull takes seconds. A ``required`` start on B waits for the pull (the plugin logs its progress)
and gets the lease; a ``preferred`` start with ``HWR_PREFERRED_PULL=fallback`` loads
canonically at once, does not build what the pull brings, and the next start is warm.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm_omni")
pytest.importorskip("moto.server")

import torch
from e2e.fleet_fixtures import S3Server, SlowLink, node
from vllm_omni.host_weight_runtime import PostLoadPublicationOutcome, ResolutionOutcome, RuntimeMode
from vo_helpers import TensorProducer, identity, runtime

pytestmark = pytest.mark.usefixtures("plugin")

MIB = 1 << 20
RATE = 2 * MIB  # the 8 MiB artifact takes ~4 s through the slow link


@pytest.fixture
def nodes(short_tmp: Path) -> Iterator[dict[str, Any]]:
    server = S3Server(short_tmp / "moto.log").start()
    client = server.client()
    client.create_bucket(Bucket="vo-fleet")
    remote = "s3://vo-fleet/hwr"
    link = SlowLink(server.port, RATE)
    a = node(short_tmp, "a", remote, endpoint=server.endpoint).start()
    b = node(short_tmp, "b", remote, "--remote-push", "false", endpoint=link.endpoint).start()
    try:
        yield {"a": a, "b": b, "s3": client, "link": link, "base": short_tmp}
    finally:
        for proc in (a, b):
            proc.stop()
        link.close()
        server.stop()


def big_tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"blocks.{i}.weight": torch.randn(1024, 1024, generator=g).to(torch.bfloat16) for i in range(4)}


def published_on_a(env: dict[str, Any], model: str, data: dict[str, torch.Tensor],
                   monkeypatch: pytest.MonkeyPatch) -> Any:
    ident = identity(model)
    monkeypatch.setenv("HWR_SOCKET", str(env["a"].socket))
    rt = runtime(env["base"] / f"rt-a-{model.replace('/', '-')}")
    assert rt.resolve(ident).report.outcome is ResolutionOutcome.CANONICAL_FALLBACK
    assert rt.publish_after_load(ident, producer=TensorProducer(ident, data)).outcome is \
        PostLoadPublicationOutcome.PUBLISHED
    deadline = time.monotonic() + 60
    while "Contents" not in env["s3"].list_objects_v2(Bucket="vo-fleet", Prefix=f"hwr/artifacts/{ident.key}/READY"):
        assert time.monotonic() < deadline, "the artifact was never pushed"
        time.sleep(0.1)
    return ident


def rt_root(env: dict[str, Any], name: str) -> Path:
    root = env["base"] / name
    root.mkdir(mode=0o700)
    return root


@pytest.mark.timeout(240)
def test_a_required_start_waits_for_the_pull_and_logs_it(nodes: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    data = big_tensors(1)
    ident = published_on_a(nodes, "fleet/required", data, monkeypatch)
    monkeypatch.setenv("HWR_SOCKET", str(nodes["b"].socket))
    caplog.set_level(logging.INFO, logger="hwr.vllm_plugin")
    rt = runtime(rt_root(nodes, "rt-b"), RuntimeMode.REQUIRED)
    started = time.monotonic()
    resolution = rt.resolve(ident)
    took = time.monotonic() - started
    assert resolution.report.outcome is ResolutionOutcome.LOCAL_HIT, resolution.report
    try:
        for name, t in data.items():
            assert torch.equal(resolution.lease.tensors[name], t), name
    finally:
        resolution.lease.close()
    assert took > 1.0  # the pull through the slow link, waited for
    lines = [r.getMessage() for r in caplog.records if "waits for hwrd's pull" in r.getMessage()]
    assert lines and ident.key[:16] in lines[0] and "s3://vo-fleet/hwr" in lines[0], lines


@pytest.mark.timeout(240)
def test_preferred_with_fallback_loads_canonically_at_once_and_the_next_start_is_warm(
        nodes: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    data = big_tensors(2)
    ident = published_on_a(nodes, "fleet/fallback", data, monkeypatch)
    monkeypatch.setenv("HWR_SOCKET", str(nodes["b"].socket))
    monkeypatch.setenv("HWR_PREFERRED_PULL", "fallback")
    rt = runtime(rt_root(nodes, "rt-b"), RuntimeMode.PREFERRED)
    started = time.monotonic()
    cold = rt.resolve(ident)
    assert cold.report.outcome is ResolutionOutcome.CANONICAL_FALLBACK, cold.report
    assert time.monotonic() - started < 3  # at once: the ~4 s pull goes on without this start
    producer = TensorProducer(ident, data)
    after = rt.publish_after_load(ident, producer=producer)
    assert after.outcome is not PostLoadPublicationOutcome.PUBLISHED and producer.calls == 0  # the pull brings it
    deadline = time.monotonic() + 60
    while True:  # the next start is warm once the pull that this one left running has committed
        warm = rt.resolve(ident)
        if warm.report.outcome is ResolutionOutcome.LOCAL_HIT:
            break
        assert time.monotonic() < deadline, warm.report
        time.sleep(0.5)
    try:
        for name, t in data.items():
            assert torch.equal(warm.lease.tensors[name], t), name
    finally:
        warm.lease.close()
    assert nodes["link"].sent["down"] < 2 * 8 * MIB  # one pull for every start
