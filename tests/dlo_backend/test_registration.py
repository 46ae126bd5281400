"""``cudaHostRegister`` of lease regions: all or nothing, no CUDA error left behind.

The CUDA runtime is replaced by ``cuda_fake.FakeCudaRuntime`` (the boundary ``registration``
calls), which keeps CUDA's rules: overlapping registrations fail with
``cudaErrorHostMemoryAlreadyRegistered``, and every failure sets the thread's last error until
it is read, so an uncleared one makes the next kernel launch (``launch()``) raise.
"""

from __future__ import annotations

import pytest
from cuda_fake import ALREADY_REGISTERED, PORTABLE, READ_ONLY, FakeCudaRuntime

from hwr.client.carrier import MappedRegion
from hwr.dlo_backend.cudart import HOST_REGISTER_READ_ONLY_SUPPORTED, HOST_REGISTER_SUPPORTED
from hwr.dlo_backend.registration import CHUNK_BYTES, Chunk, chunks, register_regions

pytestmark = pytest.mark.timeout(30)

PAGE = 4096
GIB = 1 << 30


def _regions(*lengths: int, base: int = 1 << 40) -> list[MappedRegion]:
    out, cursor = [], base
    for index, length in enumerate(lengths):
        out.append(MappedRegion(f"f{index}", cursor, length, True))
        cursor += length + 16 * PAGE
    return out


def test_a_registration_that_fails_on_pages_already_registered_rolls_back_and_clears_the_error() -> None:
    runtime = FakeCudaRuntime()
    regions = _regions(8 * PAGE, 8 * PAGE)
    assert runtime.host_register(regions[1].address, regions[1].length, READ_ONLY) == 0  # someone else's
    got = register_regions(regions, 0, runtime=runtime)
    assert got is None
    assert [r.address for r in runtime.registered] == [regions[1].address]  # ours rolled back, theirs kept
    assert ("register", regions[1].address, 0) in runtime.calls
    runtime.launch()  # would raise "CUDA error 712" if the failure were left set


def test_the_second_registration_of_the_same_region_falls_back_and_the_next_launch_works() -> None:
    runtime = FakeCudaRuntime()
    regions = _regions(4 * PAGE)
    first = register_regions(regions, 0, runtime=runtime)
    assert first is not None and first.complete and first.nbytes == 4 * PAGE
    assert register_regions(regions, 0, runtime=runtime) is None
    runtime.launch()
    assert first.close() == []
    assert runtime.registered == []


def test_an_uncleared_error_is_what_the_next_launch_would_see() -> None:
    # The hazard itself, on the fake: a failed call whose error is not read poisons a launch.
    runtime = FakeCudaRuntime()
    region = _regions(PAGE)[0]
    runtime.host_register(region.address, region.length, READ_ONLY)
    assert runtime.host_register(region.address, region.length, READ_ONLY) == ALREADY_REGISTERED
    with pytest.raises(RuntimeError, match="712"):
        runtime.launch()


@pytest.mark.parametrize(
    ("attributes", "reason"),
    [({HOST_REGISTER_READ_ONLY_SUPPORTED: 0}, "read-only"), ({HOST_REGISTER_SUPPORTED: 0}, "register")],
)
def test_a_device_without_read_only_registration_is_never_asked_to_register(
    attributes: dict[int, int], reason: str
) -> None:
    runtime = FakeCudaRuntime(attributes=attributes)
    assert register_regions(_regions(PAGE), 0, runtime=runtime) is None, reason
    assert runtime.calls == []
    runtime.launch()


def test_a_writable_region_needs_no_read_only_support() -> None:
    runtime = FakeCudaRuntime(attributes={HOST_REGISTER_READ_ONLY_SUPPORTED: 0})
    region = MappedRegion("f", 1 << 40, PAGE, False)
    got = register_regions([region], 0, runtime=runtime)
    assert got is not None and got.nbytes == PAGE


def test_a_failed_unregister_is_reported_kept_for_retry_and_its_error_cleared() -> None:
    runtime = FakeCudaRuntime()
    regions = _regions(PAGE, PAGE)
    got = register_regions(regions, 0, runtime=runtime)
    assert got is not None
    runtime.fail_unregister = {regions[0].address}
    failures = got.close()
    assert len(failures) == 1 and f"{regions[0].address:#x}" in failures[0]
    runtime.launch()
    runtime.fail_unregister = set()
    assert got.close() == []  # the failed region was kept and is retried
    assert runtime.registered == []


def test_an_incomplete_rollback_returns_the_partial_registration_to_close_later() -> None:
    runtime = FakeCudaRuntime(fail_register_at={1})
    regions = _regions(PAGE, PAGE)
    runtime.fail_unregister = {regions[0].address}
    got = register_regions(regions, 0, runtime=runtime)
    assert got is not None and not got.complete
    runtime.launch()
    runtime.fail_unregister = set()
    assert got.close() == [] and runtime.registered == []


def test_regions_over_the_budget_are_not_registered() -> None:
    runtime = FakeCudaRuntime()
    assert register_regions(_regions(2 * GIB), 1, runtime=runtime) is None
    assert runtime.calls == []


def test_registration_and_unregistration_run_on_the_target_device_and_are_portable() -> None:
    runtime = FakeCudaRuntime(current=0)
    regions = _regions(4 * PAGE, 2 * PAGE)
    got = register_regions(regions, 0, device=3, runtime=runtime)
    assert got is not None and got.device == 3
    assert runtime.current == 0  # the caller's current device is restored
    assert {device for name, _, device in runtime.calls if name == "register"} == {3}
    assert all(r.flags == PORTABLE | READ_ONLY for r in runtime.registered)
    # Portable: any device's copies see the pages as pinned, not only device 3's.
    assert all(runtime.pinned_for(0, r.address, r.length) for r in regions)
    assert got.close() == []
    assert {device for name, _, device in runtime.calls if name == "unregister"} == {3}
    assert runtime.current == 0 and runtime.registered == []


def test_a_large_region_is_registered_in_chunks_that_cover_it_exactly() -> None:
    runtime = FakeCudaRuntime()
    length = 2 * CHUNK_BYTES + 5 * PAGE
    region = MappedRegion("big", 1 << 44, length, True)
    assert chunks(region) == [
        Chunk(region.address, CHUNK_BYTES),
        Chunk(region.address + CHUNK_BYTES, CHUNK_BYTES),
        Chunk(region.address + 2 * CHUNK_BYTES, 5 * PAGE),
    ]
    got = register_regions([region], 0, runtime=runtime)
    assert got is not None and got.nbytes == length and len(runtime.registered) == 3
    assert runtime.pinned_for(0, region.address, length)
    assert got.close() == [] and runtime.registered == []


def test_a_chunk_failing_midway_unregisters_the_chunks_before_it() -> None:
    runtime = FakeCudaRuntime(fail_register_at={2})
    region = MappedRegion("big", 1 << 44, 3 * CHUNK_BYTES, True)
    assert register_regions([region], 0, device=1, runtime=runtime) is None
    assert runtime.registered == []
    assert [name for name, _, _ in runtime.calls] == ["register"] * 3 + ["unregister"] * 2
    runtime.launch()


def test_without_a_device_the_current_one_is_the_target() -> None:
    runtime = FakeCudaRuntime(current=5)
    got = register_regions(_regions(PAGE), 0, runtime=runtime)
    assert got is not None and got.device == 5 and runtime.registered[0].device == 5
