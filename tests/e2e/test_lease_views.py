"""The shape of a lease's tensors, against a real hwrd: one storage per tensor over the mapping.

Consumers that rebind model parameters to lease tensors (vLLM-Omni's final-layout restorer among
them) tell tensors apart by their storage: two tensors whose ``untyped_storage()`` has the same
``(data_ptr, nbytes)`` are refused as aliases. So every tensor of a lease must have a storage of
exactly its own bytes, still zero-copy inside the shared mapping, and the mapping must outlive
``close()`` while any of those storages lives.
"""

from __future__ import annotations

import gc
from collections.abc import Callable

import pytest
import torch

from hwr.client import ArtifactIdentity, connect
from hwr.daemon.app.launcher import DaemonProcess


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "a.weight": torch.randn(33, 17, generator=g).to(torch.bfloat16),  # odd sizes: no page alignment
        "a.bias": torch.randn(33, generator=g).to(torch.bfloat16),
        "b.scale": torch.randn(5, generator=g),
        "b.index": torch.arange(-7, 6, dtype=torch.int8),
        "c.empty": torch.empty(0, 4),
        "d.table": torch.randn(4, 3, 2, generator=g).double(),
        "e.step": torch.tensor(3.5),  # 0-dim
    }


def _mapped(address: int) -> bool:
    """Whether ``address`` lies in one of this process's mappings."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            start, end = (int(part, 16) for part in line.split(None, 1)[0].split("-"))
            if start <= address < end:
                return True
    return False


@pytest.mark.timeout(120)
def test_every_tensor_has_its_own_storage_inside_the_mapping(spawn_daemon: Callable[..., DaemonProcess]) -> None:
    daemon = spawn_daemon()
    published = _tensors()
    with connect(daemon.socket) as client:
        key = client.publish(ArtifactIdentity.simple("views/own-storage"), published)
        for _ in range(2):  # the second acquire builds its views from the process's cached plan
            with client.acquire(key) as lease:
                regions = [(r.address, r.address + r.length) for r in lease.mapped_regions]
                owners: dict[tuple[int, int], str] = {}
                for name, tensor in lease.tensors.items():
                    assert torch.equal(tensor, published[name]), name
                    assert tensor.dtype == published[name].dtype and tensor.stride() == published[name].stride()
                    if tensor.numel() == 0:
                        continue
                    storage = tensor.untyped_storage()
                    nbytes = tensor.numel() * tensor.element_size()
                    assert tensor.storage_offset() == 0 and storage.nbytes() == nbytes, name
                    assert owners.setdefault((storage.data_ptr(), storage.nbytes()), name) == name
                    assert any(lo <= storage.data_ptr() and storage.data_ptr() + nbytes <= hi for lo, hi in regions), (
                        f"{name} is not a view of the lease's mapping (a copy?)")
                assert len(owners) == len(published) - 1


@pytest.mark.timeout(120)
def test_a_view_outlives_close_and_the_mapping_goes_with_the_last_view(
        spawn_daemon: Callable[..., DaemonProcess]) -> None:
    daemon = spawn_daemon()
    published = _tensors()
    with connect(daemon.socket) as client:
        key = client.publish(ArtifactIdentity.simple("views/outlive"), published)
        lease = client.acquire(key)
        kept = lease.tensors["a.weight"]
        address = lease.mapped_regions[0].address
        lease.close()
        assert client.leases() == []  # released to the daemon at once
        gc.collect()
        assert _mapped(address) and torch.equal(kept, published["a.weight"])  # still readable, never unmapped
        del kept, lease
        gc.collect()
        assert not _mapped(address)
