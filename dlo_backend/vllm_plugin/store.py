"""vLLM-Omni's ``HostWeightStore`` protocol served by hwrd.

``HwrdHostWeightStore`` is what ``HostWeightRuntime`` gets instead of vLLM-Omni's in-process
filesystem store when hwrd is configured (see ``config``):

- ``lookup`` = ``Client.acquire``: the daemon maps nothing for us, it hands over read-only
  descriptors; the hwr ``Lease`` maps them and checks every safetensors header against the
  manifest, and the result is wrapped into vLLM-Omni's own ``HostWeightLease`` (its constructor
  re-checks names, shapes, dtypes, strides and digests against vLLM-Omni's ``WeightManifest``,
  parsed from the daemon's manifest bytes). Closing that lease releases the hwrd lease.
- ``get_or_build`` = lookup, else run the vLLM-Omni producer into a ``CollectingWriter`` and
  publish through hwrd (one publisher per identity node-wide; others are told JOINED), then
  lease the committed artifact.

Outcome table (hwr error -> ``StoreResult``):

    RemoteUnavailable (a miss, hwrd's remote tier down) -> FAILED, DOMAIN_UNAVAILABLE, retryable,
                                                      the message naming the remote
    ArtifactNotFound                               -> MISS; in ``required`` mode FAILED
                                                      (PRODUCER_UNAVAILABLE, not retryable) naming
                                                      hwrd, its socket and ``hwrctl prewarm``
    ArtifactDenied / ManifestCorrupt / ...Incompat. / ChecksumMismatch -> INVALID (typed failure)
    ActiveBuildTimeout                             -> TIMEOUT (retryable)
    DaemonUnavailable / DeadlineExceeded / SessionInvalid / StoreLocked
                                                   -> FAILED, DOMAIN_UNAVAILABLE, retryable
    anything else typed                            -> FAILED with the same code when vLLM-Omni
                                                      knows it, else UNSUPPORTED; retryable as hwr says

So preferred mode falls back to canonical loading when hwrd is down (retryable), and required
mode fails with a message naming the socket.

Validation levels: MANIFEST_AND_METADATA and FULL_CHECKSUM are both served from hwrd's
guarantee: it hashed every byte once at publication (or adoption) and keeps payloads immutable
(0444 files in a private 0700 store, read-only mappings), so a warm lease does not re-read the
bytes. FS_VERITY is reported UNSUPPORTED, like vLLM-Omni's own store.

A lookup of an artifact that hwrd is pulling from its fleet tier's remote (or pulls because of
this lookup) waits for the pull while it advances, and logs its progress (``PullLog``): a
``required`` start always, a ``preferred`` one unless ``preferred_pull`` is ``"fallback"``
(``config``), in which case the lookup is a MISS at once (the pull goes on for the next start)
and ``get_or_build`` answers TIMEOUT instead of building and publishing what the pull brings.

Publication carries the producer's ``format_metadata`` into hwrd's manifest unchanged.
Limits: ``LeaseProvenance.publication_id`` is the hwrd lease id and
``domain_uuid`` names the daemon's socket (hwrd exposes no publication id to clients).
One ``Client`` (session) per process, opened on first use and reopened after a fork or when
the daemon went away.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from vllm_omni.host_weight_runtime import (
    BuildRequest,
    CanonicalJson,
    CoordinationScope,
    FailureCode,
    HostWeightFailure,
    HostWeightLease,
    LeaseProvenance,
    MappedHostRegion,
    ResolutionStage,
    StoreResult,
    StoreStatus,
    ValidationLevel,
    WeightArtifactIdentity,
    WeightManifest,
)

from hwr.client import connect
from hwr.client.acquisition import PullReport
from hwr.client.client import Client
from hwr.client.errors import (
    ActiveBuildTimeout,
    ArtifactDenied,
    ArtifactNotFound,
    ChecksumMismatch,
    DaemonUnavailable,
    HwrError,
    IdentityCollision,
    ManifestCorrupt,
    ManifestIncompatible,
    RemoteUnavailable,
)
from hwr.client.identity import ArtifactIdentity
from hwr.client.lease import Lease
from hwr.dlo_backend.vllm_plugin import unchanged
from hwr.dlo_backend.vllm_plugin.config import DaemonTarget
from hwr.dlo_backend.vllm_plugin.writer import CollectingWriter, WriterError

__all__ = ["HwrdHostWeightStore", "PullLog", "failure_from_error", "to_hwr_identity"]

log = logging.getLogger("hwr.vllm_plugin")

_INVALID = (ArtifactDenied, ManifestCorrupt, ManifestIncompatible, ChecksumMismatch)
_MANIFEST_CACHE = 32  # parsed manifests kept per process (one per artifact this process leases)
# Process-wide, not per store: vLLM-Omni builds a new runtime (and so a new store) for every
# load, and a process may load the same artifact again (a preferred start's fresh canonical
# retry, a second pipeline). Entries are immutable: content-addressed manifests, frozen parses.
_manifests: dict[bytes, WeightManifest] = {}
_digest_maps: dict[int, tuple[WeightManifest, dict[str, str]]] = {}
_cache_lock = threading.Lock()
_UNREACHABLE_CODES = {"DAEMON_UNAVAILABLE", "DEADLINE_EXCEEDED", "SESSION_INVALID", "STORE_LOCKED"}
_STAGE_BY_CODE = {
    "ARTIFACT_DENIED": ResolutionStage.LOOKUP, "MANIFEST_CORRUPT": ResolutionStage.VALIDATION,
    "MANIFEST_INCOMPATIBLE": ResolutionStage.VALIDATION, "CHECKSUM_MISMATCH": ResolutionStage.VALIDATION,
    "IDENTITY_COLLISION": ResolutionStage.VALIDATION, "ENOSPC": ResolutionStage.CAPACITY,
    "ARTIFACT_TOO_LARGE": ResolutionStage.CAPACITY, "STORE_LIMIT_EXCEEDED": ResolutionStage.CAPACITY,
    "INSUFFICIENT_CAPACITY": ResolutionStage.CAPACITY,
    "EXCEEDS_FILESYSTEM": ResolutionStage.CAPACITY, "INVALID_CONFIG": ResolutionStage.CONFIGURATION,
    "DOMAIN_POLICY_MISMATCH": ResolutionStage.DOMAIN,
}


def to_hwr_identity(identity: WeightArtifactIdentity) -> ArtifactIdentity:
    """The hwr identity of a vLLM-Omni identity; both compute the same key (tested)."""
    return ArtifactIdentity.from_dict(identity.to_dict())


def _failure(stage: ResolutionStage, code: FailureCode, message: str, *, retryable: bool,
             details: dict[str, Any] | None = None) -> HostWeightFailure:
    return HostWeightFailure(stage=stage, code=code, retryable=retryable, message=message,
                             details=CanonicalJson.from_value({k: str(v) for k, v in (details or {}).items()}))


def failure_from_error(exc: HwrError, stage: ResolutionStage, target: DaemonTarget) -> HostWeightFailure:
    """The vLLM-Omni failure for a typed hwr error (pure; see the module's outcome table)."""
    details = {"hwr_code": exc.code, "socket": str(target.socket)}
    if exc.code in _UNREACHABLE_CODES:
        return _failure(ResolutionStage.DOMAIN, FailureCode.DOMAIN_UNAVAILABLE,
                        f"hwrd at {target.socket} (from {target.origin}) is unavailable: {exc.message}",
                        retryable=True, details=details)
    code = FailureCode.__members__.get(exc.code, FailureCode.UNSUPPORTED)
    return _failure(_STAGE_BY_CODE.get(exc.code, stage), code, f"hwrd: {exc.message}",
                    retryable=bool(exc.retryable), details=details)


def _result_for_error(exc: HwrError, stage: ResolutionStage, target: DaemonTarget) -> StoreResult:
    if isinstance(exc, RemoteUnavailable):  # a miss whose remote tier is down: name the remote
        return StoreResult(StoreStatus.FAILED, failure=_failure(
            ResolutionStage.DOMAIN, FailureCode.DOMAIN_UNAVAILABLE, f"hwrd: {exc.message}", retryable=True,
            details={"hwr_code": exc.code, "socket": str(target.socket), **exc.details}))
    if isinstance(exc, ArtifactNotFound):
        return StoreResult(StoreStatus.MISS)
    failure = failure_from_error(exc, stage, target)
    if isinstance(exc, _INVALID):
        return StoreResult(StoreStatus.INVALID, failure=failure)
    if isinstance(exc, ActiveBuildTimeout):
        return StoreResult(StoreStatus.TIMEOUT, failure=failure)
    return StoreResult(StoreStatus.FAILED, failure=failure)


def _remaining(deadline: float | None, floor: float = 0.5) -> float | None:
    return None if deadline is None else max(floor, deadline - time.monotonic())


class PullLog:
    """Logs the pull an acquire waits for: its start, then at most every ``every_s``."""

    def __init__(self, key: str, mode: str, every_s: float = 5.0) -> None:
        self._key, self._mode, self._every = key, mode, every_s
        self._last = 0.0
        self.reports = 0

    def __call__(self, progress: PullReport) -> None:
        now = time.monotonic()
        if self.reports and now - self._last < self._every:
            return
        self._last = now
        self.reports += 1
        share = f"{progress.done_bytes >> 20} of {progress.total_bytes >> 20} MiB ({100 * progress.fraction:.0f}%)"
        log.info("Host Weight Runtime (%s) waits for hwrd's pull of artifact %s from %s: %s, %s",
                 self._mode, self._key[:16], progress.remote, progress.phase, share)


class HwrdHostWeightStore:
    """``HostWeightStore`` over one hwrd; thread-safe; one hwrd session per process. ``mode``:
    vLLM-Omni's runtime mode (``preferred``/``required``), for the pull choice and the logs."""

    def __init__(self, target: DaemonTarget, *, client_name: str | None = None, mode: str = "required") -> None:
        self.target = target
        self.mode = mode
        self.wait_for_pull = mode != "preferred" or target.preferred_pull == "wait"
        self._pulling: set[str] = set()  # keys whose last lookup missed because hwrd pulls them
        self._client_name = client_name or f"vllm-omni-{os.getpid()}"
        self._lock = threading.Lock()
        self._client: Client | None = None
        self._pid = os.getpid()

    # session -------------------------------------------------------------------------------
    def _session(self) -> Client:
        with self._lock:
            client = self._client
            if client is not None and self._pid != os.getpid():
                client = None  # a fork's inherited client refuses to be used in the child
            if client is None:
                client = connect(self.target.socket, timeout=self.target.connect_timeout_s,
                                 client_name=self._client_name)
                self._client, self._pid = client, os.getpid()
            return client

    def _drop_session(self, client: Client) -> None:
        with self._lock:
            if self._client is client:
                self._client = None
        client.close()

    def close(self) -> None:
        """End this process's hwrd session (the daemon then releases its leases); idempotent."""
        with self._lock:
            client, self._client = self._client, None
        if client is not None and self._pid == os.getpid():
            client.close()

    # HostWeightStore -----------------------------------------------------------------------
    def lookup(self, identity: WeightArtifactIdentity, *, validation: ValidationLevel,
               deadline: float | None = None) -> StoreResult:
        result = self._lookup(identity, validation, deadline)
        if result.status is StoreStatus.MISS and self.mode == "required":
            return StoreResult(StoreStatus.FAILED, failure=self._empty_for_required(identity))
        return result

    def _lookup(self, identity: WeightArtifactIdentity, validation: ValidationLevel,
                deadline: float | None) -> StoreResult:
        if validation is ValidationLevel.FS_VERITY:
            return StoreResult(StoreStatus.FAILED, failure=_failure(
                ResolutionStage.VALIDATION, FailureCode.UNSUPPORTED,
                "fs-verity validation is not implemented by hwrd", retryable=False))
        return self._acquire(identity, validation, deadline, origin="hwrd")

    def _empty_for_required(self, identity: WeightArtifactIdentity) -> HostWeightFailure:
        """A ``required`` lookup that hwrd answered "not here": name hwrd, its socket and how to
        fill it (vLLM-Omni's own message would only say that no producer may build it)."""
        socket = self.target.socket
        return _failure(
            ResolutionStage.LOOKUP, FailureCode.PRODUCER_UNAVAILABLE,
            f"hwrd at {socket} (from {self.target.origin}) does not hold artifact {identity.key[:16]} and a "
            "required start never builds it. Fill hwrd first: `hwrctl --socket "
            f"{socket} checkpoints add MODEL_DIR` then `hwrctl --socket {socket} prewarm MODEL_DIR --producer "
            "vllm-omni --omni-config CONFIG` (the serving worker's vLLM-Omni config as JSON), or start once "
            "with --host-weight-runtime-mode preferred (the cold start publishes into hwrd)",
            retryable=False, details={"socket": socket, "artifact": identity.key})

    def get_or_build(self, request: BuildRequest, producer: Any, *, validation: ValidationLevel,
                     deadline: float) -> StoreResult:
        identity = request.identity
        spec = producer.spec
        if spec.coordination_scope is not CoordinationScope.SINGLE_PROCESS:
            return StoreResult(StoreStatus.FAILED, failure=_failure(
                ResolutionStage.PRODUCTION, FailureCode.PRODUCER_UNSUPPORTED,
                f"coordination scope {spec.coordination_scope.value} is not implemented", retryable=False))
        if tuple(output.key for output in spec.outputs) != (identity.key,):
            return StoreResult(StoreStatus.FAILED, failure=_failure(
                ResolutionStage.PRODUCTION, FailureCode.PRODUCER_UNAVAILABLE,
                "producer does not declare exactly the requested artifact identity", retryable=False))
        initial = self._lookup(identity, validation, deadline)  # a miss here is what builds
        if initial.status is not StoreStatus.MISS and initial.status is not StoreStatus.INVALID:
            return initial
        if initial.status is StoreStatus.MISS and identity.key in self._pulling:  # preferred_pull = fallback
            return StoreResult(StoreStatus.TIMEOUT, failure=_failure(
                ResolutionStage.PRODUCTION, FailureCode.ACTIVE_BUILD_TIMEOUT,
                f"hwrd is pulling artifact {identity.key[:16]} from its remote; not building it again "
                "(the next start is warm)", retryable=True))
        writer = CollectingWriter()
        try:
            metadata = producer.produce(writer)
            specs, tensors = writer.tensor_specs(), writer.tensors()
        except Exception as exc:
            return StoreResult(StoreStatus.FAILED, failure=_failure(
                ResolutionStage.PRODUCTION, FailureCode.PRODUCER_FAILED, f"artifact producer failed: {exc}",
                retryable=False, details={"exception_type": type(exc).__name__}))
        refusal = _metadata_refusal(identity, metadata)
        if refusal is not None:
            return StoreResult(StoreStatus.FAILED, failure=refusal)
        client: Client | None = None
        try:
            client = self._session()
            publisher = client.publisher(to_hwr_identity(identity), specs,
                                         wait_timeout=_remaining(deadline, 0.0) or 0.0,
                                         format_metadata=metadata.format_metadata.to_value() or None)
            with publisher:
                joined = not publisher.staged
                if publisher.staged:
                    for name, tensor in tensors.items():
                        publisher.write(name, tensor)
                publisher.commit()
                joined = joined or publisher.joined
        except WriterError as exc:
            return StoreResult(StoreStatus.FAILED, failure=_failure(
                ResolutionStage.PRODUCTION, FailureCode.PRODUCER_FAILED, str(exc), retryable=False))
        except IdentityCollision as exc:
            return StoreResult(StoreStatus.FAILED, failure=failure_from_error(exc, ResolutionStage.VALIDATION,
                                                                                self.target))
        except HwrError as exc:
            if client is not None and isinstance(exc, DaemonUnavailable):
                self._drop_session(client)
            result = _result_for_error(exc, ResolutionStage.PRODUCTION, self.target)
            if result.status is StoreStatus.MISS or result.status is StoreStatus.INVALID:
                failure = failure_from_error(exc, ResolutionStage.LIFECYCLE, self.target)
                result = StoreResult(StoreStatus.FAILED, failure=_failure(
                    ResolutionStage.LIFECYCLE, FailureCode.PUBLICATION_FAILED,
                    f"publication through hwrd failed: {failure.message}", retryable=failure.retryable))
            return result
        opened = self._acquire(identity, validation, deadline, origin="producer")
        if opened.status is not StoreStatus.HIT:
            return opened
        return StoreResult(StoreStatus.JOINED if joined else StoreStatus.BUILT, lease=opened.lease)

    # leases --------------------------------------------------------------------------------
    def _acquire(self, identity: WeightArtifactIdentity, validation: ValidationLevel,
                 deadline: float | None, *, origin: str) -> StoreResult:
        client: Client | None = None
        try:
            client = self._session()
            # By key: the daemon's manifest carries the identity, and HostWeightLease below
            # rejects it unless its canonical bytes equal the requested identity's.
            lease = client.acquire(identity.key, timeout=_remaining(deadline), wait_for_pull=self.wait_for_pull,
                                   on_pull=PullLog(identity.key, self.mode))
        except HwrError as exc:
            if client is not None and isinstance(exc, DaemonUnavailable):
                self._drop_session(client)
            with self._lock:
                if isinstance(exc, ArtifactNotFound) and exc.details.get("pulling"):
                    self._pulling.add(identity.key)
                else:
                    self._pulling.discard(identity.key)
            return _result_for_error(exc, ResolutionStage.LOOKUP, self.target)
        try:
            return StoreResult(StoreStatus.HIT, lease=self._wrap(identity, lease, validation, origin))
        except (ValueError, TypeError) as exc:
            lease.close()
            return StoreResult(StoreStatus.INVALID, failure=_failure(
                ResolutionStage.VALIDATION, FailureCode.MANIFEST_CORRUPT,
                f"hwrd artifact {identity.key} failed vLLM-Omni's manifest validation: {exc}", retryable=False))

    def _wrap(self, identity: WeightArtifactIdentity, lease: Lease, validation: ValidationLevel,
              origin: str) -> HostWeightLease:
        manifest = self._manifest(lease.manifest.to_json())
        regions = tuple(MappedHostRegion(file_name=r.file, address=r.address, length=r.length,
                                         read_only=r.read_only) for r in lease.mapped_regions)
        backing = hashlib.sha256(f"{self.target.socket}\0{lease.key}\0{lease.lease_id}".encode()).hexdigest()
        provenance = LeaseProvenance(
            resolution_id=uuid.uuid4().hex, identity_digest=identity.key,
            artifact_content_sha256=manifest.artifact_content_sha256, domain_uuid=f"hwrd:{self.target.socket}",
            publication_id=lease.lease_id, resolution_source="hwrd", artifact_origin=origin,
            producer_id=identity.producer.producer_id, provider_id=None, validation_level=validation.value,
            backing_fingerprint=backing)
        tensors = dict(lease.tensors)
        forget: list[Callable[[], None]] = []

        def release() -> None:
            for forget_views in forget:
                forget_views()
            lease.close()

        wrapped = HostWeightLease(identity=identity, manifest=manifest, tensors=tensors, mapped_regions=regions,
                                  provenance=provenance, resource_closers=(), release_artifact_lock=release)
        # The views serve the loader's "unchanged" check (``unchanged``) once vLLM-Omni accepted
        # them, and leave it before the hwrd lease is released.
        forget.append(unchanged.register(lease.key, lease.lease_id, tensors, self._digests(manifest),
                                         _read_only_ranges(regions)))
        return wrapped

    def _digests(self, manifest: WeightManifest) -> dict[str, str]:
        """name -> SHA-256 of one manifest (cached like the manifest itself: it is immutable)."""
        with _cache_lock:
            cached = _digest_maps.get(id(manifest))
            if cached is not None and cached[0] is manifest:
                return cached[1]
        digests = {entry.name: entry.sha256 for entry in manifest.tensors}
        with _cache_lock:
            if len(_digest_maps) >= _MANIFEST_CACHE:
                _digest_maps.pop(next(iter(_digest_maps)))
            _digest_maps[id(manifest)] = (manifest, digests)
        return digests

    def _manifest(self, document: bytes) -> WeightManifest:
        """vLLM-Omni's strict parse of the daemon's manifest, once per distinct document.

        An artifact's manifest never changes (content-addressed, immutable in hwrd) and a
        ``WeightManifest`` is frozen, so equal bytes can share one parsed object; the parse
        (vLLM-Omni's full schema validation) dominated a warm lookup's client-side cost.
        """
        with _cache_lock:
            cached = _manifests.get(document)
        if cached is not None:
            return cached
        manifest = WeightManifest.from_dict(json.loads(document))
        with _cache_lock:
            if len(_manifests) >= _MANIFEST_CACHE:
                _manifests.pop(next(iter(_manifests)))
            _manifests[document] = manifest
        return manifest

    def __repr__(self) -> str:
        return f"HwrdHostWeightStore(socket={str(self.target.socket)!r}, origin={self.target.origin!r})"


def _read_only_ranges(regions: tuple[MappedHostRegion, ...]) -> Callable[[int, int], bool]:
    """Whether ``[address, address + nbytes)`` lies inside one read-only region (bisect over the
    regions sorted by address: O(log files) per tensor)."""
    spans = sorted((r.address, r.address + r.length) for r in regions if r.read_only)
    starts = [start for start, _ in spans]

    def inside(address: int, nbytes: int) -> bool:
        at = bisect.bisect_right(starts, address) - 1
        return at >= 0 and address + nbytes <= spans[at][1]

    return inside


def _metadata_refusal(identity: WeightArtifactIdentity, metadata: Any) -> HostWeightFailure | None:
    if (metadata.producer_schema, metadata.restorer_schema) != (identity.producer.manifest_schema,
                                                                identity.producer.restorer_schema):
        return _failure(ResolutionStage.PRODUCTION, FailureCode.PRODUCER_FAILED,
                        "production metadata does not match the identity's manifest/restorer schema",
                        retryable=False)
    return None
