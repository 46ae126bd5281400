"""The ``file://`` remote: a directory on a filesystem every node mounts (NFS, a cluster FS).

Each object is written to a temporary name beside its final one (``.<file>.<uuid>.tmp``),
fsynced, then renamed into place, and the directory fsynced: a reader sees a whole object or
none, as with S3, and ``READY.json`` is renamed last by the caller's order. A writer killed
midway leaves only temporary names, which readers never open and the next successful upload
of the same key leaves behind harmlessly (``list_entries`` ignores them).

Limits: the filesystem must give rename atomicity within a directory (POSIX; NFSv3+ does);
temporary files of a dead writer are not collected. Reads follow no symlinks in the key's
directory (``O_NOFOLLOW``); the directory itself belongs to the operator.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from pathlib import Path

from hwr.client.identity import is_key
from hwr.daemon.fleet.remote import (
    MAX_DOCUMENT_BYTES,
    READY_OBJECT,
    Progress,
    RemoteEntry,
    RemoteLocation,
    invalid,
    unreachable,
)

__all__ = ["FileRemote"]

_CHUNK = 8 << 20


class FileRemote:
    def __init__(self, location: RemoteLocation) -> None:
        self.location = location
        self.root = Path(location.prefix)
        self._closing = False  # set by close(): copies stop at their next chunk

    def _check_open(self) -> None:
        if self._closing:
            raise unreachable(self.location, "hwrd is stopping")

    def _path(self, name: str) -> Path:
        return self.root / name

    def _fail(self, exc: OSError) -> Exception:
        return unreachable(self.location, exc.strerror or type(exc).__name__)

    def get_bytes(self, name: str, limit: int = MAX_DOCUMENT_BYTES) -> bytes | None:
        try:
            fd = os.open(self._path(name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise self._fail(exc) from None
        try:
            data = b""
            while len(data) <= limit:
                chunk = os.read(fd, min(_CHUNK, limit + 1 - len(data)))
                if not chunk:
                    return data
                data += chunk
        except OSError as exc:
            raise self._fail(exc) from None
        finally:
            os.close(fd)
        raise invalid(self.location, name, f"is larger than {limit} bytes")

    def get_into(self, name: str, fd: int, size: int, progress: Progress | None = None) -> None:
        try:
            src = os.open(self._path(name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise invalid(self.location, name, "is missing") from None
        except OSError as exc:
            raise self._fail(exc) from None
        try:
            have = os.fstat(src).st_size
            if have != size:
                raise invalid(self.location, name, f"is {have} bytes, the manifest says {size}")
            offset = 0
            while offset < size:
                self._check_open()
                # copy_file_range: in-kernel copy (no userspace buffer); a short count near the
                # end is fine, 0 before ``size`` means the file shrank under us.
                n = os.copy_file_range(src, fd, min(_CHUNK * 8, size - offset), offset, offset)
                if n == 0:
                    raise invalid(self.location, name, "was truncated while it was read")
                offset += n
                if progress is not None:
                    progress(n)
        except OSError as exc:
            raise self._fail(exc) from None
        finally:
            os.close(src)

    def _put(self, name: str, write: object) -> None:
        final = self._path(name)
        tmp = final.with_name(f".{final.name}.{uuid.uuid4().hex}.tmp")
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            try:
                write(fd)  # type: ignore[operator]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, final)
            dfd = os.open(final.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
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

    def exists(self, name: str) -> bool:
        try:
            os.lstat(self._path(name))
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise self._fail(exc) from None
        return True

    def list_entries(self) -> list[RemoteEntry]:
        base = self.root / "artifacts"
        try:
            keys = [k for k in os.listdir(base) if is_key(k)]
        except FileNotFoundError:
            self.probe()
            return []
        except OSError as exc:
            raise self._fail(exc) from None
        entries = []
        for key in sorted(keys):
            ready, size = False, 0
            with contextlib.suppress(OSError):
                for name in os.listdir(base / key):
                    if name.startswith("."):
                        continue  # an upload's temporary name
                    if name == READY_OBJECT:
                        ready = True
                    elif name.endswith(".safetensors"):
                        size += os.lstat(base / key / name).st_size
            entries.append(RemoteEntry(key, ready, size))
        return entries

    def probe(self) -> None:
        try:
            if not os.path.isdir(self.root):
                raise FileNotFoundError(2, "no such directory")
        except OSError as exc:
            raise self._fail(exc) from None

    def close(self) -> None:
        self._closing = True
