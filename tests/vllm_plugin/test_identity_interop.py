"""One key for one artifact on both sides, and artifacts published by either side found by the other."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm_omni")

import torch
from daemon_proc import finish_daemon
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm_omni.host_weight_runtime import (
    AdaptationIdentity,
    CanonicalJson,
    ComponentIdentity,
    PostLoadPublicationOutcome,
    ProducerIdentity,
    ResolutionOutcome,
    RuntimeWeightLayout,
    WeightArtifactIdentity,
    WeightRepresentation,
    WeightSourceIdentity,
)
from vllm_omni.host_weight_runtime.filesystem import FilesystemHostWeightStore
from vo_helpers import TensorProducer, identity, runtime, tensors

import hwr.client
from hwr.client import ArtifactIdentity
from hwr.daemon.app.launcher import DaemonProcess
from hwr.dlo_backend.vllm_plugin.store import HwrdHostWeightStore

text = st.text(min_size=1, max_size=12)
scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70)
           | st.floats(allow_nan=False, allow_infinity=False) | text)
json_values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3), max_leaves=8)
metadata = st.dictionaries(text, json_values, max_size=3).map(CanonicalJson.from_value)


@st.composite
def layouts(draw):
    size = draw(st.integers(1, 16))
    return RuntimeWeightLayout(draw(text), size, draw(st.integers(0, size - 1)), draw(st.integers(1, 8)),
                               draw(text), draw(metadata))


@st.composite
def adaptations(draw):
    kind = draw(st.sampled_from(["base", "lora", "merged"]))
    fingerprint = draw(text) if kind != "base" else draw(st.none() | text)
    return AdaptationIdentity(kind, fingerprint, draw(metadata))


identities = st.builds(
    WeightArtifactIdentity,
    schema_version=st.integers(1, 3),
    source=st.builds(WeightSourceIdentity, text, text, text, metadata),
    component=st.builds(ComponentIdentity, text, text, metadata),
    representation=st.builds(WeightRepresentation, text, text, metadata),
    layout=layouts(),
    adaptation=adaptations(),
    producer=st.builds(ProducerIdentity, text, text, text, text, text),
)


@settings(max_examples=300, deadline=None)
@given(identities)
def test_hwr_key_equals_vllm_omni_key(ident):
    ours = ArtifactIdentity.from_dict(ident.to_dict())
    assert ours.key == ident.key
    assert ours.canonical_bytes == ident.canonical_bytes
    assert WeightArtifactIdentity.from_dict(ours.to_dict()) == ident


@pytest.mark.usefixtures("plugin")
def test_published_through_hwr_client_is_a_vllm_omni_local_hit(vo_hwrd, runtime_root, monkeypatch):
    monkeypatch.setenv("HWR_SOCKET", str(vo_hwrd.socket))
    ident, data = identity("interop/hwr-side"), tensors(11)
    with hwr.client.connect(vo_hwrd.socket) as c:
        assert c.publish(ArtifactIdentity.from_dict(ident.to_dict()), data) == ident.key
    warm = runtime(runtime_root).resolve(ident)
    assert warm.report.outcome is ResolutionOutcome.LOCAL_HIT
    assert all(torch.equal(warm.lease.tensors[n], t) for n, t in data.items())
    warm.lease.close()


@pytest.mark.usefixtures("plugin")
def test_published_by_vllm_omnis_own_store_is_served_by_hwrd_after_adoption(short_tmp: Path, monkeypatch):
    root = short_tmp / "vo-root"
    root.mkdir(mode=0o700)
    ident, data = identity("interop/vllm-side"), tensors(12)
    own = runtime(root)  # nothing configured: vLLM-Omni's filesystem store
    assert isinstance(own.store, FilesystemHostWeightStore)
    report = own.publish_after_load(ident, producer=TensorProducer(ident, data, format_metadata={"tensor_count": 5}))
    assert report.outcome is PostLoadPublicationOutcome.PUBLISHED, report.failure
    del own

    daemon = DaemonProcess(root, short_tmp / "adopt.sock", env={"HWR_ADOPT": "1"}).start()
    try:
        with hwr.client.connect(daemon.socket) as c, c.acquire(ident.key) as lease:
            assert lease.manifest.format_metadata == b'{"tensor_count":5}'
        monkeypatch.setenv("HWR_SOCKET", str(daemon.socket))
        rt = runtime(short_tmp / "other-runtime-root")
        assert isinstance(rt.store, HwrdHostWeightStore)
        warm = rt.resolve(ident)
        assert warm.report.outcome is ResolutionOutcome.LOCAL_HIT
        assert warm.lease.manifest.format_metadata == CanonicalJson.from_value({"tensor_count": 5})
        assert all(torch.equal(warm.lease.tensors[n], t) for n, t in data.items())
        warm.lease.close()
    finally:
        finish_daemon(daemon)
