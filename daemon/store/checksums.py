"""Checksums: every byte of an artifact re-hashed and judged against its manifest (``verify``).

``verify`` is the full check (``hwrctl verify``, the background scrub, adoption): it opens the
payloads as a lookup would (their ``fstat`` re-check included), hashes every file and tensor
range, and on a mismatch denies the key and moves its directory to ``quarantine/`` under the
key's lock, raising ``ChecksumMismatch``. ``corrupt_parts`` is the verdict, over the hashes.

Contract: a key an operator denied is verified too (its bytes are judged, the deny stays); a key
denied because it was found corrupt raises ``ArtifactDenied`` (``RecordCache.lookup``).

Limits: reads every byte (the caller paces it: ``progress`` is called with bytes done and total);
a write that lands after its range was hashed is found at the next lookup or verification.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence

from hwr.client.errors import ChecksumMismatch
from hwr.client.safetensors_header import read_header
from hwr.daemon.store import fileio as store_io
from hwr.daemon.store.denylist import OPERATOR_DENIED, DenyList
from hwr.daemon.store.inspection import ArtifactRecord
from hwr.daemon.store.keylocks import KeyLocks
from hwr.daemon.store.records import RecordCache

__all__ = ["corrupt_parts", "verify"]


def corrupt_parts(record: ArtifactRecord, file_sha: Sequence[str], tensor_sha: Mapping[str, str]) -> list[str]:
    """Names of the files, then tensors, of ``record`` whose hashes differ from its manifest."""
    bad = [f.name for f, h in zip(record.manifest.files, file_sha, strict=True) if f.sha256 != h]
    bad += [t.name for t in record.manifest.tensors if tensor_sha[t.name] != t.sha256]
    return bad


def _hash(
    record: ArtifactRecord, fds: Sequence[tuple[str, int]], progress: Callable[[int, int], None] | None
) -> tuple[list[str], dict[str, str]]:
    jobs = []
    for (_, fd), file_record in zip(fds, record.manifest.files, strict=True):
        header = read_header(fd)
        ranges = [
            (
                t.name,
                header.data_offset + header.entry(t.storage_key).begin,
                header.data_offset + header.entry(t.storage_key).end,
            )
            for t in record.manifest.tensors_in(file_record.name)
        ]
        jobs.append((fd, file_record.size, ranges))
    return store_io.hash_ranges(jobs, progress)


def verify(
    key: str,
    *,
    records: RecordCache,
    denied: DenyList,
    keys: KeyLocks,
    progress: Callable[[int, int], None] | None = None,
) -> ArtifactRecord:
    """Re-hash every byte of ``key`` (a valid key); returns its record when every hash holds."""
    record = records.inspect_denied(key) if denied.reason(key) == OPERATOR_DENIED else None
    if record is None:
        record = records.lookup(key)
    fds = records.open_payloads(record)
    try:
        file_sha, tensor_sha = _hash(record, fds, progress)
    finally:
        for _, fd in fds:
            os.close(fd)
    bad = corrupt_parts(record, file_sha, tensor_sha)
    if bad:
        exc = ChecksumMismatch(f"artifact {key} has corrupt bytes", details={"key": key, "corrupt": ",".join(bad[:20])})
        with keys.hold(key):
            records.deny_for(key, exc)
            denied.quarantine(record.path, "checksum", key)
        raise exc
    return record
