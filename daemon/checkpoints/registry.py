"""The checkpoint registry: canonical safetensors checkpoints registered with (and kept open by) hwrd.

A checkpoint is a directory of ``*.safetensors`` files (searched up to ``MAX_DEPTH`` levels), a
Hugging Face cache snapshot (``.../models--org--name/snapshots/<rev>/``), or one ``.safetensors``
file (that file alone, registered under its own path). ``add`` validates every
header strictly (``read_header``, alignment not required: foreign writers may not pad) and gives
each file a *source identity*:

- ``immutable-blob:<hash>`` when the file is a HF snapshot link whose topology validates
  (``hf_blob_link``): ``models--<org>--<name>/snapshots/<40-hex rev>/<rel>`` is a symlink whose
  target is exactly ``../`` x (depth) ``blobs/<40 or 64 hex>``, and the blob is a regular file in
  that same repository's ``blobs/`` reached without any other symlink;
- otherwise ``sha256:<hex>`` of the content, hashed through one descriptor whose
  ``(size, dev, inode, mtime_ns, ctime_ns)`` must be the same before and after hashing and equal
  to the path's ``lstat`` (a file changing under the hash raises ``CheckpointModified``). Digests
  are cached under ``<root>/checkpoints/digests.json`` keyed by that fingerprint, so a restart
  or a second registration does not re-hash.

The checkpoint id is the SHA-256 of the canonical JSON list of ``[relative name, source
identity]``: the same content registers once, wherever it lives. Registered paths are remembered
in ``<root>/checkpoints/registry.json`` and re-registered at start.

Modification after registration: ``check`` compares each file's ``lstat`` and the retained
descriptor's ``fstat`` with the registered fingerprint; a difference marks the checkpoint
``modified`` for good and raises ``CheckpointModified`` (leases and prewarm are refused).
Limits: detection relies on the kernel updating mtime/ctime (an ``mmap`` write is only seen once
written back); a file modified and restored within one timestamp tick is not detected.

Access: registration is an operator action (``hwr.daemon.service.roles``), and files are opened with the
registering caller's rights (``hwr.daemon.checkpoints.caller_access``), never the daemon's; each file is
opened ``O_NONBLOCK`` and checked to be regular before any read, and hashed with ``pread``, never
through a mapping (the daemon maps no file a client can truncate). A registered checkpoint's
files are then leased to every uid with the acquire role: registering vouches for that.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import stat
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hwr.client.errors import (
    CheckpointModified,
    CheckpointNotFound,
    HwrError,
    InvalidRequest,
    ManifestCorrupt,
    PermissionDeniedError,
)
from hwr.client.safetensors_header import Header, TensorEntry, read_header
from hwr.daemon.checkpoints.caller_access import OPEN_FLAGS, CallerOpener, daemon_user
from hwr.daemon.checkpoints.files import (
    MAX_DEPTH,
    FileFingerprint,
    HfBlobLink,
    checkpoint_id_for,
    hf_blob_link,
    load_json,
    plain_path,
    registry_entry,
    resolve_checkpoint_prefix,
    safetensors_files,
    write_json,
)
from hwr.daemon.system.peercred import PeerCred

__all__ = [
    "MAX_DEPTH",
    "Checkpoint",
    "CheckpointFile",
    "Checkpoints",
    "FileFingerprint",
    "HfBlobLink",
    "checkpoint_id_for",
    "hf_blob_link",
    "resolve_checkpoint_prefix",
]

log = logging.getLogger("hwrd.checkpoints")
MAX_FILES = 4096
HASH_CHUNK = 16 << 20
_OPEN = OPEN_FLAGS  # O_NONBLOCK too: a FIFO planted under a registered name never blocks a reopen


@dataclass(frozen=True)
class CheckpointFile:
    name: str  # relative to the checkpoint directory, "/"-separated
    path: Path  # the regular file actually opened (the blob for an HF link)
    fingerprint: FileFingerprint
    source: str  # "immutable-blob:<hash>" or "sha256:<hex>"
    header: Header


@dataclass
class Checkpoint:
    """A registered checkpoint; owns one read-only descriptor per file (never a mapping: a file
    another user can truncate would fault the daemon with SIGBUS on the next touch)."""

    checkpoint_id: str
    path: Path
    model_id: str
    revision: str
    files: tuple[CheckpointFile, ...]
    registered_at: float
    tensors: dict[str, tuple[int, TensorEntry]]
    modified: bool = False
    _fds: list[int] = field(default_factory=list, repr=False)
    registrant: PeerCred | None = field(default=None, repr=False)  # None: the daemon's own rights

    @property
    def size_bytes(self) -> int:
        return sum(f.fingerprint.size for f in self.files)

    @property
    def source_kind(self) -> str:
        return "immutable-blob" if all(f.source.startswith("immutable-blob:") for f in self.files) \
            else "content-sha256"

    def close(self) -> None:
        """Drop the descriptors (idempotent)."""
        fds, self._fds = self._fds, []
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)


class Checkpoints:
    """Registered checkpoints of one daemon (thread-safe)."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self._lock = threading.RLock()
        self._by_id: dict[str, Checkpoint] = {}
        self._digests: dict[str, str] = {}

    # --------------------------------------------------------------- lifecycle
    def open(self) -> list[tuple[str, HwrError]]:
        """Create the state dir, load the digest cache, re-register remembered paths (each with
        the rights of the caller that registered it)."""
        with contextlib.suppress(FileExistsError):
            self.state_dir.mkdir(mode=0o700)
        self._digests = load_json(self.state_dir / "digests.json", dict)
        report = []
        for entry in load_json(self.state_dir / "registry.json", list):
            path, cred = registry_entry(entry)
            if path is None:
                continue
            try:
                self.add(Path(path), remember=False, cred=cred)
            except HwrError as exc:
                log.warning("checkpoint %s not re-registered: %s", path, exc)
                report.append((str(path), exc))
        return report

    def close(self) -> None:
        with self._lock:
            for ckpt in self._by_id.values():
                ckpt.close()
            self._by_id.clear()

    # --------------------------------------------------------------- registry
    def add(self, path: Path, *, remember: bool = True, cred: PeerCred | None = None) -> tuple[Checkpoint, bool]:
        """Validate and register ``path`` with ``cred``'s rights; returns ``(checkpoint, added)``.

        ``cred`` is the caller (``None``: the daemon itself). The directory and every file are
        opened with the caller's rights (``hwr.daemon.checkpoints.caller_access``), never with the daemon's;
        a ``*.safetensors`` entry that is a symlink leaving the checkpoint directory is refused
        (except an exact HF snapshot -> blob link); errors name files and checks, never bytes
        read from them.
        """
        path = Path(os.path.abspath(path))
        opener = CallerOpener(cred) if cred is not None else None
        try:
            st = os.stat(path)
        except OSError as exc:
            if exc.errno in (errno.EACCES, errno.EPERM):  # the daemon's own lookup: its user is the one refused
                raise PermissionDeniedError(f"cannot read {path}: {exc.strerror}: hwrd's user, {daemon_user()}, "
                                            "cannot reach it", details={"path": str(path)}) from None
            raise InvalidRequest(f"cannot read {path}: {exc.strerror}", details={"path": str(path)}) from None
        # A directory, or one .safetensors file: a one-file checkpoint (that file alone, not its
        # directory's other files), registered under the file's path.
        one_file = stat.S_ISREG(st.st_mode) and path.name.endswith(".safetensors")
        if not stat.S_ISDIR(st.st_mode) and not one_file:
            raise InvalidRequest(f"{path} is neither a directory nor a .safetensors file: pass a checkpoint "
                                 "directory or one .safetensors file", details={"path": str(path)})
        root = path.parent if one_file else path
        if opener is not None and not one_file:  # may the caller list it? (the walk runs as the daemon)
            (probe,) = opener.open_all([Path(os.path.realpath(path))])
            if isinstance(probe, OSError):
                raise PermissionDeniedError(f"cannot read {path}: {probe.strerror}: {opener.readers()} "
                                            "cannot read it", details={"path": str(path)})
            os.close(probe)
        names = [path.name] if one_file else sorted(safetensors_files(path))
        if not names:
            raise InvalidRequest(f"{path} holds no .safetensors files", details={"path": str(path)})
        if len(names) > MAX_FILES:
            raise InvalidRequest("too many safetensors files", details={"limit": MAX_FILES})
        files: list[CheckpointFile] = []
        fds: list[int] = []
        model_id, revision = (path.name.removesuffix(".safetensors") if one_file else path.name), "local"
        try:
            targets = [self._resolve(root, name) for name in names]
            reals = [real for real, _link in targets]
            opened = opener.open_all(reals) if opener is not None else [_open_own(r) for r in reals]
            fds.extend(fd for fd in opened if isinstance(fd, int))
            for name, (real, link), fd in zip(names, targets, opened, strict=True):
                if isinstance(fd, OSError):
                    if fd.errno in (errno.EACCES, errno.EPERM):
                        readers = opener.readers() if opener is not None else f"hwrd's user, {daemon_user()},"
                        raise PermissionDeniedError(f"cannot open {name}: {fd.strerror}: {readers} cannot read it",
                                                    details={"file": name})
                    raise InvalidRequest(f"cannot open {name}: {fd.strerror}", details={"file": name})
                files.append(self._check_file(fd, real, name, link))
                if link is not None:
                    model_id, revision = link.model_id, link.revision
            tensors = _index(files)
            ckpt_id = checkpoint_id_for([(f.name, f.source) for f in files])
            with self._lock:
                existing = self._by_id.get(ckpt_id)
                if existing is not None and not existing.modified:
                    for fd in fds:
                        os.close(fd)
                    return existing, False
                ckpt = Checkpoint(ckpt_id, path, model_id, revision, tuple(files), time.time(), tensors,
                                  _fds=fds, registrant=cred)
                if existing is not None:
                    existing.close()
                self._by_id[ckpt_id] = ckpt
                self._save_digests()
                if remember:
                    self._save_registry()
            return ckpt, True
        except BaseException:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
            raise

    @staticmethod
    def _resolve(root: Path, name: str) -> tuple[Path, HfBlobLink | None]:
        """The file to open for ``name``: an exact HF blob, or the entry's real path, which
        must stay inside the checkpoint directory."""
        entry = root / name
        try:
            lst = os.lstat(entry)
            target = os.readlink(entry) if stat.S_ISLNK(lst.st_mode) else None
        except OSError as exc:
            raise InvalidRequest(f"cannot read {entry}: {exc.strerror}", details={"file": name}) from None
        link = hf_blob_link(entry, target)
        if link is not None and not plain_path(link.blob_path):
            link = None
        if link is not None:
            return link.blob_path, link
        real = Path(os.path.realpath(entry))
        if not real.is_relative_to(os.path.realpath(root)):
            raise PermissionDeniedError(f"{name} is a symlink leaving the checkpoint directory",
                                        details={"file": name})
        return real, None

    def _check_file(self, fd: int, real: Path, name: str, link: HfBlobLink | None) -> CheckpointFile:
        """Validate an opened file: a regular file (checked before any read: a FIFO or device
        is never read), a valid header, its source identity, unchanged throughout."""
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InvalidRequest(f"{name} is not a regular file", details={"file": name})
        before = FileFingerprint.of(st)
        try:
            header = read_header(fd, require_alignment=False)
        except ManifestCorrupt as exc:
            # Only the failed check's name: a value parsed from the bytes (a "header length",
            # a tensor name) would echo the contents of a file the caller may not read.
            check = str(exc.details.get("check", "header"))[:40]
            raise ManifestCorrupt(f"{name} is not a valid safetensors file (failed check: {check})",
                                  details={"file": name, "check": check}) from None
        except OSError as exc:
            raise InvalidRequest(f"cannot read {name}: {exc.strerror}", details={"file": name}) from None
        if link is not None:
            source = f"immutable-blob:{link.blob_hash}"
        else:
            source = "sha256:" + self._content_digest(fd, real, before, name)
        _check_unchanged(fd, real, before, name)
        return CheckpointFile(name, real, before, source, header)

    def _content_digest(self, fd: int, path: Path, before: FileFingerprint, name: str) -> str:
        """SHA-256 of the file read with ``pread`` into one reused buffer, never through a mapping:
        a client that truncates the file mid-hash makes the read come up short
        (``CheckpointModified``), where a mapped page past the new end would kill hwrd (SIGBUS)."""
        cache_key = f"{path}|{before.cache_key()}"
        cached = self._digests.get(cache_key)
        if cached is not None:
            return cached
        digest = hashlib.sha256()
        buffer = bytearray(min(HASH_CHUNK, before.size))
        with contextlib.suppress(OSError):  # advice only
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        with memoryview(buffer) as view:
            offset = 0
            while offset < before.size:
                want = min(len(buffer), before.size - offset)
                try:
                    got = os.preadv(fd, [view[:want]], offset)
                except OSError as exc:
                    raise CheckpointModified(f"{name} could not be read while hashed: {exc.strerror}",
                                             details={"file": name}) from None
                if got <= 0:
                    raise CheckpointModified(f"{name} became shorter while it was hashed",
                                             details={"file": name})
                digest.update(view[:got])
                offset += got
        _check_unchanged(fd, path, before, name)
        value = digest.hexdigest()
        with self._lock:
            self._digests[cache_key] = value
        return value

    def get(self, ref: str) -> Checkpoint:
        """A checkpoint by id, unique id prefix, or registered absolute path (the path as
        registered, or one naming the same file or directory through other symlinks)."""
        with self._lock:
            if ref.startswith("/"):
                for ckpt in self._by_id.values():
                    if str(ckpt.path) == os.path.abspath(ref):
                        return ckpt
                real = os.path.realpath(ref)
                for ckpt in self._by_id.values():
                    if os.path.realpath(ckpt.path) == real:
                        return ckpt
                raise CheckpointNotFound(f"no checkpoint registered at {ref[:300]} (see `hwrctl checkpoints`)",
                                         details={"path": ref[:300]})
            if "/" in ref:
                # A relative path means nothing to the daemon (its working directory is not the caller's).
                raise InvalidRequest(f"a registered path must be absolute here, got {ref[:300]!r}",
                                     details={"checkpoint": ref[:300]})
            return self._by_id[resolve_checkpoint_prefix(ref, list(self._by_id))]

    def list(self) -> list[Checkpoint]:
        with self._lock:
            return sorted(self._by_id.values(), key=lambda c: c.registered_at)

    def check(self, ckpt: Checkpoint) -> Checkpoint:
        """Raise ``CheckpointModified`` (and mark it) if any file changed since registration."""
        if not ckpt.modified:
            try:
                for cfile, fd in zip(ckpt.files, ckpt._fds, strict=True):
                    _check_unchanged(fd, cfile.path, cfile.fingerprint, cfile.name)
            except CheckpointModified:
                ckpt.modified = True
                raise
        if ckpt.modified:
            raise CheckpointModified("a file of this checkpoint changed after registration; re-register it",
                                     details={"checkpoint": ckpt.checkpoint_id})
        return ckpt

    def open_fds(self, ckpt: Checkpoint) -> list[int]:
        """Fresh read-only descriptors of every file, verified against the fingerprints (caller closes)."""
        self.check(ckpt)
        fds: list[int] = []
        try:
            for cfile in ckpt.files:
                fd = os.open(cfile.path, _OPEN)
                fds.append(fd)
                if FileFingerprint.of(os.fstat(fd)) != cfile.fingerprint:
                    ckpt.modified = True
                    raise CheckpointModified(f"{cfile.name} changed after registration",
                                             details={"checkpoint": ckpt.checkpoint_id, "file": cfile.name})
        except BaseException as exc:
            for fd in fds:
                os.close(fd)
            if isinstance(exc, OSError) and not isinstance(exc, HwrError):
                ckpt.modified = True
                raise CheckpointModified(f"cannot reopen a checkpoint file: {exc.strerror}",
                                         details={"checkpoint": ckpt.checkpoint_id}) from None
            raise
        return fds

    # --------------------------------------------------------------- persistence
    def _save_digests(self) -> None:
        write_json(self.state_dir / "digests.json", self._digests)

    def _save_registry(self) -> None:
        """One entry per path: the path alone when the daemon registered it, else with the
        registrant's uid, gid and groups (a restart re-opens the files with those rights)."""
        entries: dict[str, object] = {}
        for c in self._by_id.values():
            cred = c.registrant
            entries[str(c.path)] = str(c.path) if cred is None else {
                "path": str(c.path), "uid": cred.uid, "gid": cred.gid, "groups": list(cred.groups)}
        write_json(self.state_dir / "registry.json", [entries[p] for p in sorted(entries)])


# ------------------------------------------------------------------- helpers
def _open_own(path: Path) -> int | OSError:
    try:
        return os.open(path, _OPEN)
    except OSError as exc:
        return exc


def _check_unchanged(fd: int, path: Path, expected: FileFingerprint, name: str) -> None:
    try:
        now_fd = FileFingerprint.of(os.fstat(fd))
        now_path = FileFingerprint.of(os.lstat(path))
    except OSError as exc:
        raise CheckpointModified(f"{name} disappeared: {exc.strerror}", details={"file": name}) from None
    if now_fd != expected or now_path != expected:
        raise CheckpointModified(f"{name} changed (size, inode, mtime or ctime)", details={"file": name})


def _index(files: Sequence[CheckpointFile]) -> dict[str, tuple[int, TensorEntry]]:
    tensors: dict[str, tuple[int, TensorEntry]] = {}
    for index, cfile in enumerate(files):
        for entry in cfile.header.entries:
            if entry.name in tensors:
                raise InvalidRequest(f"tensor {entry.name!r} appears in two files",
                                     details={"tensor": entry.name[:200], "file": cfile.name})
            tensors[entry.name] = (index, entry)
    if not tensors:
        raise InvalidRequest("the checkpoint holds no tensors")
    return tensors
