"""Small persistent documents of a store root: ``domain.json`` and deny-marker codes.

``domain.json`` has vLLM-Omni's fields (``schema_version, domain_uuid, scope, domain_id,
backend, storage_class, filesystem_type``) and is written once, atomically (temp file, rename,
directory fsync). Contract: an existing one is kept as is if it is a schema-1 object; otherwise
``ManifestCorrupt``/``ManifestIncompatible``. Limits: its other fields are informational, not
enforced (the filesystem type is re-checked from statfs at every open).
"""

from __future__ import annotations

import os
import socket
import uuid
from pathlib import Path

from hwr.client.errors import ManifestCorrupt, ManifestIncompatible
from hwr.client.identity import canonical_json
from hwr.daemon.store import fileio as store_io

__all__ = ["ensure_domain", "read_deny_code"]


def ensure_domain(root: Path, filesystem_type: str) -> dict[str, object]:
    """Return the root's domain document, creating it on first use."""
    path = root / "domain.json"
    if os.path.lexists(path):
        try:
            raw = store_io.read_state_file(path, 1 << 20)
            document = store_io.parse_json(raw if raw is not None else b"")
        except OSError as exc:  # a symlink, FIFO or other non-regular file: never read
            raise ManifestCorrupt(f"domain.json is unreadable: {exc.strerror}", details={"root": str(root)}) from None
        except ValueError:
            raise ManifestCorrupt("domain.json is not JSON", details={"root": str(root)}) from None
        if not isinstance(document, dict) or document.get("schema_version") != 1:
            raise ManifestIncompatible("domain.json has an unsupported schema", details={"root": str(root)})
        return document
    document = {
        "schema_version": 1,
        "domain_uuid": uuid.uuid4().hex,
        "scope": "node",
        "domain_id": socket.gethostname(),
        "backend": "local_filesystem",
        "storage_class": "tmpfs" if filesystem_type in ("tmpfs", "ramfs") else "disk",
        "filesystem_type": filesystem_type,
    }
    staging = root / f"domain.json.{uuid.uuid4().hex}.tmp"
    store_io.write_new_file(staging, canonical_json(document))
    store_io.rename(staging, path)
    store_io.fsync_dir(root)
    return document


def read_deny_code(path: Path, default: str) -> str:
    """The ``reason`` code of a deny marker; an unreadable marker counts as ``default`` (still denied)."""
    try:
        document = store_io.parse_json(store_io.read_state_file(path, 1 << 20) or b"")
        code = document.get("reason") if isinstance(document, dict) else None
    except (OSError, ValueError):
        code = None
    return code if isinstance(code, str) else default
