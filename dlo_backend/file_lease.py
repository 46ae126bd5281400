"""A local safetensors file as a DLO host source: the same kind of memory an hwrd lease gives.

``FileLease(path)`` maps the file read-only and shared (``PROT_READ``/``MAP_SHARED``) and exposes
it through the ``HostLease`` shape the offload backend takes as ``host_source``: ``key``,
``tensors`` (name -> read-only view of the mapping), ``mapped_regions`` (for host
registration), ``closed`` and an idempotent ``close()``. For benchmarks and tests that measure
the offload on lease-like memory without a daemon, and for a worker that streams from a local
final-layout file.

Contract and limits:
- The header is validated with ``hwr.client.safetensors_header.read_header`` (tiling, sizes,
  known dtypes) before any view is built; a malformed file raises ``ManifestCorrupt``.
- ``transposed`` names 2-D tensors stored transposed (a column-major original): their views are
  returned as ``.t()`` of the stored bytes, the convention of the test and benchmark writers.
- Nothing is copied; the views are valid until ``close()`` drops them. The mapping itself is
  unmapped when the last view dies (Python buffer rules). Unlike an hwrd lease, nothing protects
  the file from being changed or truncated behind the mapping: use files you own.
"""

from __future__ import annotations

import mmap
import os
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import MappingProxyType

import torch

from hwr.client.carrier import MappedRegion
from hwr.client.errors import LeaseClosed
from hwr.client.safetensors_header import DTYPES, read_header

__all__ = ["FileLease"]


class FileLease:
    """A read-only shared mapping of the safetensors file at ``path``, shaped as a ``HostLease``."""

    def __init__(self, path: str | os.PathLike[str], *, key: str = "file", transposed: Iterable[str] = ()) -> None:
        self._key = key
        fd = os.open(Path(path), os.O_RDONLY | os.O_CLOEXEC)
        try:
            header = read_header(fd, require_alignment=False)  # views as safetensors itself makes them
            size = os.fstat(fd).st_size
            self._map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(fd)  # the mapping keeps the file
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # frombuffer warns that the mapping is not writable: on purpose
            raw = torch.frombuffer(self._map, dtype=torch.uint8)
        self.base, self.size = raw.data_ptr(), size
        flip = set(transposed)
        start = header.data_offset
        tensors: dict[str, torch.Tensor] = {}
        for entry in header.entries:
            dtype = DTYPES[entry.dtype].torch_dtype
            view = raw[start + entry.begin : start + entry.end].view(dtype).view(entry.shape)
            tensors[entry.name] = view.t() if entry.name in flip else view
        self._tensors: dict[str, torch.Tensor] | None = tensors
        page = mmap.PAGESIZE
        self._regions = (MappedRegion(Path(path).name, self.base, -(-size // page) * page, True),)

    @property
    def key(self) -> str:
        return self._key

    @property
    def tensors(self) -> Mapping[str, torch.Tensor]:
        if self._tensors is None:
            raise LeaseClosed(f"file lease {self._key} is closed")
        return MappingProxyType(self._tensors)

    @property
    def mapped_regions(self) -> tuple[MappedRegion, ...]:
        return () if self._tensors is None else self._regions

    @property
    def closed(self) -> bool:
        return self._tensors is None

    def contains(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s data starts inside this mapping."""
        return self.base <= tensor.data_ptr() < self.base + self.size

    def close(self) -> None:
        """Drop the views (idempotent); the mapping goes with the last view still alive elsewhere."""
        self._tensors = None

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{len(self._tensors or {})} tensors"
        return f"FileLease(key={self._key!r}, size={self.size}, {state})"
