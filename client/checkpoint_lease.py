"""A lease on a registered canonical checkpoint: its original safetensors files, mapped read-only.

Built by ``Client.acquire_checkpoint``: the daemon checks the checkpoint is unchanged since
registration, records a lease (key ``checkpoint:<id>`` in ``hwrctl leases``) and hands over
read-only descriptors of its files on the peer channel. The lease maps each one (``PROT_READ``,
``MAP_SHARED``), re-parses its header from the descriptor and exposes zero-copy views, so every
worker on the node shares the page cache of the one original copy (the direct-mmap path).

Contract: same as ``hwr.client.lease.Lease`` (``tensors``, ``mapped_regions``, idempotent
``close()``, never released from a forked child, not picklable); ``key`` is the checkpoint id.
Limits: a tensor whose byte offset is not a multiple of its item size (a foreign writer that did
not pad its header) cannot be viewed in place and is copied into private memory instead; the
daemon cannot revoke the pages if the file is modified in place later (it refuses new leases).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType

import torch

from hwr.client.carrier import MappedRegion
from hwr.client.errors import HwrError, LeaseClosed, ManifestCorrupt
from hwr.client.lease import _base_view, _map
from hwr.client.safetensors_header import DTYPES, read_header

__all__ = ["CheckpointLease"]

log = logging.getLogger("hwr.client")
PAGE = mmap.PAGESIZE


class CheckpointLease:
    def __init__(
        self,
        *,
        lease_id: str,
        checkpoint_id: str,
        files: Sequence[tuple[str, int]],
        fds: list[int],
        release: Callable[[str], None],
        populate: bool = False,
    ) -> None:
        self._lock = threading.Lock()
        self._closed = False
        self._maps: list[mmap.mmap] = []
        self._lease_id = lease_id
        self._key = checkpoint_id
        self._release = release
        self._owner_pid = os.getpid()
        self.files = tuple(files)
        self._tensors: dict[str, torch.Tensor] = {}
        regions: list[MappedRegion] = []
        try:
            if len(fds) != len(files):
                raise ManifestCorrupt(f"daemon sent {len(fds)} descriptors for {len(files)} checkpoint files")
            for (name, size), fd in zip(files, fds, strict=True):
                if os.fstat(fd).st_size != size:
                    raise ManifestCorrupt(f"checkpoint file {name!r} has the wrong size", details={"file": name})
                header = read_header(fd, require_alignment=False)
                mapped = _map(fd, size, copy_on_write=False, populate=populate)
                self._maps.append(mapped)
                base = _base_view(mapped)
                regions.append(MappedRegion(name, base.data_ptr(), -(-size // PAGE) * PAGE, True))
                for entry in header.entries:
                    if entry.name in self._tensors:
                        raise ManifestCorrupt(f"tensor {entry.name!r} appears in two files", details={"file": name})
                    self._tensors[entry.name] = _view(mapped, header.data_offset, entry)
        except BaseException:
            self._teardown_local()
            self._tell_daemon()
            raise
        finally:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._regions = tuple(regions)
        self._view = MappingProxyType(self._tensors)

    @property
    def key(self) -> str:
        return self._key

    @property
    def lease_id(self) -> str:
        return self._lease_id

    @property
    def tensors(self) -> Mapping[str, torch.Tensor]:
        if self._closed:
            raise LeaseClosed("the lease is closed")
        return self._view

    @property
    def mapped_regions(self) -> tuple[MappedRegion, ...]:
        return self._regions

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def nbytes(self) -> int:
        return sum(size for _name, size in self.files)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._teardown_local()
        if os.getpid() == self._owner_pid:
            self._tell_daemon()

    def _tell_daemon(self) -> None:
        try:
            self._release(self._lease_id)
        except HwrError as exc:
            log.debug("release of checkpoint lease %s not confirmed: %s", self._lease_id, exc)

    def _teardown_local(self) -> None:
        self._tensors = {}
        self._view = MappingProxyType(self._tensors)
        maps, self._maps = self._maps, []
        for mapped in maps:
            with contextlib.suppress(BufferError):
                mapped.close()

    def __enter__(self) -> CheckpointLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __reduce__(self) -> object:
        raise TypeError("a CheckpointLease is bound to this process's mappings and cannot be pickled")

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._tensors)} tensors"
        return f"CheckpointLease(checkpoint={self._key[:12]}…, {self.nbytes} bytes, {state})"


def _view(mapped: mmap.mmap, data_offset: int, entry: object) -> torch.Tensor:
    info = DTYPES[entry.dtype]  # type: ignore[attr-defined]
    shape = entry.shape  # type: ignore[attr-defined]
    numel = entry.nbytes // info.itemsize  # type: ignore[attr-defined]
    offset = data_offset + entry.begin  # type: ignore[attr-defined]
    if numel == 0:
        return torch.empty(shape, dtype=info.torch_dtype)
    with warnings.catch_warnings():
        # The read-only mapping protects the pages; torch only warns that it cannot.
        warnings.filterwarnings("ignore", message=".*not writable.*", category=UserWarning)
        if offset % info.itemsize:
            raw = torch.frombuffer(mapped, dtype=torch.uint8, count=entry.nbytes, offset=offset)  # type: ignore[attr-defined]
            return raw.clone().view(info.torch_dtype).reshape(shape)
        flat = torch.frombuffer(mapped, dtype=info.torch_dtype, count=numel, offset=offset)
    return flat.reshape(shape)
