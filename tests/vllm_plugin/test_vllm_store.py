"""vLLM-Omni's own HostWeightRuntime resolving and publishing through a real hwrd."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("vllm_omni")

import torch
from vllm_omni.host_weight_runtime import (
    FailureCode,
    LookupPhase,
    PostLoadPublicationOutcome,
    ResolutionAction,
    ResolutionOutcome,
    RuntimeMode,
    ValidationLevel,
    WeightManifest,
)
from vo_helpers import TensorProducer, identity, runtime, sha256_of, tensors

import hwr.client
from hwr.dlo_backend.vllm_plugin.store import HwrdHostWeightStore

pytestmark = pytest.mark.usefixtures("plugin")


def _leases(daemon) -> list[dict]:
    with hwr.client.connect(daemon.socket) as c:
        return c.leases()


def test_cold_fallback_publish_then_warm_hit_with_equal_tensors(vo_hwrd, runtime_root, monkeypatch):
    monkeypatch.setenv("HWR_SOCKET", str(vo_hwrd.socket))
    ident, data = identity("roundtrip/model"), tensors(1)
    rt = runtime(runtime_root)
    assert isinstance(rt.store, HwrdHostWeightStore)

    cold = rt.resolve(ident)
    assert cold.report.outcome is ResolutionOutcome.CANONICAL_FALLBACK and cold.lease is None
    producer = TensorProducer(ident, data)
    published = rt.publish_after_load(ident, producer=producer)
    assert published.outcome is PostLoadPublicationOutcome.PUBLISHED, published.failure
    assert producer.calls == 1
    assert not _leases(vo_hwrd), "publish_after_load must close the lease it got"

    warm = rt.resolve(ident)
    assert warm.report.outcome is ResolutionOutcome.LOCAL_HIT
    lease = warm.lease
    assert lease.provenance.resolution_source == "hwrd" and lease.provenance.identity_digest == ident.key
    assert set(lease.tensors) == set(data)
    for name, t in data.items():
        assert torch.equal(lease.tensors[name], t), name
    # vLLM-Omni's own manifest validation: the strict parser accepts the daemon's document byte for byte,
    # and every tensor's bytes match the digest it records.
    assert WeightManifest.from_dict(json.loads(lease.manifest.canonical_bytes)) == lease.manifest
    assert lease.manifest.identity == ident and lease.manifest.artifact_key == ident.key
    for entry in lease.manifest.tensors:
        assert sha256_of(lease.tensors[entry.name]) == entry.sha256
    assert {e.kind.value for e in lease.manifest.tensors} == {"parameter", "buffer"}
    assert lease.mapped_regions and all(r.read_only and r.length > 0 for r in lease.mapped_regions)
    leases = _leases(vo_hwrd)
    assert [x["key"] for x in leases] == [ident.key]
    lease.close()
    lease.close()
    assert not _leases(vo_hwrd)

    again = rt.publish_after_load(ident, producer=TensorProducer(ident, data))
    assert again.outcome is PostLoadPublicationOutcome.ALREADY_PRESENT


def test_marker_file_in_the_runtime_root_selects_hwrd(vo_hwrd, runtime_root):
    (runtime_root / "hwrd.json").write_text(json.dumps({"socket": str(vo_hwrd.socket)}))
    ident, data = identity("marker/model"), tensors(2)
    rt = runtime(runtime_root)
    assert isinstance(rt.store, HwrdHostWeightStore) and rt.store.target.origin.endswith("hwrd.json")
    assert rt.publish_after_load(ident, producer=TensorProducer(ident, data)).outcome is (
        PostLoadPublicationOutcome.PUBLISHED)
    warm = rt.resolve(ident)
    assert warm.report.outcome is ResolutionOutcome.LOCAL_HIT
    warm.lease.close()


def test_full_checksum_level_is_served_from_the_daemons_validation(vo_hwrd, runtime_root, monkeypatch):
    monkeypatch.setenv("HWR_SOCKET", str(vo_hwrd.socket))
    ident, data = identity("checksum/model"), tensors(3)
    runtime(runtime_root).publish_after_load(ident, producer=TensorProducer(ident, data))
    warm = runtime(runtime_root, validation=ValidationLevel.FULL_CHECKSUM).resolve(ident)
    assert warm.report.outcome is ResolutionOutcome.LOCAL_HIT
    assert warm.lease.provenance.validation_level == "full_checksum"
    warm.lease.close()
    verity = runtime(runtime_root, validation=ValidationLevel.FS_VERITY).resolve(ident)
    assert verity.report.outcome is ResolutionOutcome.FAILED
    assert verity.report.attempts[-1].failure.code is FailureCode.UNSUPPORTED


def test_local_production_then_hit_runs_the_producer_once(vo_hwrd, runtime_root, monkeypatch):
    monkeypatch.setenv("HWR_SOCKET", str(vo_hwrd.socket))
    ident, data = identity("build/model"), tensors(4)
    producer = TensorProducer(ident, data, phase=LookupPhase.PRE_LOAD_SAFE)
    rt = runtime(runtime_root, local_build=True)
    built = rt.resolve(ident, producer=producer)
    assert built.report.outcome is ResolutionOutcome.LOCAL_PRODUCTION, built.report
    assert torch.equal(built.lease.tensors["blocks.0.weight"], data["blocks.0.weight"])
    built.lease.close()
    hit = rt.resolve(ident, producer=producer)
    assert hit.report.outcome is ResolutionOutcome.LOCAL_HIT and producer.calls == 1
    hit.lease.close()


@pytest.mark.parametrize("mode", [RuntimeMode.PREFERRED, RuntimeMode.REQUIRED])
def test_daemon_down_preferred_falls_back_required_fails(short_tmp: Path, runtime_root, monkeypatch, mode):
    from hwr.daemon.app.launcher import DaemonProcess

    daemon = DaemonProcess(short_tmp / "down-store", short_tmp / "down.sock").start()
    monkeypatch.setenv("HWR_SOCKET", str(daemon.socket))
    rt = runtime(runtime_root, mode)
    ident = identity("down/model")
    first = rt.resolve(ident)  # daemon up: a plain miss
    assert first.report.outcome is (ResolutionOutcome.CANONICAL_FALLBACK if mode is RuntimeMode.PREFERRED
                                    else ResolutionOutcome.FAILED)
    daemon.kill()
    down = rt.resolve(ident)
    failure = down.report.attempts[-1].failure
    assert failure.code is FailureCode.DOMAIN_UNAVAILABLE and failure.retryable
    assert str(daemon.socket) in failure.message
    if mode is RuntimeMode.PREFERRED:
        assert down.report.outcome is ResolutionOutcome.CANONICAL_FALLBACK
        assert down.report.attempts[-1].action is ResolutionAction.CANONICAL_FALLBACK
    else:
        assert down.report.outcome is ResolutionOutcome.FAILED
        assert down.report.attempts[-1].action is ResolutionAction.FAIL_STARTUP
    published = rt.publish_after_load(ident, producer=TensorProducer(ident, tensors(5)))
    assert published.outcome is PostLoadPublicationOutcome.FAILED


def test_malformed_marker_fails_startup_naming_the_file(runtime_root):
    (runtime_root / "hwrd.json").write_text('{"socket": "relative.sock"}')
    result = runtime(runtime_root).resolve(identity("bad-marker/model"))
    assert result.report.outcome is ResolutionOutcome.FAILED
    failure = result.report.attempts[-1].failure
    assert failure.code is FailureCode.INVALID_CONFIG and "hwrd.json" in failure.message


def test_without_configuration_vllm_omni_keeps_its_own_store(runtime_root):
    from vllm_omni.host_weight_runtime.filesystem import FilesystemHostWeightStore

    assert isinstance(runtime(runtime_root).store, FilesystemHostWeightStore)


def test_format_metadata_round_trips_through_hwrd(vo_hwrd, runtime_root, monkeypatch):
    from vllm_omni.host_weight_runtime import CanonicalJson

    monkeypatch.setenv("HWR_SOCKET", str(vo_hwrd.socket))
    ident = identity("format-metadata/model")
    report = runtime(runtime_root).publish_after_load(
        ident, producer=TensorProducer(ident, tensors(6), format_metadata={"tensor_count": 5}))
    assert report.outcome is PostLoadPublicationOutcome.PUBLISHED, report
    with hwr.client.connect(vo_hwrd.socket) as c, c.acquire(ident.key) as lease:
        assert lease.manifest.format_metadata == b'{"tensor_count":5}'
    warm = runtime(runtime_root).resolve(ident)
    try:
        assert warm.report.outcome is ResolutionOutcome.LOCAL_HIT
        assert warm.lease.manifest.format_metadata == CanonicalJson.from_value({"tensor_count": 5})
    finally:
        warm.lease.close()


def test_failing_producer_is_typed_and_publishes_nothing(vo_hwrd, runtime_root, monkeypatch):
    monkeypatch.setenv("HWR_SOCKET", str(vo_hwrd.socket))
    ident = identity("failing/model")
    report = runtime(runtime_root).publish_after_load(ident, producer=TensorProducer(ident, tensors(7), fail=True))
    assert report.outcome is PostLoadPublicationOutcome.FAILED
    assert report.failure.code is FailureCode.PRODUCER_FAILED and not report.failure.retryable
    assert not runtime(runtime_root).resolve(ident).lease


def test_a_denied_artifact_is_invalid_not_a_hit(vo_hwrd, runtime_root, monkeypatch):
    monkeypatch.setenv("HWR_SOCKET", str(vo_hwrd.socket))
    ident = identity("denied/model")
    runtime(runtime_root).publish_after_load(ident, producer=TensorProducer(ident, tensors(8)))
    with hwr.client.connect(vo_hwrd.socket) as c:
        c.deny(ident.key, "operator says no")
        try:
            preferred = runtime(runtime_root).resolve(ident)
            required = runtime(runtime_root, RuntimeMode.REQUIRED).resolve(ident)
        finally:
            c.allow(ident.key)
    assert preferred.report.outcome is ResolutionOutcome.CANONICAL_FALLBACK and preferred.lease is None
    assert required.report.outcome is ResolutionOutcome.FAILED
    for result in (preferred, required):  # the lookup attempt says why; upstream then reports no producer
        assert result.report.attempts[0].failure.code is FailureCode.ARTIFACT_DENIED
    again = runtime(runtime_root).resolve(ident)
    assert again.report.outcome is ResolutionOutcome.LOCAL_HIT
    again.lease.close()
