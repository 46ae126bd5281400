"""Pure pieces of the checkpoint registry (``hwr.daemon.checkpoints.registry``): file fingerprints, the
HF snapshot topology, checkpoint ids, the directory walk and the registry's JSON files.

Nothing here opens a checkpoint file: the walk lists names (``lstat``/``listdir`` as the
daemon), ``hf_blob_link`` and ``plain_path`` judge a snapshot link's shape, and the JSON helpers
read and write the daemon's own state directory.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import stat
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from hwr.client.errors import CheckpointNotFound, InvalidRequest, StoreIOError
from hwr.client.identity import canonical_json
from hwr.daemon.policy.key_prefix import unique_prefix
from hwr.daemon.store import fileio as store_io
from hwr.daemon.system.peercred import PeerCred

__all__ = [
    "MAX_DEPTH", "MAX_WALK_ENTRIES", "FileFingerprint", "HfBlobLink", "checkpoint_id_for", "hf_blob_link", "load_json",
    "plain_path", "registry_entry", "resolve_checkpoint_prefix", "safetensors_files", "write_json",
]

log = logging.getLogger("hwrd.checkpoints")
MAX_DEPTH = 3
#: Directory entries the walk of one checkpoint directory may visit. A real checkpoint (a diffusers
#: folder, an HF snapshot) holds hundreds; ``/`` or a home directory holds millions, and walking
#: them (``/proc`` and ``/sys`` included) would hold an operator's request for minutes.
MAX_WALK_ENTRIES = 20_000
_REV = re.compile(r"[0-9a-f]{40}")
_BLOB = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")


@dataclass(frozen=True)
class FileFingerprint:
    size: int
    device: int
    inode: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileFingerprint:
        return cls(st.st_size, st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns)

    def cache_key(self) -> str:
        return f"{self.device}:{self.inode}:{self.size}:{self.mtime_ns}:{self.ctime_ns}"


@dataclass(frozen=True)
class HfBlobLink:
    model_id: str
    revision: str
    blob_hash: str
    blob_path: Path


def hf_blob_link(file_path: Path, link_target: str | None) -> HfBlobLink | None:
    """Pure: the HF blob a snapshot link points at, or None unless the topology is exact.

    ``file_path`` is the absolute, unresolved path of the snapshot entry; ``link_target`` its
    ``readlink`` (None when it is not a symlink).
    """
    if link_target is None:
        return None
    parts = file_path.parts
    for i in range(len(parts) - 3, 0, -1):
        if parts[i] == "snapshots" and parts[i - 1].startswith("models--"):
            repo, rev, rel = parts[i - 1], parts[i + 1], parts[i + 2:]
            break
    else:
        return None
    pieces = repo.removeprefix("models--").split("--")
    if not _REV.fullmatch(rev) or not rel or len(pieces) < 1 or not all(pieces):
        return None
    ups = len(rel) + 1
    prefix = "../" * ups + "blobs/"
    if not link_target.startswith(prefix) or not _BLOB.fullmatch(link_target[len(prefix):]):
        return None
    blob_hash = link_target[len(prefix):]
    repo_dir = Path(*parts[:i])
    return HfBlobLink("/".join(pieces), rev, blob_hash, repo_dir / "blobs" / blob_hash)


def checkpoint_id_for(sources: Sequence[tuple[str, str]]) -> str:
    """Pure: the checkpoint id of ``[(relative name, source identity)]`` (order independent)."""
    return hashlib.sha256(canonical_json([list(p) for p in sorted(sources)])).hexdigest()


def resolve_checkpoint_prefix(prefix: str, ids: Sequence[str]) -> str:
    """Pure: the one id starting with ``prefix`` (4 to 64 lowercase hex digits)."""
    return unique_prefix(
        prefix, ids, field="checkpoint", ambiguous="ambiguous checkpoint id prefix",
        malformed=f"{prefix[:80]!r} is not a checkpoint id or id prefix (4 to 64 lowercase hex digits) "
                  "nor an absolute registered path",
        missing=lambda p: CheckpointNotFound("no registered checkpoint matches", details={"checkpoint": p}))


def safetensors_files(root: Path) -> Iterator[str]:
    """Names of ``*.safetensors`` files under ``root`` (relative, at most ``MAX_DEPTH`` levels, hidden
    entries skipped). Raises ``InvalidRequest`` once the walk has seen ``MAX_WALK_ENTRIES`` entries:
    such a directory is not a checkpoint directory, and the caller learns it at once."""
    seen = 0
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        seen += len(dirnames) + len(filenames)
        if seen > MAX_WALK_ENTRIES:
            raise InvalidRequest(f"{root} holds more than {MAX_WALK_ENTRIES} entries within {MAX_DEPTH} levels: "
                                 "pass the checkpoint's own directory",
                                 details={"path": str(root), "limit": MAX_WALK_ENTRIES})
        depth = len(Path(dirpath).relative_to(root).parts)
        if depth >= MAX_DEPTH:
            dirnames.clear()
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for fname in filenames:
            if fname.endswith(".safetensors") and not fname.startswith("."):
                yield str((Path(dirpath) / fname).relative_to(root))


def registry_entry(entry: object) -> tuple[str | None, PeerCred | None]:
    """A ``registry.json`` entry: a path (the daemon's rights) or ``{path, uid, gid, groups}``."""
    if isinstance(entry, str):
        return entry, None
    if isinstance(entry, dict):
        path, uid, gid, groups = (entry.get(k) for k in ("path", "uid", "gid", "groups"))
        if (isinstance(path, str) and isinstance(uid, int) and isinstance(gid, int) and isinstance(groups, list)
                and all(isinstance(g, int) for g in groups)):
            return path, PeerCred(0, uid, gid, tuple(groups))
    return None, None


def plain_path(path: Path) -> bool:
    """True when every component of ``path`` below ``/`` is not a symlink and the leaf is a regular file."""
    try:
        for parent in reversed(path.parents[:-1]):
            if stat.S_ISLNK(os.lstat(parent).st_mode):
                return False
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def load_json(path: Path, kind: type) -> object:
    try:
        raw = store_io.read_state_file(path, 256 << 20)  # hwrd's own: never a symlink, FIFO or huge file
        if raw is None:
            return kind()
        value = store_io.parse_json(raw)
    except (OSError, ValueError) as exc:
        log.warning("ignoring unreadable %s: %s", path, exc)
        return kind()
    return value if isinstance(value, kind) else kind()


def write_json(path: Path, value: object) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        store_io.write_new_file(tmp, json.dumps(value, sort_keys=True).encode(), mode=0o600)
        store_io.rename(tmp, path)
        store_io.fsync_dir(path.parent)
    except OSError as exc:
        store_io.remove_tree(tmp)
        raise StoreIOError(f"cannot persist {path.name}: {exc.strerror}") from None
