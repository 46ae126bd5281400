"""Metadata inspection of a committed artifact directory (no payload byte read), and its fingerprint.

``inspect_artifact(path, key, euid)`` reads ``READY.json``, ``manifest.json`` and each payload's
safetensors header through ``O_NOFOLLOW`` descriptors and checks: exact file set; regular files
(never symlinks) with one link, mode 0444, owned by ``euid``; directory mode 0555; canonical
marker and manifest bound by hash; key = directory name = identity hash; sizes; headers exactly
as the manifest says; and no payload modified after its commit marker (mtime). It returns an
``ArtifactRecord`` whose ``fingerprints`` (inode, size, mtime, ctime, mode, nlink of the
directory and every file) make later checks a handful of ``lstat`` calls.

Errors: structural problems raise ``ManifestCorrupt`` / ``ManifestIncompatible`` (the caller
denies the key); other ``OSError`` become ``StoreIOError`` (retryable, no deny). Limits: no
payload byte is hashed here (``verify`` does that); a change that preserves size, mtime and ctime
cannot be seen at this level.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from hwr.client.artifact import validate_payload_header
from hwr.client.errors import ManifestCorrupt, StoreIOError
from hwr.client.manifest import MANIFEST_FILE, MAX_METADATA_BYTES, READY_FILE, Manifest, ReadyMarker
from hwr.client.safetensors_header import read_header
from hwr.daemon.store import fileio as store_io

__all__ = ["ArtifactRecord", "Fingerprint", "fingerprint", "inspect_artifact", "same_fingerprints"]

FILE_MODE = 0o444
DIR_MODE = 0o555
_STRUCTURE_ERRNOS = frozenset({errno.ELOOP, errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.ENXIO})


@dataclass(frozen=True)
class Fingerprint:
    """What must not change about one committed path (``lstat`` fields; atime excluded)."""

    path: str
    inode: int
    device: int
    size: int
    mtime_ns: int
    ctime_ns: int
    mode: int
    nlink: int
    uid: int


def fingerprint(path: str, st: os.stat_result) -> Fingerprint:
    return Fingerprint(
        path,
        st.st_ino,
        st.st_dev,
        st.st_size,
        st.st_mtime_ns,
        st.st_ctime_ns,
        st.st_mode,
        st.st_nlink,
        st.st_uid,
    )


@dataclass(frozen=True)
class ArtifactRecord:
    """A committed artifact as validated; ``files`` are the payload fingerprints in manifest order."""

    key: str
    identity_bytes: bytes
    manifest: Manifest
    marker: ReadyMarker
    path: Path
    size_bytes: int
    created_at: float
    files: tuple[Fingerprint, ...]
    fingerprints: tuple[Fingerprint, ...]

    @functools.cached_property
    def guard_fingerprints(self) -> tuple[Fingerprint, ...]:
        """``fingerprints`` minus the payload files: the directory, ``READY.json`` and
        ``manifest.json`` (the cheap guard of ``RecordCache.cached``; computed once per record)."""
        payloads = set(self.files)
        return tuple(fp for fp in self.fingerprints if fp not in payloads)


def same_fingerprints(expected: tuple[Fingerprint, ...]) -> bool:
    """True when every path still ``lstat``s to its recorded fingerprint (the warm lookup check)."""
    try:
        for fp in expected:
            if fingerprint(fp.path, os.lstat(fp.path)) != fp:
                return False
    except OSError:
        return False
    return True


def _corrupt(message: str, key: str, check: str) -> ManifestCorrupt:
    return ManifestCorrupt(message, details={"key": key, "check": check})


def _open_checked(path: Path, key: str, euid: int) -> tuple[int, os.stat_result]:
    try:
        fd = os.open(path, store_io.OPEN_READ)
    except OSError as exc:
        if exc.errno in _STRUCTURE_ERRNOS:
            raise _corrupt(f"{path.name} is missing or a symlink", key, "file") from None
        raise
    st = os.fstat(fd)
    problem = None
    if not stat.S_ISREG(st.st_mode):
        problem = "is not a regular file"
    elif st.st_nlink != 1:
        problem = f"has {st.st_nlink} links"
    elif stat.S_IMODE(st.st_mode) != FILE_MODE:
        problem = f"has mode {stat.S_IMODE(st.st_mode):04o}"
    elif st.st_uid != euid:
        problem = f"is owned by uid {st.st_uid}"
    if problem:
        os.close(fd)
        raise _corrupt(f"{path.name} {problem}", key, "file")
    return fd, st


def _read_document(path: Path, key: str, euid: int) -> tuple[bytes, os.stat_result]:
    fd, st = _open_checked(path, key, euid)
    try:
        data = store_io.read_small(fd, MAX_METADATA_BYTES)
    finally:
        os.close(fd)
    if len(data) != st.st_size or len(data) > MAX_METADATA_BYTES:
        raise _corrupt(f"{path.name} changed size while read or is too large", key, "size")
    return data, st


def record_for_commit(path: Path, key: str, manifest: Manifest, marker: ReadyMarker) -> ArtifactRecord:
    """The record of an artifact this daemon has just committed at ``path`` from ``manifest``
    and ``marker`` (no re-read: ``lstat`` fingerprints only). Only for the store's own commit,
    where the bytes were sealed in a private staging directory whose writer was proven gone;
    anything found on disk goes through ``inspect_artifact``."""
    payloads = [fingerprint(str(path / f.name), os.lstat(path / f.name)) for f in manifest.files]
    return _record(path, key, manifest, marker, os.lstat(path), os.lstat(path / READY_FILE),
                   os.lstat(path / MANIFEST_FILE), payloads)


def _record(path: Path, key: str, manifest: Manifest, marker: ReadyMarker, dir_st: os.stat_result,
            marker_st: os.stat_result, manifest_st: os.stat_result, payloads: list[Fingerprint]) -> ArtifactRecord:
    """The record of a validated artifact from its documents and the stats taken while checking."""
    documents = (
        fingerprint(str(path / READY_FILE), marker_st),
        fingerprint(str(path / MANIFEST_FILE), manifest_st),
    )
    return ArtifactRecord(
        key=key,
        identity_bytes=manifest.identity_bytes,
        manifest=manifest,
        marker=marker,
        path=path,
        size_bytes=sum(f.size for f in manifest.files),
        created_at=marker_st.st_mtime,
        files=tuple(payloads),
        fingerprints=(fingerprint(str(path), dir_st), *documents, *payloads),
    )


def inspect_artifact(path: Path, key: str, euid: int) -> ArtifactRecord:
    """Validate ``path`` (``artifacts/<key>``) at metadata level; see the module docstring."""
    try:
        return _inspect(path, key, euid)
    except ManifestCorrupt as exc:
        exc.details.setdefault("key", key)
        raise
    except OSError as exc:
        raise StoreIOError(f"cannot read artifact {key}: {exc.strerror}", details={"key": key}) from None


def _inspect(path: Path, key: str, euid: int) -> ArtifactRecord:
    dir_st = os.lstat(path)
    if not stat.S_ISDIR(dir_st.st_mode) or dir_st.st_uid != euid:
        raise _corrupt("artifact is not a directory owned by the store", key, "directory")
    if stat.S_IMODE(dir_st.st_mode) != DIR_MODE:
        raise _corrupt(f"artifact directory has mode {stat.S_IMODE(dir_st.st_mode):04o}", key, "mode")
    marker_bytes, marker_st = _read_document(path / READY_FILE, key, euid)
    marker = ReadyMarker.from_json(marker_bytes)
    manifest_bytes, manifest_st = _read_document(path / MANIFEST_FILE, key, euid)
    if hashlib.sha256(manifest_bytes).hexdigest() != marker.manifest_sha256:
        raise _corrupt("manifest.json does not match READY.json", key, "marker")
    manifest = Manifest.from_json(manifest_bytes)
    if manifest.key != key or marker.artifact_content_sha256 != manifest.artifact_content_sha256:
        raise _corrupt("manifest does not belong to this key or marker", key, "identity")
    expected = {READY_FILE, MANIFEST_FILE, *(f.name for f in manifest.files)}
    present = set(os.listdir(path))
    if present != expected:
        raise ManifestCorrupt(
            "artifact file set differs from the manifest",
            details={
                "key": key,
                "check": "file_set",
                "extra": ",".join(sorted(present - expected)),
                "missing": ",".join(sorted(expected - present)),
            },
        )
    payloads: list[Fingerprint] = []
    for record in manifest.files:
        file_path = path / record.name
        fd, st = _open_checked(file_path, key, euid)
        try:
            if st.st_size != record.size:
                raise _corrupt(f"{record.name} is {st.st_size} bytes, manifest says {record.size}", key, "size")
            if st.st_mtime_ns > marker_st.st_mtime_ns:
                raise _corrupt(f"{record.name} was modified after its commit marker", key, "mtime")
            validate_payload_header(read_header(fd), manifest, record)
        finally:
            os.close(fd)
        payloads.append(fingerprint(str(file_path), st))
    return _record(path, key, manifest, marker, dir_st, marker_st, manifest_st, payloads)
