"""A lease on a registered canonical checkpoint: its original safetensors files, mapped read-only.

Built by ``Client.acquire_checkpoint``: the daemon checks the checkpoint is unchanged since
registration, records a lease (key ``checkpoint:<id>`` in ``hwrctl leases``) and hands over
read-only descriptors of its files on the peer socket. The lease maps each one (``PROT_READ``,
``MAP_SHARED``), re-parses its header from the descriptor and exposes zero-copy views, so every
worker on the node shares the page cache of the one original copy (the direct-mmap path).

Contract: same as ``hwr.client.lease.Lease`` (``tensors``, ``mapped_regions``, idempotent
``close()``, never released from a forked child, not picklable); ``key`` is the checkpoint id.
Limits: a tensor whose byte offset is not a multiple of its item size (a foreign writer that did
not pad its header) cannot be viewed in place and is copied into private memory instead; the
daemon cannot revoke the pages if the file is modified in place later (it refuses new leases).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Sequence

import torch

from hwr.client.carrier import MappedRegion
from hwr.client.errors import ManifestCorrupt
from hwr.client.lease import MappedLease
from hwr.client.safetensors_header import DTYPES, read_header

__all__ = ["CheckpointLease"]



class CheckpointLease(MappedLease):
    """A lease on a registered checkpoint's original files (see the module contract)."""

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
        super().__init__(lease_id=lease_id, key=checkpoint_id, release=release)
        self.files = tuple(files)
        #: (device, inode) of each leased file by name: a worker that opened the same path with its
        #: own rights compares them to know it was handed exactly that file.
        self.file_ids: dict[str, tuple[int, int]] = {}

        def map_one(index: int, fd: int) -> MappedRegion:
            name, size = self.files[index]
            st = os.fstat(fd)
            if st.st_size != size:
                raise ManifestCorrupt(f"checkpoint file {name!r} has the wrong size", details={"file": name})
            self.file_ids[name] = (st.st_dev, st.st_ino)
            header = read_header(fd, require_alignment=False)
            buffer, region = self._attach(fd, size, name, copy_on_write=False, populate=populate)
            for entry in header.entries:
                if entry.name in self._tensors:
                    raise ManifestCorrupt(f"tensor {entry.name!r} appears in two files", details={"file": name})
                self._tensors[entry.name] = _view(buffer, header.data_offset, entry)
            return region

        self._map_files(fds, len(self.files), map_one)

    @property
    def nbytes(self) -> int:
        return sum(size for _name, size in self.files)


def _view(buffer: memoryview, data_offset: int, entry: object) -> torch.Tensor:
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
            raw = torch.frombuffer(buffer, dtype=torch.uint8, count=entry.nbytes, offset=offset)  # type: ignore[attr-defined]
            return raw.clone().view(info.torch_dtype).reshape(shape)
        # On the file's memoryview: the storage keeps it (and its export of the mapping) alive,
        # so the mapping cannot be closed under a live view; each tensor gets its own storage.
        flat = torch.frombuffer(buffer, dtype=info.torch_dtype, count=numel, offset=offset)
    return flat.reshape(shape)
