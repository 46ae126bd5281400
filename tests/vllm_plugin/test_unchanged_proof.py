"""The metadata proof of "unchanged" (``unchanged``) over real hwrd leases, and its limits.

A lease from a real hwrd through vLLM-Omni's own ``HostWeightRuntime`` (the plugin's store): its
views are proven from metadata while they are exactly those views of an open lease; a private
copy, another tensor's name, a changed layout or a closed lease all fall back to vLLM-Omni's
hash. vLLM-Omni's own snapshot function, wrapped, returns its own entries for what is not proven
and the same keys in the same order.
"""

from __future__ import annotations

import hashlib
import re

import pytest

pytest.importorskip("vllm_omni")

import torch
from torch import nn
from vo_helpers import TensorProducer, identity, runtime, tensors

from hwr.dlo_backend.vllm_plugin import unchanged

pytestmark = pytest.mark.usefixtures("plugin")


@pytest.fixture
def lease(vo_hwrd, runtime_root, monkeypatch):
    monkeypatch.setenv("HWR_SOCKET", str(vo_hwrd.socket))
    ident = identity("unchanged/model")
    rt = runtime(runtime_root)
    rt.publish_after_load(ident, producer=TensorProducer(ident, tensors(11)))
    warm = rt.resolve(ident)
    assert warm.lease is not None
    yield warm.lease
    warm.lease.close()


def test_a_lease_view_is_proven_without_reading_it_and_nothing_else_is(lease) -> None:
    name, other = sorted(lease.tensors)[:2]
    view = lease.tensors[name]
    proof = unchanged.token(name, view)
    assert proof is not None and proof.startswith(f"hwrd-lease:{lease.identity.key}:")
    entry = next(e for e in lease.manifest.tensors if e.name == name)
    assert entry.sha256 in proof  # the digest hwrd checked at commit
    assert unchanged.token(other, view) is None  # restored under another name
    assert unchanged.token(name, view.clone()) is None  # a private copy
    if view.dim() > 1:
        assert unchanged.token(name, view.t()) is None  # same storage, another layout
    assert unchanged.token(name, view.view(torch.uint8)) is None  # another dtype


def test_the_wrapped_snapshot_mixes_proofs_and_vllm_omnis_hashes(lease) -> None:
    from vllm_omni.diffusion.model_loader.host_weight_loader import HWRLoaderMixin

    assert unchanged.installed()
    keys = sorted(lease.tensors)
    model = nn.Module()
    for index, name in enumerate(keys):  # the restorer's names: the lease's, in a module tree
        parent = model
        for part in name.split(".")[:-1]:
            if not hasattr(parent, part):
                parent.add_module(part, nn.Module())
            parent = getattr(parent, part)
        # The leased view itself for all but the last, a private copy of the last one.
        value = lease.tensors[name] if index < len(keys) - 1 else lease.tensors[name].clone()
        parent.register_buffer(name.rpartition(".")[2], value)
    before = unchanged.stats()
    snapshot = HWRLoaderMixin._snapshot_final_layout_tensors(model, reversed(keys))
    assert list(snapshot) == list(reversed(keys))
    for key in keys[:-1]:
        assert snapshot[key][1].startswith("hwrd-lease:")
    copy = model.get_buffer(keys[-1])
    expected = hashlib.sha256(memoryview(copy.contiguous().view(torch.uint8).numpy())).hexdigest()
    assert snapshot[keys[-1]] == (copy.untyped_storage().data_ptr(), expected)  # vLLM-Omni's own entry
    after = unchanged.stats()
    assert (after["proven"] - before["proven"], after["hashed"] - before["hashed"]) == (len(keys) - 1, 1)
    HWRLoaderMixin._assert_final_layout_tensors_unchanged(model, snapshot)  # nothing changed
    parent_path, _, leaf = keys[0].rpartition(".")
    model.get_submodule(parent_path)._buffers[leaf] = lease.tensors[keys[0]].clone()  # replaced after it
    with pytest.raises(RuntimeError, match=re.escape(keys[0])):
        HWRLoaderMixin._assert_final_layout_tensors_unchanged(model, snapshot)


def test_a_closed_lease_proves_nothing(vo_hwrd, runtime_root, monkeypatch) -> None:
    monkeypatch.setenv("HWR_SOCKET", str(vo_hwrd.socket))
    ident = identity("unchanged-closed/model")
    rt = runtime(runtime_root)
    rt.publish_after_load(ident, producer=TensorProducer(ident, tensors(12)))
    warm = rt.resolve(ident)
    name = sorted(warm.lease.tensors)[0]
    view = warm.lease.tensors[name]  # kept alive past the close (the mapping stays until it dies)
    assert unchanged.token(name, view) is not None
    warm.lease.close()
    assert unchanged.token(name, view) is None
