"""The ``file://`` remote: a directory on a filesystem every node mounts (NFS, a cluster FS).

Each object is written to a temporary name beside its final one (``.<file>.<uuid>.tmp``),
fsynced, then renamed into place, and the directory fsynced: a reader sees a whole object or
none, as with S3, and ``READY.json`` is renamed last by the caller's order. A writer killed
midway leaves only temporary names, which readers never open and the next successful upload
of the same key leaves behind harmlessly (``list_entries`` ignores them).

Whoever else writes to the shared directory is not trusted with hwrd's reads and writes. Below
the configured directory (which belongs to the operator and may be reached through symlinks),
every step is taken relative to a descriptor of the step above with ``O_NOFOLLOW``:
``artifacts/``, the key's directory and the object itself are never followed out of the remote
through a symlink, and an object must be a regular file, opened ``O_NONBLOCK`` so that a FIFO
or a device in its place fails at once instead of blocking a transfer thread (and with it the
daemon's stop). Such an object, a symlink (``ELOOP``), a directory in a file's place, or one
unreadable object is refused for that key alone (``RemoteObjectInvalid``); only a failure of
the remote itself (the directory gone, an I/O error, a stale mount) is ``RemoteUnavailable``.

Limits: the filesystem must give rename atomicity within a directory (POSIX; NFSv3+ does);
temporary files of a dead writer are not collected; a read that blocks inside the filesystem
(a hung NFS server) still blocks its thread: the pull's stall timeout fails the pull, not the
thread.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import uuid
from collections.abc import Callable, Iterator

from hwr.client.identity import is_key
from hwr.daemon.fleet.remote import (
    MAX_DOCUMENT_BYTES,
    READY_OBJECT,
    PayloadSink,
    Progress,
    RemoteEntry,
    RemoteLocation,
    denied,
    invalid,
    unreachable,
)

__all__ = ["FileRemote"]

_CHUNK = 8 << 20
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_STEP = _DIR | os.O_NOFOLLOW
_OBJECT = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
#: Errors that concern one object or key directory, not the remote: that key is refused.
_PER_OBJECT = frozenset({errno.ELOOP, errno.ENOTDIR, errno.EISDIR, errno.ENXIO, errno.EACCES, errno.EPERM,
                         errno.ENAMETOOLONG, errno.EINVAL, errno.EOPNOTSUPP})


class _Refused(Exception):
    """An object (or its key directory) that is not what the layout allows (see the module)."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


class FileRemote:
    def __init__(self, location: RemoteLocation) -> None:
        self.location = location
        self.root = location.prefix
        self._closing = False  # set by close(): copies stop at their next chunk

    def _check_open(self) -> None:
        if self._closing:
            raise unreachable(self.location, "hwrd is stopping")

    def _fail(self, exc: OSError) -> Exception:
        if isinstance(exc, PermissionError):  # hwrd's user may not read or write there: not an outage
            return denied(self.location, exc.strerror or type(exc).__name__)
        return unreachable(self.location, exc.strerror or type(exc).__name__)

    # ------------------------------------------------------------------ safe walking
    @contextlib.contextmanager
    def _directory(self, parts: list[str], *, create: bool = False) -> Iterator[int]:
        """A descriptor of ``root/parts...``, each part opened ``O_NOFOLLOW`` below the root;
        ``_Refused`` when a part is a symlink or not a directory, ``FileNotFoundError`` when one
        is missing (unless ``create``), ``OSError`` for the remote itself."""
        fd = os.open(self.root, _DIR)  # the operator's directory: may be reached through symlinks
        try:
            for part in parts:
                if create:
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(part, 0o755, dir_fd=fd)
                try:
                    child = os.open(part, _STEP, dir_fd=fd)
                except OSError as exc:
                    if exc.errno in _PER_OBJECT:
                        raise _Refused(f"{part} is a symlink or not a directory") from None
                    raise
                os.close(fd)
                fd = child
            yield fd
        finally:
            os.close(fd)

    @staticmethod
    def _split(name: str) -> tuple[list[str], str]:
        parts = name.split("/")
        return parts[:-1], parts[-1]

    def _open_object(self, name: str) -> int:
        """A read descriptor of a regular object (see the module docstring for the rules)."""
        parents, file = self._split(name)
        with self._directory(parents) as dfd:
            try:
                fd = os.open(file, _OBJECT, dir_fd=dfd)
            except OSError as exc:
                if exc.errno in _PER_OBJECT:
                    raise _Refused("is a symlink or cannot be opened") from None
                raise
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise _Refused("is not a regular file")
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _guarded(self, name: str, action: Callable[[], object]) -> object:
        try:
            return action()
        except _Refused as exc:
            raise invalid(self.location, name, exc.why) from None
        except FileNotFoundError:
            raise
        except OSError as exc:
            raise self._fail(exc) from None

    # ------------------------------------------------------------------ reads
    def get_bytes(self, name: str, limit: int = MAX_DOCUMENT_BYTES) -> bytes | None:
        def read() -> bytes | None:
            try:
                fd = self._open_object(name)
            except FileNotFoundError:
                return None
            try:
                data = b""
                while len(data) <= limit:
                    chunk = os.read(fd, min(_CHUNK, limit + 1 - len(data)))
                    if not chunk:
                        return data
                    data += chunk
            finally:
                os.close(fd)
            raise _Refused(f"is larger than {limit} bytes")

        return self._guarded(name, read)  # type: ignore[return-value]

    def get_into(self, name: str, sink: PayloadSink) -> None:
        size = sink.size

        def copy() -> None:
            try:
                src = self._open_object(name)
            except FileNotFoundError:
                raise _Refused("is missing") from None
            try:
                have = os.fstat(src).st_size
                if have != size:
                    raise _Refused(f"is {have} bytes, the manifest says {size}")
                os.posix_fadvise(src, 0, 0, os.POSIX_FADV_SEQUENTIAL)
                offset = 0
                while offset < size:
                    self._check_open()
                    # A fresh buffer per piece: the sink hashes it after this loop moved on.
                    data = os.pread(src, min(_CHUNK, size - offset), offset)
                    if not data:
                        raise _Refused("was truncated while it was read")
                    sink.write(offset, data)
                    offset += len(data)
            finally:
                os.close(src)

        self._guarded(name, copy)

    # ------------------------------------------------------------------ writes
    def _put(self, name: str, write: Callable[[int], None]) -> None:
        parents, file = self._split(name)
        tmp = f".{file}.{uuid.uuid4().hex}.tmp"

        def put() -> None:
            with self._directory(parents, create=True) as dfd:
                try:
                    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                                 dir_fd=dfd)
                    try:
                        write(fd)
                        os.fsync(fd)
                    finally:
                        os.close(fd)
                    os.rename(tmp, file, src_dir_fd=dfd, dst_dir_fd=dfd)
                    os.fsync(dfd)
                except BaseException:
                    with contextlib.suppress(OSError):
                        os.unlink(tmp, dir_fd=dfd)
                    raise

        try:
            self._guarded(name, put)
        except FileNotFoundError as exc:
            raise self._fail(exc) from None

    def put_bytes(self, name: str, data: bytes) -> None:
        def write(fd: int) -> None:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]

        self._put(name, write)

    def put_file(self, name: str, fd: int, size: int, progress: Progress | None = None) -> None:
        def write(dst: int) -> None:
            offset = 0
            while offset < size:
                self._check_open()
                n = os.copy_file_range(fd, dst, min(_CHUNK * 8, size - offset), offset, offset)
                if n == 0:
                    raise OSError(5, "the local payload ended early")
                offset += n
                if progress is not None:
                    progress(n)

        self._put(name, write)

    # ------------------------------------------------------------------ listing
    def exists(self, name: str) -> bool:
        parents, file = self._split(name)

        def look() -> bool:  # only a regular object counts (a symlink or a FIFO is never read)
            try:
                with self._directory(parents) as dfd:
                    return stat.S_ISREG(os.stat(file, dir_fd=dfd, follow_symlinks=False).st_mode)
            except (FileNotFoundError, _Refused):
                return False

        return bool(self._guarded(name, look))

    def list_entries(self) -> list[RemoteEntry]:
        try:
            with self._directory(["artifacts"]) as base:
                keys = sorted(k for k in os.listdir(base) if is_key(k))
                return [self._entry(base, key) for key in keys]
        except FileNotFoundError:
            self.probe()
            return []
        except _Refused:
            return []  # artifacts/ itself is a symlink: nothing of this remote is listed through it
        except OSError as exc:
            raise self._fail(exc) from None

    def list_names(self, directory: str) -> list[str]:
        parts = [p for p in directory.split("/") if p]

        def names() -> list[str]:
            try:
                with self._directory(parts) as dfd:
                    return sorted(n for n in os.listdir(dfd) if not n.startswith(".")
                                  and stat.S_ISREG(os.stat(n, dir_fd=dfd, follow_symlinks=False).st_mode))
            except (FileNotFoundError, _Refused):
                return []

        return self._guarded(directory, names)  # type: ignore[return-value]

    def delete(self, name: str) -> None:
        parents, file = self._split(name)

        def remove() -> None:
            try:
                with self._directory(parents) as dfd:
                    os.unlink(file, dir_fd=dfd)
            except (FileNotFoundError, _Refused):
                pass

        self._guarded(name, remove)

    @staticmethod
    def _entry(base: int, key: str) -> RemoteEntry:
        ready, size = False, 0
        with contextlib.suppress(OSError):
            kfd = os.open(key, _STEP, dir_fd=base)  # a symlinked key directory lists as empty
            try:
                for name in os.listdir(kfd):
                    if name.startswith("."):
                        continue  # an upload's temporary name
                    st = os.stat(name, dir_fd=kfd, follow_symlinks=False)
                    if not stat.S_ISREG(st.st_mode):
                        continue
                    if name == READY_OBJECT:
                        ready = True
                    elif name.endswith(".safetensors"):
                        size += st.st_size
            finally:
                os.close(kfd)
        return RemoteEntry(key, ready, size)

    def probe(self) -> None:
        try:
            # Opened, not only stat-ed: a directory hwrd's user may not search is REMOTE_DENIED
            # (a permission to grant), a missing one REMOTE_UNAVAILABLE (a mount that is not there).
            os.close(os.open(self.root, _DIR))
        except NotADirectoryError:
            raise self._fail(FileNotFoundError(2, "not a directory")) from None
        except OSError as exc:
            raise self._fail(exc) from None

    def close(self) -> None:
        self._closing = True
