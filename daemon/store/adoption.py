"""Adoption of a store root written by vLLM-Omni 0.30's in-process host weight store.

The on-disk format is the same byte for byte (``domain.json``; ``artifacts/<key>/`` with
``READY.json``, ``manifest.json`` and safetensors payloads, directory 0555, files 0444;
``deny/<key>.json`` markers with ``schema_version, stage, reason, message``; ``tmp/``,
``quarantine/``, ``locks/``), so hwrd can serve such a root under the same keys. Adoption is
chosen with ``adopt = true`` in the config (also ``HWR_ADOPT=1`` or ``hwrd --adopt true``) and
runs at start, in two steps around ``Store.open``:

``prepare(root)`` (before the store takes the root):
  - refuses the whole root (``StoreLocked``) while a vLLM-Omni process is *building* in it (one
    of its ``locks/<key>.build.lock`` flocks is held): two writers must never share a root;
  - moves aside artifacts that upstream marked invalid (the sticky bit upstream sets on a
    directory it is invalidating or moving) to ``quarantine/<key>.upstream-invalidated.<uuid>``;
  - notes artifacts that a vLLM-Omni process still leases (its shared ``<key>.artifact.lock``
    is held): they are adopted, and the eviction's mappings scan protects them;
  - reports unfinished publications left in ``tmp/`` as rejected (the store's open removes them).
``finish(store, prepared)`` (after the open validated metadata and recovered staging):
  - re-hashes every byte of each artifact not adopted before (``Store.verify``): a mismatch is
    quarantined and denied like any corruption;
  - writes ``<root>/adoption.json`` (per artifact: ``adopted`` or ``rejected`` with the reason;
    artifacts recorded as adopted are not re-hashed at later starts) and logs one line per key.

Limits: upstream's ``domain-policy.json`` and lock files are left in place (unused by hwrd);
adoption needs the daemon to run as the uid that owns the files (both stores require it).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import stat
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hwr.client.errors import ArtifactNotFound, HwrError, ManifestIncompatible, StoreLocked
from hwr.client.identity import canonical_json, is_key
from hwr.daemon.store import fileio as store_io

if TYPE_CHECKING:
    from hwr.daemon.store.root import Store

__all__ = ["REPORT_FILE", "finish", "prepare"]

log = logging.getLogger("hwrd.adoption")
REPORT_FILE = "adoption.json"


def _lock_held(path: Path) -> bool:
    """True when another open file description holds a flock on ``path``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        return exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN)
    finally:
        os.close(fd)
    return False


def prepare(root: Path) -> list[dict[str, Any]]:
    """Check and normalise an upstream root before the store opens it (see the module docstring)."""
    root = Path(root)
    if not root.is_dir():
        raise ArtifactNotFound(f"no store root to adopt at {root}", details={"root": str(root)})
    try:
        domain = json.loads((root / "domain.json").read_bytes())
    except FileNotFoundError:
        domain = None  # a root that never opened: nothing upstream-specific to check
    except ValueError:
        raise ManifestIncompatible(f"{root}/domain.json is not JSON; cannot adopt") from None
    if domain is not None and (not isinstance(domain, dict) or domain.get("schema_version") != 1):
        raise ManifestIncompatible(f"{root}/domain.json has an unsupported schema; cannot adopt")
    locks = root / "locks"
    if locks.is_dir():
        building = sorted(p.name.split(".")[0] for p in locks.glob("*.build.lock") if _lock_held(p))
        if building:
            raise StoreLocked(f"a vLLM-Omni process is building in {root} (keys {building[:3]}); stop it first",
                              details={"root": str(root), "building": ",".join(building[:20])})
    report: list[dict[str, Any]] = []
    artifacts = root / "artifacts"
    for entry in sorted(os.listdir(artifacts)) if artifacts.is_dir() else []:
        path = artifacts / entry
        item: dict[str, Any] = {"key": entry, "status": "pending", "reason": ""}
        report.append(item)
        if not is_key(entry):
            item.update(status="rejected", reason="directory name is not a 64-hex key (moved to quarantine)")
            continue
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode):
            item.update(status="rejected", reason="not a directory (moved to quarantine)")
            continue
        if st.st_mode & stat.S_ISVTX:
            target = root / "quarantine" / f"{entry}.upstream-invalidated.{uuid.uuid4().hex}"
            (root / "quarantine").mkdir(mode=0o700, exist_ok=True)
            os.chmod(path, stat.S_IMODE(st.st_mode) | stat.S_IWUSR)  # rename needs a writable dir
            os.rename(path, target)
            store_io.fsync_dir(artifacts)
            item.update(status="rejected", reason="vLLM-Omni marked it invalid (sticky bit: being invalidated or "
                                                  "moved); moved to quarantine")
            continue
        if _lock_held(locks / f"{entry}.artifact.lock"):
            item["note"] = "leased by a running vLLM-Omni process (protected by the mappings scan)"
    # Unfinished publications (upstream stages in tmp/<key>.<pid>.<uuid>/): never adoptable, and
    # the store's open removes them; report them so an operator sees why a key is missing.
    staging = root / "tmp"
    for entry in sorted(os.listdir(staging)) if staging.is_dir() else []:
        key = entry.split(".", 1)[0]
        report.append({"key": key if is_key(key) else entry[:80], "status": "rejected",
                       "reason": f"unfinished publication in tmp/{entry[:120]} (never committed: no READY "
                                 "marker in artifacts/); removed"})
    return report


def _previous(root: Path) -> set[str]:
    with contextlib.suppress(OSError, ValueError, AttributeError, TypeError):
        document = json.loads((root / REPORT_FILE).read_bytes())
        return {a["key"] for a in document.get("artifacts", []) if a.get("status") == "adopted"}
    return set()


def finish(store: Store, report: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Verify every pending artifact in the opened store and write ``adoption.json``."""
    root = Path(store.root)
    done_before = _previous(root)
    for item in report:
        if item["status"] != "pending":
            continue
        key = item["key"]
        reason = store.denylist.reason(key)
        if reason is not None:
            item.update(status="rejected", reason=f"denied ({reason}): see deny/{key}.json")
            continue
        try:
            if key in done_before:
                store.records.lookup(key)
            else:
                store.verify(key)
        except HwrError as exc:
            item.update(status="rejected", reason=f"{exc.code}: {exc.message}")
            continue
        item.update(status="adopted", reason="validated" if key in done_before else "validated and re-hashed")
    for item in report:
        log.warning("adoption: %s %s %s", item["key"][:16], item["status"], item["reason"]) if item[
            "status"] != "adopted" else log.info("adoption: %s adopted", item["key"][:16])
    document = {"schema_version": 1, "artifacts": report}
    tmp = root / f".{REPORT_FILE}.{uuid.uuid4().hex}.tmp"
    store_io.write_new_file(tmp, canonical_json(document), mode=0o600)
    store_io.rename(tmp, root / REPORT_FILE)
    return report
