"""Recovery: what a store root's previous owner left half done, found and finished or reclaimed.

At open, before anyone else uses the store (``Store.open``): per-key lock files of earlier
versions are deleted (``remove_legacy_key_locks``), every ``tmp/`` entry is wiped (stagings and
trash of the previous run: ``wipe_tmp``), an artifact renamed in but not yet made 0555 is
finished (``finish_interrupted_publication``), a name in ``artifacts/`` that is not a key is
quarantined and every other entry validated at metadata level (``validate_at_open``). While the
store runs, ``reclaim_trash`` removes trash no retirement will delete any more.

The decisions are pure functions over names (``is_legacy_key_lock``, ``stale_trash``); the
functions around them do the I/O.

Limits: only this process may have made an interrupted publication (one owner per root, held by
``locks/daemon.lock``), which is why finishing one is safe; validation at open is the metadata
level (``inspection.inspect_artifact``), never a re-hash.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from pathlib import Path

from hwr.client.errors import HwrError, ManifestCorrupt, ManifestIncompatible, StoreIOError
from hwr.client.identity import is_key
from hwr.client.manifest import READY_FILE
from hwr.daemon.store import fileio as store_io
from hwr.daemon.store.denylist import DenyList
from hwr.daemon.store.inspection import inspect_artifact
from hwr.daemon.store.records import RecordCache
from hwr.daemon.store.retirement import TRASH_INFIX
from hwr.daemon.store.writer_bounds import truncate_tree

__all__ = [
    "finish_interrupted_publication",
    "is_legacy_key_lock",
    "reclaim_trash",
    "remove_legacy_key_locks",
    "stale_trash",
    "validate_at_open",
    "wipe_tmp",
]


def is_legacy_key_lock(name: str) -> bool:
    """A ``locks/<key>.artifact`` file of an earlier version (which flocked one per key)."""
    return name.endswith(".artifact") and is_key(name.removesuffix(".artifact"))


def stale_trash(entries: Iterable[str], open_stagings: set[str]) -> list[str]:
    """The ``tmp/`` entries that are trash of interrupted removals: retirement names that belong
    to no open staging."""
    return [e for e in entries if e not in open_stagings and TRASH_INFIX in e]


def remove_legacy_key_locks(locks: Path) -> None:
    for entry in os.listdir(locks):
        if is_legacy_key_lock(entry):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(locks / entry)


def wipe_tmp(tmp: Path) -> None:
    """Remove every entry of ``tmp/``; the files are truncated first, so their blocks are freed
    even if a writer of the previous run still holds one."""
    for entry in os.listdir(tmp):
        truncate_tree(tmp / entry)
        store_io.remove_tree(tmp / entry)


def reclaim_trash(tmp: Path, open_stagings: set[str]) -> int:
    """Remove the ``stale_trash`` of ``tmp/``; returns how many entries went."""
    stale = stale_trash(os.listdir(tmp), open_stagings)
    for entry in stale:
        store_io.remove_tree(tmp / entry)
    return len(stale)


def finish_interrupted_publication(path: Path) -> None:
    """Make an artifact 0555 when a crash came between its rename and its chmod (a complete
    artifact still at the staging directory mode, with its ``READY.json``)."""
    with contextlib.suppress(OSError):
        st = os.lstat(path)
        if (st.st_mode & 0o777) == 0o700 and os.path.isfile(path / READY_FILE):
            os.chmod(path, 0o555)
            store_io.fsync_dir(path.parent)


def validate_at_open(artifacts: Path, euid: int, denied: DenyList, records: RecordCache) -> list[tuple[str, HwrError]]:
    """Validate every ``artifacts/`` entry into ``records`` (denied keys are skipped): a corrupt
    or incompatible one is denied, a stray name quarantined. Returns the keys that failed with
    their errors (a corrupt artifact is never fatal to the open)."""
    report: list[tuple[str, HwrError]] = []
    for entry in sorted(os.listdir(artifacts)):
        path = artifacts / entry
        if not is_key(entry):
            denied.quarantine(path, "stray", entry[:64] or "unnamed")
            continue
        finish_interrupted_publication(path)
        if entry in denied:
            continue
        try:
            records.put(entry, inspect_artifact(path, entry, euid))
        except (ManifestCorrupt, ManifestIncompatible) as exc:
            records.deny_for(entry, exc)
            report.append((entry, exc))
        except StoreIOError as exc:
            report.append((entry, exc))
    return report
