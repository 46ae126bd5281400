"""Digests of a staging computed by its producer while it writes (the daemon then skips re-hashing).

``StreamDigests`` receives every block a producer writes, right after the write, and feeds the
block's payload file digest and its tensor digest on two background threads (``hashlib``
releases the GIL, so the two digests and the next block's read, cast and write overlap). A file digest
covers the file in byte order, so the producer writes tensors in placement order (the worker
sorts its outputs by file and offset) and each tensor's blocks in ascending order; the bytes the
producer does not write (the safetensors header the daemon wrote at ``begin``, alignment
padding) are read back from the file in the gaps. Anything out of order (a future producer that
writes blocks backwards, or twice) makes ``finish`` return None, and the daemon hashes the
staging itself as for a client publication: reporting digests is an optimisation, never needed
for correctness. Why the daemon may trust these digests, and the limits of that, is in
``hwr.daemon.store.staging.ProducerDigests``.

Memory: at most ``MAX_PENDING`` blocks wait for the hashing threads (each at most
``BLOCK_BYTES`` of output), so the producer's peak RSS stays bounded.
"""

from __future__ import annotations

import hashlib
import os
from collections import deque
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

__all__ = ["MAX_PENDING", "StreamDigests"]

MAX_PENDING = 3
_GAP_CHUNK = 8 << 20


class _File:
    def __init__(self, name: str, size: int) -> None:
        self.name = name
        self.size = size
        self.cursor = 0  # bytes of the file fed to ``digest`` (in order)
        self.digest = hashlib.sha256()


class StreamDigests:
    """Per-file and per-tensor SHA-256 of the bytes written through ``wrote`` (see the module doc).

    ``files``: ``(fd, file name, file size)`` of each payload; ``placements``: tensor name ->
    ``(fd, absolute offset, nbytes)``. Single-writer: call ``wrote`` from one thread only.
    """

    def __init__(self, files: Sequence[tuple[int, str, int]],
                 placements: Mapping[str, tuple[int, int, int]]) -> None:
        self._files = {fd: _File(name, size) for fd, name, size in files}
        self._placements = placements
        self._tensors = {name: hashlib.sha256() for name in placements}
        self._written = dict.fromkeys(placements, 0)
        self._pool: ThreadPoolExecutor | None = ThreadPoolExecutor(1, thread_name_prefix="hwr-digest-file")
        self._tensor_pool: ThreadPoolExecutor | None = ThreadPoolExecutor(1, thread_name_prefix="hwr-digest-tensor")
        self._pending: deque[Future[None]] = deque()
        self.valid = all(fd in self._files for fd, _o, _n in placements.values())

    def wrote(self, name: str, byte_offset: int, data: memoryview) -> None:
        """Account ``data`` just written at ``byte_offset`` within tensor ``name``."""
        if not self.valid or not data.nbytes:
            return
        fd, offset, _nbytes = self._placements[name]
        state = self._files[fd]
        absolute = offset + byte_offset
        if byte_offset != self._written[name] or state.cursor > absolute or (
                state.cursor < absolute and byte_offset):
            self.valid = False  # out of order: the daemon will hash the staging itself
            return
        gap = _read(fd, state.cursor, absolute - state.cursor) if state.cursor < absolute else b""
        state.cursor = absolute + data.nbytes
        self._written[name] += data.nbytes
        tensor_digest = self._tensors[name]

        def feed_file() -> None:  # ``data`` keeps the block (and its tensor) alive until hashed
            if gap:
                state.digest.update(gap)
            state.digest.update(data)

        while len(self._pending) >= 2 * MAX_PENDING:
            self._pending.popleft().result()
        assert self._pool is not None and self._tensor_pool is not None
        # Two threads: the file digest and the tensor digest of a block hash on two cores. Each
        # pool is one thread, so each digest is still fed in order.
        self._pending.append(self._pool.submit(feed_file))
        self._pending.append(self._tensor_pool.submit(tensor_digest.update, data))

    def finish(self) -> dict[str, Any] | None:
        """Wait for the hashing, feed each file's tail; the digests, or None when not in order."""
        self._drain()
        if not self.valid:
            return None
        for name, (_fd, _offset, nbytes) in self._placements.items():
            if self._written[name] != nbytes:
                return None  # a tensor not (fully) written through ``wrote``
        for fd, state in self._files.items():
            if state.cursor > state.size:
                return None
            if state.cursor < state.size:
                state.digest.update(_read(fd, state.cursor, state.size - state.cursor))
                state.cursor = state.size
        return {"files": {s.name: s.digest.hexdigest() for s in self._files.values()},
                "tensors": {name: d.hexdigest() for name, d in self._tensors.items()}}

    def close(self) -> None:
        """Stop the hashing thread (idempotent)."""
        for pool in (self._pool, self._tensor_pool):
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
        self._pool = self._tensor_pool = None

    def _drain(self) -> None:
        while self._pending:
            self._pending.popleft().result()


def _read(fd: int, offset: int, nbytes: int) -> bytes:
    """Bytes the producer did not write itself (header, padding), read back from the staging."""
    parts = []
    while nbytes > 0:
        chunk = os.pread(fd, min(nbytes, _GAP_CHUNK), offset)
        if not chunk:
            raise OSError("staging file ended early")
        parts.append(chunk)
        offset += len(chunk)
        nbytes -= len(chunk)
    return b"".join(parts)
