"""CPU zero-copy binding: running blocks compute on the lease's mapped pages themselves.

On a CPU device (rank-local) the backend binds each running block's tensors to the host tensors
instead of copying them into a slot. These tests prove the binding is really zero-copy (every
bound tensor's storage lies inside the lease's mapped regions, at the lease view's own address),
that it is bit-identical to the copying path and the unhooked model, and that the ring (two
blocks prepared at most, placeholders between calls) is unchanged.
"""

from __future__ import annotations

import hashlib
import platform
import sys
from pathlib import Path

import pytest
import torch
from dlo_fixtures import SafetensorsLease, TinyDiT
from hypothesis import given
from hypothesis import strategies as st

from hwr.client.carrier import LeaseCarrier
from hwr.dlo_backend import apply_layerwise_offload
from hwr.dlo_backend.paging import page_range, populate

pytestmark = pytest.mark.timeout(60)


def _in_regions(tensor: torch.Tensor, lease: SafetensorsLease) -> bool:
    """The tensor's whole storage span lies inside one of the lease's mapped regions."""
    span = 1 + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride(), strict=True))
    lo, hi = tensor.data_ptr(), tensor.data_ptr() + span * tensor.element_size()
    return any(r.address <= lo and hi <= r.address + r.length for r in lease.mapped_regions)


def _record_bindings(model: TinyDiT) -> list[dict[str, torch.Tensor]]:
    """Inside each block's innermost module, the block's tensors as the forward sees them."""
    seen: list[dict[str, torch.Tensor]] = []
    for block in [*model.blocks, *model.single_blocks]:
        inner = block.norm if hasattr(block, "norm") else block.lin
        inner.register_forward_pre_hook(
            lambda *_, block=block: seen.append(
                # detach: an alias of what is bound now (the backend swaps ``.data`` afterwards)
                {name: t.detach() for name, t in [*block.named_parameters(), *block.named_buffers()]}
            )
        )
    return seen


@pytest.mark.parametrize("meta", [False, True], ids=["cpu-skeleton", "meta-skeleton"])
def test_cpu_binding_points_into_the_lease_mapping_and_matches_the_copying_path(tmp_path: Path, meta: bool) -> None:
    model = TinyDiT(3, 2)
    inputs = [torch.randn(4, 16, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    with torch.no_grad():
        want = [model(x) for x in inputs]
    path = tmp_path / "m.safetensors"
    lease = SafetensorsLease.write(path, model.state_dict())
    views = dict(lease.tensors)

    def skeleton() -> TinyDiT:
        with torch.device("meta" if meta else "cpu"):
            other = TinyDiT(3, 2, seed=7)
        if meta:
            other.to_empty(device="cpu")
            for block in other.blocks:
                block.offset = torch.full_like(block.offset, 0.01)  # non-persistent: not leased
        other.embed.load_state_dict(model.embed.state_dict())
        other.out.load_state_dict(model.out.state_dict())
        return other

    bound_model = skeleton()
    seen = _record_bindings(bound_model)
    handle = apply_layerwise_offload(bound_model, device="cpu", host_source=LeaseCarrier(lease))
    assert handle.stats.mode == "bind" and handle.stats.slot_bytes == 0
    with torch.no_grad():
        got = [bound_model(x) for x in inputs]
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))

    # Every persistent tensor of every running block is the lease's own view: same address,
    # inside the mapped region; non-persistent buffers come from the module (not leased).
    names = [f"blocks.{i}" for i in range(3)] + [f"single_blocks.{i}" for i in range(2)]
    assert len(seen) == 3 * len(names)
    for step, tensors in enumerate(seen):
        prefix = names[step % len(names)]
        leased = {name: t for name, t in tensors.items() if f"{prefix}.{name}" in views}
        assert leased and len(leased) == len(tensors) - (1 if prefix.startswith("blocks.") else 0)
        for name, tensor in leased.items():
            view = views[f"{prefix}.{name}"]
            assert tensor.data_ptr() == view.data_ptr() and tensor.stride() == view.stride()
            assert _in_regions(tensor, lease)
    # Between calls only placeholders are attached (nothing keeps the mapping bound).
    assert handle.backend.materialized_blocks() == []

    # The copying path (what CUDA does) gives the same bits from private slot bytes.
    copied_model = skeleton()
    copied_seen = _record_bindings(copied_model)
    copy_lease = SafetensorsLease(path)
    copying = apply_layerwise_offload(
        copied_model, device="cpu", host_source=LeaseCarrier(copy_lease), cpu_zero_copy=False
    )
    assert copying.stats.mode == "direct" and copying.stats.slot_bytes > 0
    with torch.no_grad():
        copied = [copied_model(x) for x in inputs]
    assert all(torch.equal(c, g) for c, g in zip(copied, got, strict=True))
    assert not any(_in_regions(t, copy_lease) for tensors in copied_seen for t in tensors.values())

    handle.close()
    copying.close()
    assert lease.close_calls == 1 and copy_lease.close_calls == 1
    # After close the model owns private copies: it outlives the lease.
    assert not any(_in_regions(p, lease) for p in bound_model.parameters())
    with torch.no_grad():
        assert torch.equal(bound_model(inputs[0]), want[0])


def test_cpu_binding_of_module_tensors_uses_the_originals() -> None:
    model = TinyDiT(3, 0)
    originals = {name: p.data_ptr() for name, p in model.blocks.named_parameters()}
    x = torch.randn(2, 16)
    with torch.no_grad():
        want = model(x)
    seen: list[dict[str, int]] = []
    for i, block in enumerate(model.blocks):
        block.norm.register_forward_pre_hook(
            lambda *_, i=i, block=block: seen.append({f"{i}.{n}": p.data_ptr() for n, p in block.named_parameters()})
        )
    handle = apply_layerwise_offload(model, device="cpu", blocks_attr="blocks")
    with torch.no_grad():
        assert torch.equal(model(x), want)
    assert {k: v for step in seen for k, v in step.items()} == originals
    handle.close()


def test_a_resident_layer_and_out_of_order_calls_work_with_binding(tmp_path: Path) -> None:
    model = TinyDiT(4, 0)
    x = torch.randn(2, 16)
    with torch.no_grad():
        want = model.blocks[0](model.blocks[3](model.blocks[1](x)))
    lease = SafetensorsLease.write(tmp_path / "m.safetensors", model.state_dict())
    handle = apply_layerwise_offload(model, device="cpu", blocks_attr="blocks", host_source=lease, resident_layers=1)
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(model.blocks[0](model.blocks[3](model.blocks[1](x))), want)
    handle.close()
    assert lease.closed


@given(st.integers(0, 1 << 40), st.integers(0, 1 << 24), st.sampled_from([4096, 16384, 65536]))
def test_page_range_covers_exactly_the_touched_pages(address: int, nbytes: int, page: int) -> None:
    start, length = page_range(address, nbytes, page)
    assert start % page == 0 and length % page == 0
    if nbytes == 0:
        assert length == 0
        return
    assert start <= address and address + nbytes <= start + length
    assert address - start < page and start + length - (address + nbytes) < page


def _mapping_kb(address: int) -> dict[str, int]:
    """The ``/proc/self/smaps`` counters (kB) of the mapping that contains ``address``."""
    fields: dict[str, int] | None = None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):  # a mapping's first line: "lo-hi perms ..."
                if fields is not None:
                    break
                lo, hi = (int(x, 16) for x in head.split("-"))
                if lo <= address < hi:
                    fields = {}
            elif fields is not None and line.split()[-1] == "kB":
                fields[head.rstrip(":")] = int(line.split()[1])
    assert fields is not None, f"no mapping contains {address:#x}"
    return fields


def _kernel_has_populate_read() -> bool:
    major, minor = (int(x) for x in platform.release().split(".")[:2])
    return sys.platform.startswith("linux") and (major, minor) >= (5, 14)


def test_populate_maps_a_file_view_and_ignores_what_it_cannot(tmp_path: Path) -> None:
    """``populate`` maps every page under the view into this process (Rss of the file mapping,
    from /proc/self/smaps, goes from a few fault-around pages to the whole view) without writing
    one (the bytes unchanged); empty and meta tensors are refused."""
    if not _kernel_has_populate_read():
        pytest.skip(f"kernel {platform.release()} has no MADV_POPULATE_READ (5.14+)")
    original = torch.randn(1024, 1024)  # 4 MiB: far more than a fault-around batch
    lease = SafetensorsLease.write(tmp_path / "m.safetensors", {"w": original})
    digest = hashlib.sha256((tmp_path / "m.safetensors").read_bytes()).hexdigest()
    view = lease.tensors["w"]
    nbytes = view.numel() * view.element_size()
    before = _mapping_kb(view.data_ptr())
    assert before["Rss"] * 1024 < nbytes // 2, f"the view was mapped before populate: {before}"
    assert populate(view) is True
    after = _mapping_kb(view.data_ptr())
    assert after["Rss"] * 1024 >= nbytes, f"populate left pages of the view unmapped: {before} -> {after}"
    # Read-only: the bytes are the ones written (the file's pages may still be dirty from the
    # write that made it, so smaps' Dirty counters cannot tell).
    assert torch.equal(view, original)
    assert hashlib.sha256((tmp_path / "m.safetensors").read_bytes()).hexdigest() == digest
    assert populate(torch.empty(0)) is False
    assert populate(torch.empty(4, device="meta")) is False
    lease.close()
