"""Thin syscall helpers of the store, and single-pass hashing.

Every call that can fail with ENOSPC/EIO during publication (``fallocate``, ``pwrite``,
``fsync``, ``rename``) goes through a one-line helper here so tests can inject faults by
replacing it at the OS boundary. ``FAULT_HOOK`` lives in ``hwr.daemon.store.root``.

``hash_ranges`` hashes whole files and tensor byte ranges through read-only ``mmap`` views on a
small thread pool: ``hashlib`` releases the GIL for large buffers, so a file digest and the tensor
digests of the same bytes run on different cores. Measured against a single pass that ``preadv``s
each chunk into reused buffers and feeds both digests from it: the copy out of the page cache
cost ~0.4 s of system time per GiB more than the mapping's page faults, on a machine where CPU
time, not parallelism, is the limit (2 busy cores); so the mapping stays. Limit: a file's digest
is inherently serial, so one huge file hashes at one core's speed, and each byte is hashed
twice (file and tensor digests are both part of the manifest format). Daemon-owned producers
report their digests instead (``Installer.commit(trusted_digests=...)``), which skips this pass.

``start_writeback`` asks the kernel to begin writing dirty pages of a range to disk now
(``sync_file_range(SYNC_FILE_RANGE_WRITE)``), so the ``fsync`` that makes a publication durable
later finds little left to do. It is a hint: it never makes anything durable by itself, and
where it is unavailable it does nothing.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import mmap
import os
import shutil
import stat
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from hwr.client.errors import NoSpace, PublicationFailed, StoreIOError
from hwr.client.safetensors_header import pread_exact

__all__ = [
    "GroupSync",
    "create_file",
    "fallocate",
    "fsync",
    "fsync_dir",
    "hash_ranges",
    "io_error",
    "parse_json",
    "pwrite_all",
    "read_small",
    "read_state_file",
    "remove_tree",
    "rename",
    "start_writeback",
    "write_new_file",
]

HASH_CHUNK = 16 * 1024 * 1024
HASH_WORKERS = max(2, min(8, os.cpu_count() or 2))
OPEN_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC


def fallocate(fd: int, size: int) -> None:
    os.posix_fallocate(fd, 0, size)


def pwrite(fd: int, data: memoryview, offset: int) -> int:
    return os.pwrite(fd, data, offset)


def fsync(fd: int) -> None:
    os.fsync(fd)


def rename(src: Path, dst: Path) -> None:
    os.rename(src, dst)


#: The mode a committed directory gets for a move out of its parent (``move_out``); at this mode
#: with its ``READY.json`` a crash leaves a complete artifact that recovery makes 0555 again.
MOVABLE_DIR_MODE = 0o700


def move_out(src: Path, dst: Path) -> None:
    """Rename ``src`` into another parent directory (retirement into ``tmp/``, quarantine).

    Moving a directory to another parent rewrites its ``..`` entry, which needs write permission
    on the directory itself: an owner without ``CAP_DAC_OVERRIDE`` (hwrd as an ordinary user)
    gets ``EACCES`` for a 0555 artifact directory. So a directory without owner write permission
    is made ``MOVABLE_DIR_MODE`` first, and gets its mode back when the rename fails. Raises the
    rename's (or the chmod's) ``OSError``."""
    try:
        st = os.lstat(src)
    except FileNotFoundError:
        os.rename(src, dst)  # raises the rename's own error
        return
    restore = None
    if stat.S_ISDIR(st.st_mode) and not st.st_mode & stat.S_IWUSR:
        restore = stat.S_IMODE(st.st_mode)
        os.chmod(src, MOVABLE_DIR_MODE, follow_symlinks=False)
    try:
        os.rename(src, dst)
    except OSError:
        if restore is not None:
            with contextlib.suppress(OSError):
                os.chmod(src, restore, follow_symlinks=False)
        raise


def pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    """Write all of ``data`` at ``offset`` (pwrite may write less than asked, e.g. past 2 GiB)."""
    view = memoryview(data).cast("B")
    while view:
        written = pwrite(fd, view, offset)
        if written <= 0:
            raise OSError(errno.EIO, "short write")
        view = view[written:]
        offset += written


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fsync(fd)
    finally:
        os.close(fd)


class GroupSync:
    """Group commit of one directory's ``fsync``: callers that renamed entries in it share rounds.

    ``sync()`` returns once an ``fsync`` of the directory that STARTED AFTER the call began has
    completed, so every rename the caller made before calling is durable on return; it raises
    that round's error if the round failed. A caller arriving while a round is in flight cannot
    be covered by it (its rename may have missed it): it waits for that round, then joins the
    next one, which one waiter leads on behalf of all who arrived meanwhile. Under churn N
    concurrent commits then cost about two directory fsyncs instead of N.

    Why this keeps "a crash leaves either nothing visible or a complete artifact": the commit
    point of a publication is the rename of its staging directory (payloads, manifest and READY
    marker already fsynced, and the staging directory itself) into ``artifacts/``. Whether that
    rename survives a crash is decided by the journal, not by who fsyncs: before the round it may
    or may not be durable, and either outcome is a complete artifact or none. Group commit only
    changes WHEN the caller learns it is durable; no caller is told before its own round ends.
    The same holds for retirements (rename out of ``artifacts/``) that ``Retirement.delete`` makes durable.

    Limits: a failed round fails every caller it covered (none retries: after a failed fsync the
    page state is unknown, so a retry that "succeeds" would prove nothing); thread-safe, not
    fork-safe.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.rounds = 0  # fsyncs run (diagnostic counters for tests and benchmarks)
        self.joined = 0  # callers that arrived while a round was in flight
        self._lock = threading.Lock()
        self._current: _Round | None = None
        self._started = 0  # rounds started so far (each round's index is the count at its start)
        self._durable = 0  # the highest index of a round that finished without error

    def mark(self) -> int:
        """A mark for "now": ``covered(mark)`` later tells whether a round that started after
        this call has completed, i.e. whether renames made before it are durable."""
        with self._lock:
            return self._started

    def covered(self, mark: int) -> bool:
        with self._lock:
            return self._durable > mark

    def sync(self) -> None:
        with self._lock:
            current = self._current
            if current is None or current.finished:
                round_, lead = self._start_round(current), True
            else:
                round_, lead = current, False
                self.joined += 1
        if not lead:
            # ``round_`` was in flight when we arrived, so it may have missed our rename: the
            # round after it (started once it finished, hence after we arrived) is ours.
            round_.done.wait()
            with self._lock:
                following = round_.next
                if following is None:
                    round_, lead = self._start_round(round_), True
                else:
                    round_ = following
        if lead:
            try:
                fsync_dir(self.path)
            except BaseException as exc:
                round_.error = exc
            finally:
                with self._lock:
                    self.rounds += 1
                    round_.finished = True
                    if round_.error is None:
                        self._durable = max(self._durable, round_.index)
                round_.done.set()
        else:
            round_.done.wait()
        error = round_.error
        if error is None:
            return
        if lead or not isinstance(error, OSError):
            raise error
        raise OSError(error.errno, error.strerror, str(self.path)) from error  # one per thread

    def _start_round(self, previous: _Round | None) -> _Round:
        self._started += 1
        round_ = _Round(self._started)
        if previous is not None:
            previous.next = round_
        self._current = round_
        return round_


class _Round:
    def __init__(self, index: int) -> None:
        self.index = index
        self.finished = False
        self.error: BaseException | None = None
        self.next: _Round | None = None  # the round started after this one finished
        self.done = threading.Event()


def write_new_file(path: Path, data: bytes, *, mode: int = 0o444) -> None:
    """Create ``path`` exclusively, write ``data``, drop write permission, fsync."""
    fd = create_file(path, data, mode=mode)
    try:
        fsync(fd)
    finally:
        os.close(fd)


def create_file(path: Path, data: bytes, *, mode: int = 0o444) -> int:
    """Create ``path`` exclusively, write ``data``, drop write permission; returns the open
    descriptor, NOT fsynced: the caller fsyncs it (``write_new_file`` is the synced form)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        pwrite_all(fd, data, 0)
        os.fchmod(fd, mode)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_small(fd: int, limit: int) -> bytes:
    """Read a whole small file through ``fd``; longer than ``limit`` returns ``limit + 1`` bytes."""
    chunks: list[bytes] = []
    offset = 0
    while offset <= limit:
        chunk = os.pread(fd, limit + 1 - offset, offset)
        if not chunk:
            break
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks)


#: The largest state file hwrd reads at start (channels.json, pins.json, ...); the lease journal
#: passes a larger bound of its own.
STATE_FILE_MAX_BYTES = 32 * 1024 * 1024


def read_state_file(path: Path, limit: int = STATE_FILE_MAX_BYTES) -> bytes | None:
    """The bytes of one of hwrd's own small state files, read as if someone had replaced it:
    a symlink is not followed (``ELOOP``), the open never blocks (a FIFO fails at once), only a
    regular file is read (else ``EINVAL``) and at most ``limit`` bytes (else ``EFBIG``). None
    when there is no such file; any other failure is an ``OSError``, which callers treat as an
    unreadable file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except FileNotFoundError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, f"{path.name} is not a regular file")
        if st.st_size > limit:
            raise OSError(errno.EFBIG, f"{path.name} is larger than {limit} bytes")
        data = read_small(fd, limit)
        if len(data) > limit:
            raise OSError(errno.EFBIG, f"{path.name} is larger than {limit} bytes")
        return data
    finally:
        os.close(fd)


def parse_json(raw: bytes) -> object:
    """``json.loads`` whose every failure is a ``ValueError`` (nesting deeper than the decoder's
    recursion limit raises ``RecursionError`` otherwise)."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def remove_tree(path: Path) -> None:
    """Delete a file or directory tree, restoring owner write permission first (dirs are 0555)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        path.unlink(missing_ok=True)
        return
    if _remove_flat_dir(path, st):
        return
    for dirpath, dirnames, _ in os.walk(path):
        with contextlib.suppress(OSError):
            os.chmod(dirpath, 0o700)
        for name in dirnames:
            with contextlib.suppress(OSError):
                os.chmod(os.path.join(dirpath, name), 0o700, follow_symlinks=False)
    shutil.rmtree(path, ignore_errors=True)


def _remove_flat_dir(path: Path, st: os.stat_result) -> bool:
    """Delete a directory that holds only files (every artifact, staging and trash directory)
    in a few system calls (chmod, one listing, an unlink per file, rmdir); False, having
    deleted nothing or only some files, when it holds anything else or a call fails: then the
    general walk finishes the job."""
    try:
        if stat.S_IMODE(st.st_mode) & 0o700 != 0o700:
            os.chmod(path, 0o700)
        with os.scandir(path) as entries:
            names = []
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    return False
                names.append(entry.name)
        for name in names:
            os.unlink(os.path.join(path, name))
        os.rmdir(path)
    except OSError:
        return False
    return True


def io_error(exc: OSError, what: str, *, publication: bool = False) -> Exception:
    """Map an ``OSError`` to the typed error a caller sees (ENOSPC/EDQUOT -> ``NoSpace``)."""
    details = {"errno": exc.errno or 0, "operation": what}
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return NoSpace(f"{what}: no space left on device", details=details)
    if publication:
        return PublicationFailed(f"{what}: {exc.strerror or exc}", details=details)
    return StoreIOError(f"{what}: {exc.strerror or exc}", details=details)


def start_writeback(fd: int, offset: int = 0, nbytes: int = 0) -> None:
    """Begin writeback of ``[offset, offset + nbytes)`` (0: to the end); a hint, never raises."""
    from hwr.client.writeback import start_writeback as hint

    hint(fd, offset, nbytes)


#: Up to this many bytes in all, ``hash_ranges`` reads the files instead of mapping them.
SMALL_READ_BYTES = 4 << 20


def _hash_small(files: Sequence[tuple[int, int, Sequence[tuple[str, int, int]]]],
                progress: Callable[[int, int], None] | None, total: int) -> tuple[list[str], dict[str, str]]:
    file_sha: list[str] = []
    tensor_sha: dict[str, str] = {}
    for fd, size, ranges in files:
        data = pread_exact(fd, size, 0)
        if len(data) != size:
            raise OSError(errno.EIO, f"file shorter than {size} bytes")
        with memoryview(data) as view:
            file_sha.append(hashlib.sha256(view).hexdigest())
            for name, begin, end in ranges:
                tensor_sha[name] = hashlib.sha256(view[begin:end]).hexdigest()
    if progress is not None:
        progress(total, total)
    return file_sha, tensor_sha


def hash_ranges(
    files: Sequence[tuple[int, int, Sequence[tuple[str, int, int]]]],
    progress: Callable[[int, int], None] | None = None,
) -> tuple[list[str], dict[str, str]]:
    """SHA-256 of whole files and of named byte ranges within them.

    ``files`` holds ``(fd, size, [(tensor name, begin, end), ...])`` with absolute offsets. Returns
    the file digests (same order) and the range digests by name. ``progress(done, total)`` is
    called from worker threads with the bytes hashed so far (file and range bytes both count).
    """
    total = sum(size for _, size, _ in files) + sum(e - b for _, _, ranges in files for _, b, e in ranges)
    if total <= SMALL_READ_BYTES:  # churn-sized: one pread per file beats mmap + faults + munmap
        return _hash_small(files, progress, total)
    maps = [mmap.mmap(fd, size, prot=mmap.PROT_READ) if size else None for fd, size, _ in files]
    done = [0]
    lock = threading.Lock()

    def digest(index: int, begin: int, end: int) -> str:
        h = hashlib.sha256()
        mapped = maps[index]
        if mapped is not None:
            with memoryview(mapped) as view:
                for start in range(begin, end, HASH_CHUNK):
                    stop = min(end, start + HASH_CHUNK)
                    h.update(view[start:stop])
                    if progress is not None:
                        with lock:
                            done[0] += stop - start
                            progress(done[0], total)
        return h.hexdigest()

    try:
        if total <= 2 * HASH_CHUNK:  # small (churn): starting a pool costs more than hashing inline
            return ([digest(i, 0, size) for i, (_, size, _) in enumerate(files)],
                    {name: digest(i, begin, end) for i, (_, _, ranges) in enumerate(files)
                     for name, begin, end in ranges})
        with ThreadPoolExecutor(max_workers=HASH_WORKERS, thread_name_prefix="hwr-hash") as pool:
            file_jobs = [pool.submit(digest, i, 0, size) for i, (_, size, _) in enumerate(files)]
            range_jobs = {
                name: pool.submit(digest, i, begin, end)
                for i, (_, _, ranges) in enumerate(files)
                for name, begin, end in ranges
            }
            return [job.result() for job in file_jobs], {n: job.result() for n, job in range_jobs.items()}
    finally:
        for mapped in maps:
            if mapped is not None:
                mapped.close()
