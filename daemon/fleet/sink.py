"""Where a pulled payload's bytes go: the staging file, the pull's progress, and its digests.

A backend (``RemoteStore.get_into``) hands every piece of a payload object it receives to a
``DownloadSink`` as ``write(offset, data)``, from one thread or several (S3's parallel ranged
GETs), in any order. The sink writes the piece into the staging file at ``offset``, counts it,
and feeds it to ``InOrderDigests``, which computes the file's SHA-256 and every tensor's SHA-256
in byte order while the download goes on: the bytes are hashed once, from memory, instead of
being re-read from the staging file at commit (``ProducerDigests``: the commit then only checks
the digests against the remote manifest's, and fsyncs).

Order: pieces at the hashing frontier are hashed at once; a piece further on waits in memory
(at most ``REORDER_BUDGET`` bytes per file) or, past that, is re-read from the staging file
(page cache) when the frontier reaches it. Anything inconsistent (a piece before the frontier,
overlapping pieces, a gap at the end, a hashing error) makes ``finish`` return None and the
commit re-hashes the staging from disk as for any publication: the digests are an optimisation,
never needed for correctness. The two digests of a file run on two threads (``hashlib`` drops
the GIL), at most ``MAX_PENDING`` pieces behind the download, so memory stays bounded.

Stopping: ``check`` (the pull's) raises its typed error once the pull was stopped (a stall, the
daemon stopping); every ``write`` calls it first, so a transfer ends at its next piece.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from hwr.daemon.fleet.remote import RemoteObjectInvalid
from hwr.daemon.store import fileio as store_io

__all__ = ["MAX_PENDING", "REORDER_BUDGET", "DownloadSink", "InOrderDigests"]

#: Pieces handed to the hashing threads and not hashed yet (each at most one backend chunk).
MAX_PENDING = 32
#: Bytes of out-of-order pieces kept in memory per file; past it they are re-read from the file.
REORDER_BUDGET = 64 << 20
#: Writeback of the staging file starts every this many bytes, so the commit's fsync is short.
WRITEBACK_EVERY = 64 << 20


class InOrderDigests:
    """SHA-256 of one payload file and of each tensor range in it, fed pieces in any order.

    ``ranges``: ``(tensor name, absolute start, absolute end)``. ``fd``: the file the pieces were
    written to before ``feed`` (spilled pieces are re-read from it). Thread-safe. A piece is
    kept by reference until it is hashed: the caller must not reuse its buffer.
    """

    def __init__(self, fd: int, size: int, ranges: Sequence[tuple[str, int, int]],
                 on_tensor: Callable[[str, str], None] | None = None) -> None:
        """``on_tensor(name, sha256 hex)``: called on the hashing thread as each tensor's digest
        is final (in file order), before ``finish``; the peer tier advertises verified tensors."""
        self._fd = fd
        self._on_tensor = on_tensor
        self._size = size
        self._ranges = sorted((start, end, name) for name, start, end in ranges if end > start)
        self._next_range = 0  # first range that may still overlap bytes at or after the frontier
        self._file = hashlib.sha256()
        self._tensors = {name: hashlib.sha256() for name, _s, _e in ranges}
        self._lock = threading.Lock()
        self._frontier = 0  # bytes [0, frontier) have been handed to the hashing threads
        self._held: dict[int, bytes | memoryview] = {}  # offset -> piece waiting in memory
        self._spilled: dict[int, int] = {}  # offset -> length of a piece to re-read from the file
        self._held_bytes = 0
        self._pending: deque[Future[None]] = deque()
        self._file_pool = ThreadPoolExecutor(1, thread_name_prefix="hwr-pull-digest")
        self._tensor_pool = ThreadPoolExecutor(1, thread_name_prefix="hwr-pull-digest")
        self.valid = True

    def feed(self, offset: int, data: bytes | memoryview) -> None:
        n = len(data)
        if n == 0:
            return
        with self._lock:
            if not self.valid:
                return
            if offset < self._frontier or offset in self._held or offset in self._spilled:
                self.valid = False  # the same bytes twice: hash from the file at commit instead
                return
            if offset == self._frontier:
                self._consume(data)
                self._drain()
            elif self._held_bytes + n <= REORDER_BUDGET:
                self._held[offset] = data
                self._held_bytes += n
            else:
                self._spilled[offset] = n

    def _drain(self) -> None:
        while self.valid:
            piece = self._held.pop(self._frontier, None)
            if piece is not None:
                self._held_bytes -= len(piece)
            else:
                n = self._spilled.pop(self._frontier, 0)
                if not n:
                    return
                piece = os.pread(self._fd, n, self._frontier)
                if len(piece) != n:
                    self.valid = False
                    return
            self._consume(piece)

    def _consume(self, data: bytes | memoryview) -> None:
        """Hash ``data`` as the bytes at the frontier (caller holds the lock)."""
        start = self._frontier
        end = start + len(data)
        if end > self._size:
            self.valid = False
            return
        self._submit(self._file_pool, self._file.update, data)
        view = memoryview(data)
        index = self._next_range
        while index < len(self._ranges):
            r_start, r_end, name = self._ranges[index]
            if r_start >= end:
                break
            if r_end > start:
                self._submit(self._tensor_pool, self._tensors[name].update,
                             view[max(r_start, start) - start:min(r_end, end) - start])
            if r_end <= end:
                index += 1  # this range is complete: later pieces start after it
                if self._on_tensor is not None:
                    self._report(name)
            else:
                break
        self._next_range = index
        self._frontier = end

    def _report(self, name: str) -> None:
        """Queue ``on_tensor`` behind the tensor's last update (the tensor thread runs in order)."""
        tensor, report = self._tensors[name], self._on_tensor
        assert report is not None
        try:
            self._pending.append(self._tensor_pool.submit(lambda: report(name, tensor.hexdigest())))
        except RuntimeError:
            self.valid = False

    def _submit(self, pool: ThreadPoolExecutor, update: Callable[[memoryview | bytes], None],
                data: memoryview | bytes) -> None:
        try:
            self._pending.append(pool.submit(update, data))
        except RuntimeError:  # closed: the transfer failed meanwhile; these digests are not used
            self.valid = False
            return
        while len(self._pending) > MAX_PENDING:  # the download waits for the hashing threads
            self._pending.popleft().result()

    def finish(self) -> tuple[str, dict[str, str]] | None:
        """(file digest, tensor digests) once every byte was fed exactly once, else None."""
        try:
            with self._lock:
                self._drain()
                complete = self.valid and self._frontier == self._size and not self._held and not self._spilled
                while self._pending:
                    self._pending.popleft().result()
            if not complete:
                return None
            return self._file.hexdigest(), {name: h.hexdigest() for name, h in self._tensors.items()}
        except Exception:  # a hashing thread failed: the commit hashes the file itself
            return None
        finally:
            self.close()

    def close(self) -> None:
        """Stop the hashing threads; idempotent (after ``finish`` or on a failed transfer)."""
        self._held.clear()
        self._file_pool.shutdown(wait=True, cancel_futures=True)
        self._tensor_pool.shutdown(wait=True, cancel_futures=True)


class DownloadSink:
    """One payload object's destination (see the module docstring). ``size``: the object's
    size from the manifest; ``progress(n)``: bytes written since the last call; ``check()``:
    raises the pull's error once it was stopped."""

    def __init__(self, fd: int, size: int, ranges: Sequence[tuple[str, int, int]], *,
                 progress: Callable[[int], None], check: Callable[[], None],
                 on_tensor: Callable[[str, str], None] | None = None) -> None:
        self.fd = fd
        self.size = size
        self.written = 0
        self.digests = InOrderDigests(fd, size, ranges, on_tensor)
        self._progress = progress
        self.check = check
        self._lock = threading.Lock()
        self._since_writeback = 0

    def write(self, offset: int, data: bytes | memoryview) -> None:
        """Write one piece at ``offset``: ``RemoteObjectInvalid`` past ``size``; the pull's
        error once it was stopped."""
        self.check()
        n = len(data)
        if offset < 0 or offset + n > self.size:
            raise RemoteObjectInvalid("a remote object is longer than the manifest says")
        store_io.pwrite_all(self.fd, data, offset)
        with self._lock:
            self.written += n
            self._since_writeback += n
            kick = self._since_writeback >= WRITEBACK_EVERY
            if kick:
                self._since_writeback = 0
        if kick:
            store_io.start_writeback(self.fd)  # the disk works during the download, not at commit
        self._progress(n)
        self.digests.feed(offset, data)

    def landed(self, offset: int, n: int) -> None:
        """``n`` bytes at ``offset`` were written into the staging file by another process (the
        peer tier's transfer process): counted and hashed exactly as ``write`` would, read back
        from the page cache. ``RemoteObjectInvalid`` past ``size``."""
        self.check()
        if offset < 0 or offset + n > self.size:
            raise RemoteObjectInvalid("a peer's chunk lies past the end of its file")
        data = os.pread(self.fd, n, offset)
        if len(data) != n:
            raise RemoteObjectInvalid("a peer's chunk is missing from the staging file")
        with self._lock:
            self.written += n
        self._progress(n)
        self.digests.feed(offset, data)

    def finish(self) -> tuple[str, dict[str, str]] | None:
        """The digests computed on the way (``InOrderDigests.finish``), None to re-hash at commit."""
        if self.written != self.size:
            self.digests.close()
            return None
        return self.digests.finish()

    def close(self) -> None:
        self.digests.close()
