"""Building blocks of ``gpu_check.py``: the model, the lease sources and one streamed case.

Kept apart from the script so each stays small; nothing here is a benchmark on its own. Every
function takes a ``Ctx`` (device, sizes, where leases come from) and returns plain data for the
JSON report.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

PAGE = mmap.PAGESIZE
REPO = Path(__file__).resolve().parent.parent


class Block(nn.Module):
    """Two dtype groups (fp32 norm, ``dtype`` MLP), contiguous weights (as hwrd publishes them)."""

    def __init__(self, dim: int, hidden: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden, dtype=dtype)
        self.fc2 = nn.Linear(hidden, dim, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x).to(self.fc1.weight.dtype)
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(h))).float()


class Stack(nn.Module):
    def __init__(self, depth: int, dim: int, hidden: int, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.blocks = nn.ModuleList(Block(dim, hidden, dtype) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


@dataclass(frozen=True)
class Shape:
    depth: int
    dim: int
    hidden: int
    tokens: int


class FileLease:
    """A ``HostLease`` over a read-only ``mmap`` of a raw file of page-aligned tensors.

    The fallback where hwrd cannot run on the machine (its gRPC/protobuf dependencies missing):
    the same kind of memory (a shared, read-only file mapping), without the daemon.
    """

    key = "gpu-check-file-lease"

    def __init__(self, path: Path, layout: Mapping[str, tuple[int, torch.dtype, tuple[int, ...]]]) -> None:
        self._fd = os.open(path, os.O_RDONLY)
        size = os.fstat(self._fd).st_size
        self._map: mmap.mmap | None = mmap.mmap(self._fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        base = torch.frombuffer(memoryview(self._map), dtype=torch.uint8)
        from hwr.client.carrier import MappedRegion

        self._regions = (MappedRegion("weights", base.data_ptr(), -(-size // PAGE) * PAGE, True),)
        self._tensors: dict[str, torch.Tensor] | None = {}
        for name, (offset, dtype, shape) in layout.items():
            count = 1
            for n in shape:
                count *= n
            nbytes = count * torch.empty(0, dtype=dtype).element_size()
            self._tensors[name] = base[offset : offset + nbytes].view(dtype).view(shape)
        del base

    @classmethod
    def write(cls, path: Path, tensors: Mapping[str, torch.Tensor]) -> Callable[[], FileLease]:
        layout: dict[str, tuple[int, torch.dtype, tuple[int, ...]]] = {}
        with open(path, "wb") as out:
            cursor = 0
            for name, tensor in tensors.items():
                layout[name] = (cursor, tensor.dtype, tuple(tensor.shape))
                flat = tensor.detach().contiguous()
                data = ctypes.string_at(flat.data_ptr(), flat.numel() * flat.element_size())  # no numpy needed
                out.write(data)
                cursor += len(data)
                pad = -cursor % PAGE
                out.write(b"\0" * pad)
                cursor += pad
        return lambda: cls(path, layout)

    @property
    def tensors(self) -> Mapping[str, torch.Tensor]:
        assert self._tensors is not None, "lease closed"
        return MappingProxyType(self._tensors)

    @property
    def mapped_regions(self) -> tuple[Any, ...]:
        return self._regions

    @property
    def closed(self) -> bool:
        return self._tensors is None

    def close(self) -> None:
        if self._tensors is None:
            return
        self._tensors = None
        if self._map is not None:
            with contextlib.suppress(BufferError):  # views still alive: unmapped when they die
                self._map.close()
        os.close(self._fd)


@contextlib.contextmanager
def lease_factory(work: Path) -> Iterator[tuple[Callable[[Shape], Any], str]]:
    """``(take, source)``: ``take(shape)`` returns a fresh lease on ``Stack(shape)``'s weights.

    A real hwrd on a temp socket when its dependencies import (``source`` = ``"hwrd"``), else a
    file mapping (``source`` says why). Each shape's weights are published (written) once.
    """
    published: dict[Shape, Any] = {}

    def state(shape: Shape) -> dict[str, torch.Tensor]:
        return Stack(shape.depth, shape.dim, shape.hidden).state_dict()

    try:
        import common

        import hwr.client as hc

        daemon_cm = common.hwrd(work / "hwrd-root")
        daemon = daemon_cm.__enter__()
    except Exception as exc:  # grpcio/protobuf/msgspec missing or too old on this machine

        def take_file(shape: Shape) -> FileLease:
            if shape not in published:
                published[shape] = FileLease.write(work / f"weights-{len(published)}.bin", state(shape))
            return published[shape]()

        yield take_file, f"file mapping (hwrd unavailable: {exc!r})"
        return
    try:
        with hc.connect(str(daemon.socket)) as client:

            def take_hwrd(shape: Shape) -> Any:
                if shape not in published:
                    identity = hc.ArtifactIdentity.simple(f"gpu-check/{shape.depth}x{shape.dim}x{shape.hidden}")
                    published[shape] = client.publish(identity, state(shape))
                return client.acquire(published[shape])

            yield take_hwrd, "hwrd"
    finally:
        daemon_cm.__exit__(None, None, None)


@dataclass
class Ctx:
    device: torch.device
    dry_run: bool
    out_dir: Path
    work: Path
    take_lease: Callable[[Shape], Any] | None = None
    lease_source: str = "none"
    notes: list[str] = field(default_factory=list)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def side_stream(self) -> contextlib.AbstractContextManager[Any]:
        """A non-default stream as the current one (CPU: no streams, the same code path)."""
        if not self.cuda:
            return contextlib.nullcontext()
        return torch.cuda.stream(torch.cuda.Stream(device=self.device))


def resident_copy(model: Stack, shape: Shape, device: torch.device) -> Stack:
    """The reference: every block resident on ``device``, the same bytes as ``model``."""
    resident = skeleton(shape).to_empty(device=device)
    resident.load_state_dict(model.state_dict())
    return resident.eval()


def skeleton(shape: Shape) -> Stack:
    """A model without weights (``meta``): a lease source gives it every byte it streams."""
    with torch.device("meta"):
        return Stack(shape.depth, shape.dim, shape.hidden, seed=7).eval()


def pin_module(model: nn.Module) -> None:
    for tensor in [*model.parameters(), *model.buffers()]:
        tensor.data = tensor.data.pin_memory()


def run_case(
    ctx: Ctx,
    name: str,
    shape: Shape,
    *,
    source: str,
    side_stream: bool,
    forwards: int = 3,
    limit_gib: float = 0.0,
    expect_mode: str,
    expect_registered: bool,
) -> dict[str, Any]:
    """One streamed configuration: ``forwards`` forwards, each ``torch.equal`` to the resident model.

    ``source``: ``module-pinned``, ``module-unpinned`` or ``lease``. Asserts (as report fields)
    the backend's mode and its registered bytes (all of the lease's regions, or none).
    """
    from hwr.dlo_backend import apply_layerwise_offload

    started = time.perf_counter()
    model = Stack(shape.depth, shape.dim, shape.hidden).eval()
    resident = resident_copy(model, shape, ctx.device)
    if source == "lease":
        assert ctx.take_lease is not None
        lease = ctx.take_lease(shape)
        target, host_source = skeleton(shape), lease
        region_bytes = sum(r.length for r in lease.mapped_regions)
    else:
        if source == "module-pinned" and ctx.cuda:
            pin_module(model)
        target, host_source, region_bytes = model, None, 0
    inputs = [torch.randn(shape.tokens, shape.dim, device=ctx.device) for _ in range(forwards)]
    equal: list[bool] = []
    with torch.no_grad(), ctx.side_stream() if side_stream else contextlib.nullcontext():
        handle = apply_layerwise_offload(
            target,
            device=ctx.device,
            blocks_attr="blocks",
            host_source=host_source,
            host_registration_limit_gib=limit_gib,
            cpu_zero_copy=False,
        )
        try:
            stats = handle.stats
            arenas = [arena.pinned for arena in getattr(handle.backend, "_arenas", [])]
            for x in inputs:
                equal.append(bool(torch.equal(target(x), resident(x))))
            ctx.sync()
        finally:
            handle.close()
    registered_ok = stats.registered_bytes == (region_bytes if expect_registered else 0)
    return {
        "case": name,
        "stream": "side" if side_stream else "default",
        "mode": stats.mode,
        "expected_mode": expect_mode,
        "registered_bytes": stats.registered_bytes,
        "lease_region_bytes": region_bytes,
        "host_arenas_pinned": arenas,  # staging carved from an exact, registered arena (CUDA)
        "outputs_equal": equal,
        "ok": all(equal) and stats.mode == expect_mode and registered_ok,
        "seconds": round(time.perf_counter() - started, 3),
    }
