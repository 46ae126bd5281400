"""Sealing a staging: the part of a commit that makes its bytes final, before any rename.

``seal`` re-reads the payload headers and checks each file's allocation, hashes every file and
tensor (or takes the digests a daemon-owned writer computed while writing, ``ProducerDigests``:
a prewarm producer, a pull from the remote tier), compares the writer's
expected tensor hashes, writes ``manifest.json`` and ``READY.json``, makes the payloads 0444 and
fsyncs everything: every write before any fsync, then the staging directory itself. The step
names it reports (``hashed``, ``manifest_written``, ``marker_written``, ``payloads_fsynced``) are
``root.PUBLICATION_STEPS``'.

Contract: on return the staging directory is complete and durable (unless the publication is
non-durable), and nothing is visible in ``artifacts/`` yet (the install's rename follows).
Raises ``ManifestCorrupt`` (a header was overwritten, a file resized or given blocks past its
planned size, a payload changed while it was hashed), ``ChecksumMismatch`` (the expected
hashes differ), ``OSError``. Touches nothing outside the staging directory and holds no lock.

Limits: a writer that keeps an ``O_RDWR`` descriptor can still write after the hash; the mtime
check catches a write during hashing, a later one is caught at the next lookup (fingerprints)
or by ``verify``.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Mapping

from hwr.client.errors import ChecksumMismatch, ManifestCorrupt
from hwr.client.manifest import MANIFEST_FILE, READY_FILE, FileRecord, Manifest, ReadyMarker, TensorRecord
from hwr.client.safetensors_header import contiguous_stride
from hwr.daemon.store import fileio as store_io
from hwr.daemon.store.prehash import PreHashed
from hwr.daemon.store.staging import ProducerDigests, Staging
from hwr.daemon.store.writer_bounds import allocation_ok

__all__ = ["seal"]


def seal(
    staging: Staging,
    expected: Mapping[str, str] | None,
    trusted: ProducerDigests | None,
    opened: dict[str, int],
    step: Callable[[str], None],
    *,
    durable: bool = True,
    prehashed: Mapping[str, PreHashed] | None = None,
) -> tuple[Manifest, ReadyMarker]:
    """Validate, hash, document and fsync ``staging`` (see the module docstring).

    ``prehashed``: files already hashed after their writer handed them over (``prehash``), by
    name; their descriptor must be in ``opened``. Such a file is checked as any other and must
    still have the size and mtime it was hashed with; it is not hashed again.

    ``durable`` False: nothing is fsynced nor written back early (a non-durable publication:
    ``hwr.daemon.store.volatile``); every check and hash is the same.

    ``trusted``: digests a daemon-owned producer computed while writing, used when they cover the
    staging exactly. ``opened``: read-only descriptors of payload files by name; each one used
    is taken out of the dict and closed here, the rest stay the caller's. ``step``: called with
    each step name (the fault hook).
    """
    fds: list[int] = []
    documents: list[int] = []  # manifest.json, READY.json
    prehashed = prehashed or {}
    try:
        jobs = []
        before = []  # mtimes before hashing: a write since would change them
        for plan in staging.plans:
            fd = opened.pop(plan.name, None)  # taken: closed below
            if fd is None:
                fd = os.open(staging.path / plan.name, store_io.OPEN_READ)
            fds.append(fd)
            st = os.fstat(fd)
            before.append(st.st_mtime_ns)
            if not allocation_ok(st, plan.size):  # grown, or blocks allocated past the end
                raise ManifestCorrupt(
                    f"{plan.name} was resized or holds more blocks than its planned size",
                    details={
                        "file": plan.name,
                        "key": staging.key,
                        "size": st.st_size,
                        "allocated": st.st_blocks * 512,
                        "planned": plan.size,
                    },
                )
            if os.pread(fd, len(plan.head), 0) != plan.head:
                raise ManifestCorrupt(
                    f"{plan.name} was resized or its header overwritten",
                    details={"file": plan.name, "key": staging.key},
                )
            if durable:
                store_io.start_writeback(fd)  # the disk works while we hash; the fsync below waits
            done = prehashed.get(plan.name)
            if done is not None:
                if done.fd != fd or not done.unchanged(st):
                    raise ManifestCorrupt(f"{plan.name} changed after it was handed over and hashed",
                                          details={"file": plan.name, "key": staging.key})
                continue  # hashed already; the mtime check after hashing covers it too
            ranges = [(e.name, len(plan.head) + e.begin, len(plan.head) + e.end) for e in plan.entries]
            jobs.append((fd, plan.size, ranges))
        if trusted is not None and trusted.covers(staging):
            file_sha = [trusted.files[p.name] for p in staging.plans]
            tensor_sha = dict(trusted.tensors)
        else:
            hashed, tensor_sha = store_io.hash_ranges(jobs)
            if [os.fstat(fd).st_mtime_ns for fd in fds] != before:
                raise ManifestCorrupt("a payload changed while it was hashed", details={"key": staging.key})
            computed = iter(hashed)
            file_sha = [prehashed[p.name].file_sha256 if p.name in prehashed else next(computed)
                        for p in staging.plans]
            for done in prehashed.values():
                tensor_sha.update(done.tensor_sha256)
        step("hashed")
        if expected is not None:
            bad = sorted(n for n in tensor_sha if expected.get(n) != tensor_sha[n])
            if bad or set(expected) != set(tensor_sha):
                raise ChecksumMismatch(
                    "tensor bytes differ from the writer's hashes",
                    details={"key": staging.key, "tensors": ",".join(bad[:20])},
                )
        files = [FileRecord(name=p.name, size=p.size, sha256=h) for p, h in zip(staging.plans, file_sha, strict=True)]
        where = {e.name: p.name for p in staging.plans for e in p.entries}
        tensors = [
            TensorRecord(
                s.name,
                s.kind,
                s.role,
                file=where[s.name],
                storage_key=s.name,
                shape=tuple(s.shape),
                dtype=s.info.torch_name,
                stride=contiguous_stride(s.shape),
                nbytes=staging.placements[s.name][2],
                sha256=tensor_sha[s.name],
            )
            for s in staging.specs
        ]
        manifest = Manifest.build(staging.identity, tensors, files, dict(staging.format_metadata) or None)
        manifest_bytes = manifest.to_json()
        documents.append(store_io.create_file(staging.path / MANIFEST_FILE, manifest_bytes))
        step("manifest_written")
        marker = ReadyMarker.for_manifest(manifest_bytes, manifest, uuid.uuid4().hex)
        documents.append(store_io.create_file(staging.path / READY_FILE, marker.to_json()))
        step("marker_written")
        for fd in fds:
            os.fchmod(fd, 0o444)
        # Every write first, then every fsync: each file is still fsynced on its own (what
        # POSIX asks for), but on a journaling filesystem (ext4, xfs) the first fsync commits
        # the one transaction holding all of them and the others return without waiting for
        # another journal commit. Nothing is visible before the rename, which follows.
        if durable:
            for fd in fds:
                store_io.fsync(fd)
        step("payloads_fsynced")
        if durable:
            for fd in documents:
                store_io.fsync(fd)
    finally:
        for fd in fds + documents:
            os.close(fd)
    if durable:
        store_io.fsync_dir(staging.path)
    return manifest, marker
