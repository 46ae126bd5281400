"""Publication: staging directories in ``tmp/``, and their atomic commit into ``artifacts/``.

Order (``FAULT_HOOK`` step names of ``root.PUBLICATION_STEPS`` in brackets): ``begin`` plans and
preallocates the payloads in ``tmp/<key>.<pid>.<unique>/`` and writes their headers [staged]; the
writer fills them [payload_written]; ``commit`` seals the staging (``sealing.seal``: [hashed],
[manifest_written], [marker_written], [payloads_fsynced]), then installs it under the key's lock:
renames the directory into ``artifacts/`` [renamed], makes it 0555 and fsyncs ``artifacts/``
[dir_fsynced] (a group commit shared by concurrent commits and retirements:
``fileio.GroupSync``). A crash before the rename leaves only staging (wiped at the next start);
after it a complete artifact (a directory still at its staging mode is finished at start:
``recovery.finish_interrupted_publication``).

Non-durable commits (``durable=False``) skip every fsync and mark the key in ``volatile/``
before the rename, so the next start removes the artifact (``hwr.daemon.store.volatile``).

Install rules: an operator's deny refuses the commit (``ArtifactDenied``); a corruption deny is
replaced (the old directory quarantined, the deny cleared after the rename). A key already
present with the same content is joined (its record returned); with other content it stays and
the commit raises ``IdentityCollision``.

Limits: one process per root (the caller holds ``locks/daemon.lock``); stagings do not survive
a restart (their ids are known only in memory).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from hwr.client.errors import ArtifactDenied, HwrError, IdentityCollision, InvalidRequest
from hwr.client.identity import ArtifactIdentity
from hwr.client.manifest import Manifest, ReadyMarker
from hwr.daemon.store import fileio as store_io
from hwr.daemon.store.denylist import DenyList, publication_may_replace
from hwr.daemon.store.inspection import ArtifactRecord, record_for_commit
from hwr.daemon.store.keylocks import KeyLocks
from hwr.daemon.store.prehash import PreHashed
from hwr.daemon.store.records import RecordCache
from hwr.daemon.store.sealing import seal
from hwr.daemon.store.staging import PayloadPlan, ProducerDigests, StagedTensor, Staging, plan_payloads, write_tensor
from hwr.daemon.store.usage import UsageLedger
from hwr.daemon.store.volatile import VolatileSet
from hwr.daemon.store.writer_bounds import StagingReaper

if TYPE_CHECKING:
    import torch

__all__ = ["Installer"]


class Installer:
    """The open stagings of one store, and their commits.

    Lock order: ``_lock`` is a leaf (held only to add or take an open staging). An install holds
    the key's lock (``KeyLocks``) across the rename, the chmod and the group fsync, and under it
    may write or clear a deny marker (the deny list's lock) and take leaf locks; waiting there for
    a group fsync round is safe (its leader only fsyncs, it never waits for a lock meanwhile).
    """

    def __init__(
        self,
        root: Path,
        *,
        records: RecordCache,
        denied: DenyList,
        keys: KeyLocks,
        usage: UsageLedger,
        artifacts_sync: store_io.GroupSync,
        reaper: StagingReaper,
        volatile: VolatileSet,
        unique: Callable[[], str],
        require_open: Callable[[], None],
        step: Callable[[str], None],
    ) -> None:
        self._tmp = root / "tmp"
        self._artifacts = root / "artifacts"
        self._records = records
        self._denied = denied
        self._keys = keys
        self._usage = usage
        self._artifacts_sync = artifacts_sync
        self._reaper = reaper
        self._volatile = volatile
        self._unique = unique
        self._require_open = require_open
        self._step = step
        self._pid = os.getpid()  # in the staging name, as vLLM-Omni names them
        self._lock = threading.Lock()
        self._open: dict[str, Staging] = {}

    def open_ids(self) -> set[str]:
        """Ids (``tmp/`` entry names) of the stagings begun and not yet committed or aborted."""
        with self._lock:
            return set(self._open)

    def begin(
        self,
        identity: ArtifactIdentity,
        specs: Sequence[StagedTensor],
        *,
        max_file_bytes: int | None = None,
        format_metadata: Mapping[str, object] | None = None,
        plans: tuple[PayloadPlan, ...] | None = None,
    ) -> Staging:
        """Create a staging directory with preallocated payload files and their headers written.

        Raises ``InvalidRequest`` for bad specs, ``NoSpace`` (ENOSPC/EDQUOT; staging removed).
        """
        self._require_open()
        if not isinstance(identity, ArtifactIdentity):
            raise InvalidRequest("identity must be an ArtifactIdentity")
        if plans is None:  # else the caller's plan of these specs (``plan_payloads``: validated)
            plans = plan_payloads(list(specs), max_file_bytes)
        staging_id = f"{identity.key}.{self._pid}.{self._unique()}"
        path = self._tmp / staging_id
        staging = Staging.from_plans(staging_id, identity, path, specs, plans, format_metadata)
        try:
            path.mkdir(mode=0o700)
            for plan in plans:
                fd = os.open(path / plan.name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
                try:
                    store_io.fallocate(fd, plan.size)
                    store_io.pwrite_all(fd, plan.head, 0)
                finally:
                    os.close(fd)
        except OSError as exc:
            store_io.remove_tree(path)
            raise store_io.io_error(exc, "staging", publication=True) from None
        with self._lock:
            self._open[staging_id] = staging
        self._step("staged")
        return staging

    def abort(self, staging: Staging) -> None:
        """Discard a staging directory (idempotent): its files are truncated first, so their
        blocks are freed even while the writer keeps a descriptor (``writer_bounds``)."""
        with self._lock:
            self._open.pop(staging.id, None)
        self._reaper.discard(staging.path)

    def publish(
        self,
        identity: ArtifactIdentity,
        tensors: Mapping[str, torch.Tensor],
        *,
        kinds: Mapping[str, str] | None = None,
        max_file_bytes: int | None = None,
    ) -> ArtifactRecord:
        """``begin`` + write CPU tensors (``write_tensor``) + ``commit``, aborting on any failure:
        for tests and benchmarks that seed a store in their own process, without a daemon. hwrd
        itself never calls it (its publications are ``hwr.daemon.service.publishing``'s)."""
        specs = [
            StagedTensor(n, t.dtype, tuple(t.shape), kind=(kinds or {}).get(n, "parameter"))  # type: ignore[arg-type]
            for n, t in tensors.items()
        ]
        staging = self.begin(identity, specs, max_file_bytes=max_file_bytes)
        try:
            for name, tensor in tensors.items():
                write_tensor(staging, name, tensor)
        except BaseException:
            self.abort(staging)
            raise
        return self.commit(staging)

    def commit(
        self,
        staging: Staging,
        *,
        expected_tensor_sha256: Mapping[str, str] | None = None,
        trusted_digests: ProducerDigests | None = None,
        opened: dict[str, int] | None = None,
        durable: bool = True,
        prehashed: Mapping[str, PreHashed] | None = None,
    ) -> ArtifactRecord:
        """Validate, hash and atomically publish ``staging``; returns the committed (or joined) record.

        Raises ``ManifestCorrupt`` (a header was overwritten, a file resized), ``ChecksumMismatch``
        (``expected_tensor_sha256`` differs), ``IdentityCollision`` (the key exists with other
        content; it stays), ``ArtifactDenied`` (operator deny), ``NoSpace``/``PublicationFailed``.
        The staging is gone afterwards in every case. ``trusted_digests``: digests a daemon-owned
        producer computed while writing (see ``ProducerDigests`` for why that is sound); when they
        cover the staging exactly, the payloads are not re-read and re-hashed. ``opened``:
        read-only descriptors of payload files by name (``exclusive.open_sole``'s), used instead
        of opening them again; the commit closes them in every case. ``durable`` False: nothing
        is fsynced and the artifact is removed at the store's next open (``volatile``); a key
        already present is joined as it is (durable or not). ``prehashed``: files hashed after
        their writer handed them over (``prehash``; their descriptors are in ``opened``).
        """
        opened = dict(opened or {})
        try:
            self._require_open()
            with self._lock:
                if self._open.pop(staging.id, None) is None:
                    raise InvalidRequest("unknown or finished staging", details={"staging": staging.id})
            try:
                self._step("payload_written")
                manifest, marker = seal(staging, expected_tensor_sha256, trusted_digests, opened, self._step,
                                        durable=durable, prehashed=prehashed)
                return self._install(staging, manifest, marker, durable)
            except HwrError:
                raise  # several typed errors are also OSError subclasses; keep their type
            except OSError as exc:
                raise store_io.io_error(exc, "publication", publication=True) from None
            finally:
                store_io.remove_tree(staging.path)
        finally:
            for fd in opened.values():  # those seal did not take
                os.close(fd)

    def _install(self, staging: Staging, manifest: Manifest, marker: ReadyMarker, durable: bool) -> ArtifactRecord:
        key = staging.key
        target = self._artifacts / key
        with self._keys.hold(key):
            code = self._denied.reason(key)
            if code is not None and not publication_may_replace(code):
                raise ArtifactDenied(f"artifact {key} is denied by an operator", details={"key": key})
            if os.path.lexists(target):
                existing = None if code is not None else self._records.try_lookup(key)
                if existing is not None:
                    if existing.manifest.artifact_content_sha256 == manifest.artifact_content_sha256:
                        return existing  # joined: another publisher committed the same bytes first
                    raise IdentityCollision(f"artifact {key} exists with different content", details={"key": key})
                self._denied.quarantine(target, "replaced", key)
            if durable:
                self._volatile.clear(key, durable=True)  # a marker left behind must not drop it at a restart
            else:
                self._volatile.mark(key)  # durably, before the rename: see ``volatile``
            with self._usage.moved(key, sum(f.size for f in manifest.files)):
                store_io.rename(staging.path, target)
            self._step("renamed")
            os.chmod(target, 0o555)
            if durable:
                self._artifacts_sync.sync()  # group commit: see store_io.GroupSync for the ordering
            self._step("dir_fsynced")
            if code is not None:
                self._records.allow(key)
            # The bytes are the ones just sealed in a private staging directory whose writer was
            # proven gone: fingerprint them (lstat) instead of re-reading and re-parsing them.
            record = record_for_commit(target, key, manifest, marker)
            self._records.put(key, record)
            return record
