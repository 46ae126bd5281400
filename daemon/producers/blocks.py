"""The worker's side of a producer: reading row blocks of checkpoint tensors and writing output
blocks into a staging, as torch tensors.

Only the producer process (``hwr.daemon.producers.worker``) imports this module, and with it
torch; the daemon plans and names artifacts with ``hwr.daemon.producers.base`` alone. Memory is
bounded by the block: a reader returns at most one row block (``base.row_blocks``) of one tensor
and a sink writes it out before the next is read.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
from collections.abc import Callable, Mapping, Sequence

import torch

from hwr.client.errors import InvalidRequest
from hwr.client.safetensors_header import DTYPES, Header, TensorEntry
from hwr.client.writeback import start_writeback
from hwr.daemon.producers.base import SourceTensor

__all__ = ["SourceReader", "TensorSink", "cast_block"]


class SourceReader:
    """Reads row blocks of checkpoint tensors: ``rows`` with ``preadv`` into fresh buffers,
    ``cast_rows`` through a private mapping of one block at a time (never a whole-file mapping)."""

    def __init__(self, fds: Sequence[int], headers: Sequence[Header]) -> None:
        self._where: dict[str, tuple[int, int, TensorEntry]] = {}
        for fd, header in zip(fds, headers, strict=True):
            for entry in header.entries:
                self._where[entry.name] = (fd, header.data_offset, entry)
        self.bytes_read = 0

    def source(self, name: str) -> SourceTensor:
        entry = self._where[name][2]
        return SourceTensor(entry.name, entry.dtype, entry.shape)

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of tensor ``name`` (a 0-d tensor: the whole value)."""
        fd, base, entry = self._where[name]
        info = DTYPES[entry.dtype]
        shape = entry.shape
        row_numel = math.prod(shape[1:]) if shape else 1
        count = (stop - start) * row_numel if shape else 1
        buf = torch.empty(count * info.itemsize, dtype=torch.uint8)
        if count:
            _pread_into(fd, memoryview(buf.numpy()), base + entry.begin + start * row_numel * info.itemsize)
        self.bytes_read += buf.numel()
        out = buf.view(info.torch_dtype)
        return out.reshape(((stop - start), *shape[1:]) if shape else ())


    def cast_rows(self, name: str, start: int, stop: int, code: str) -> torch.Tensor:
        """Rows ``[start, stop)`` of ``name`` cast to the safetensors dtype ``code``: a new tensor.

        When a cast is needed it reads through a private mapping of just those rows (no copy
        into a fresh buffer: the cast itself is the copy), unmapped before returning, so the
        resident set stays one block; otherwise it is ``rows`` (a fresh buffer, already the
        target dtype). Same bytes either way: the cast is elementwise.
        """
        fd, base, entry = self._where[name]
        info = DTYPES[entry.dtype]
        target = DTYPES[code].torch_dtype
        shape = entry.shape
        row_numel = math.prod(shape[1:]) if shape else 1
        count = (stop - start) * row_numel if shape else 1
        if info.torch_dtype == target or not count:
            return cast_block(self.rows(name, start, stop), code)
        begin = base + entry.begin + start * row_numel * info.itemsize
        nbytes = count * info.itemsize
        aligned = begin - begin % mmap.ALLOCATIONGRANULARITY
        # MAP_PRIVATE + PROT_WRITE only so torch accepts the buffer as writable; nothing writes
        # to it, and a private mapping could never write through to the checkpoint anyway.
        mapped = mmap.mmap(fd, nbytes + begin - aligned, flags=mmap.MAP_PRIVATE,
                           prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=aligned)
        try:
            view = torch.frombuffer(mapped, dtype=torch.uint8, count=nbytes, offset=begin - aligned)
            out = view.view(info.torch_dtype).reshape(((stop - start), *shape[1:]) if shape else ()).to(target)
            del view
        finally:
            with contextlib.suppress(BufferError):  # a view still alive: the GC unmaps it later
                mapped.close()
        self.bytes_read += nbytes
        return out


class TensorSink:
    """Writes output blocks at their placement in a staging payload file.

    After each block it starts the block's writeback (``start_writeback``: the disk works while
    the next block is computed, so the daemon's ``fsync`` at commit is short) and hands the
    block to ``on_write(name, byte_offset, bytes)`` (the producer's digests, ``digests.py``).
    """

    def __init__(self, placements: Mapping[str, tuple[int, int, int]],
                 on_write: Callable[[str, int, memoryview], None] | None = None) -> None:
        self._placements = placements  # name -> (fd, absolute offset, nbytes)
        self._on_write = on_write
        self.bytes_written = 0

    def write(self, name: str, byte_offset: int, tensor: torch.Tensor) -> None:
        fd, offset, nbytes = self._placements[name]
        flat = tensor.contiguous().reshape(-1)
        if flat.numel() == 0:
            return
        data = memoryview(flat.view(torch.uint8).numpy()).cast("B")
        if byte_offset + data.nbytes > nbytes:
            raise InvalidRequest(f"producer wrote past tensor {name!r}", details={"tensor": name})
        block, block_offset = data, byte_offset
        while data:
            written = os.pwrite(fd, data, offset + byte_offset)
            if written <= 0:
                raise OSError("short write to staging")
            data = data[written:]
            byte_offset += written
            self.bytes_written += written
        start_writeback(fd, offset + block_offset, block.nbytes)
        if self._on_write is not None:
            self._on_write(name, block_offset, block)


def _pread_into(fd: int, view: memoryview, offset: int) -> None:
    while view:
        got = os.preadv(fd, [view], offset)
        if got <= 0:
            raise OSError("checkpoint file ended early")
        view = view[got:]
        offset += got


def cast_block(block: torch.Tensor, code: str) -> torch.Tensor:
    """Elementwise cast (round to nearest even, torch's CPU rule) to a safetensors dtype code."""
    target = DTYPES[code].torch_dtype
    return block if block.dtype == target else block.to(target)
