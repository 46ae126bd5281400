"""Staging: the planned payload files of one publication, before commit.

``plan_payloads`` is pure: it turns tensor specs into payload files (safetensors headers and
absolute byte placements), splitting into several files when ``max_file_bytes`` is given.
``Staging`` is the frozen result bound to one ``tmp/<key>.<pid>.<uuid>/`` directory. A writer
(the daemon, or a client through a passed ``O_RDWR`` descriptor) fills each tensor's raw
little-endian bytes at its placement; the store then commits or aborts.

Limits: layouts are contiguous row-major only (a ``stride`` other than the contiguous one is
refused). Nothing here survives a daemon restart on purpose: staging directories are reclaimed at
the next start, and everything commit needs is re-read from the files or held in ``Staging``.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from hwr.client.errors import InvalidRequest
from hwr.client.identity import ArtifactIdentity
from hwr.client.safetensors_header import (
    DEFAULT_METADATA,
    DTYPES,
    DtypeInfo,
    TensorEntry,
    contiguous_stride,
    plan_file,
)
from hwr.daemon.store import fileio as store_io

if TYPE_CHECKING:
    import torch

__all__ = [
    "OVERLAP_MIN_FILE_BYTES",
    "PayloadPlan",
    "ProducerDigests",
    "StagedTensor",
    "Staging",
    "overlap_file_bytes",
    "plan_payloads",
    "write_tensor",
]

#: Publications hashed while they are written (``overlap_file_bytes``) use files of at least this
#: many tensor bytes (fewer, larger files for larger artifacts: at most about 16).
OVERLAP_MIN_FILE_BYTES = 32 << 20
_OVERLAP_FILES = 16


def overlap_file_bytes(total: int) -> int | None:
    """The ``max_file_bytes`` of a publication hashed while it is written (pure, a function of
    its tensor bytes only, so every revision of one model gets the same layout and a remote
    node can re-plan it): about 16 files of at least ``OVERLAP_MIN_FILE_BYTES``; None (one
    file) when the artifact is smaller than two of them."""
    if total < 2 * OVERLAP_MIN_FILE_BYTES:
        return None
    return max(OVERLAP_MIN_FILE_BYTES, -(-total // _OVERLAP_FILES))


@dataclass(frozen=True)
class StagedTensor:
    """One tensor to stage: what it will be in the artifact (name, dtype, shape, kind, role), no
    bytes. ``dtype``: torch dtype, ``"BF16"`` or ``"torch.bfloat16"``. Not the client's
    ``hwr.client.publisher.TensorSpec`` (a publisher's wire form of the same facts)."""

    name: str
    dtype: torch.dtype | str
    shape: tuple[int, ...]
    stride: tuple[int, ...] | None = None
    kind: Literal["parameter", "buffer"] = "parameter"
    role: str = "weight"

    @property
    def info(self) -> DtypeInfo:
        try:
            return _dtype_info(self.dtype)
        except (KeyError, TypeError):  # TypeError: an unhashable dtype value
            raise InvalidRequest(f"tensor {self.name!r}: unsupported dtype {self.dtype!r}",
                                 details={"tensor": self.name}) from None


@functools.lru_cache(maxsize=64)
def _dtype_info(dtype: object) -> DtypeInfo:
    """The dtype's info by code (``"BF16"``), torch name (``"torch.bfloat16"``) or torch dtype
    (then torch is already imported); KeyError when unknown."""
    for info in DTYPES.values():
        if isinstance(dtype, str):
            if dtype in (info.code, info.torch_name):
                return info
        elif dtype == info.torch_dtype:
            return info
    raise KeyError(dtype)


@dataclass(frozen=True)
class PayloadPlan:
    """One payload file: its name, complete header prefix, entries (by name) and size."""

    name: str
    head: bytes
    entries: tuple[TensorEntry, ...]
    size: int

    def data_offset(self) -> int:
        return len(self.head)


def _check_specs(specs: Sequence[StagedTensor]) -> None:
    if not specs:
        raise InvalidRequest("an artifact needs at least one tensor")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise InvalidRequest("tensor names must be unique")
    for spec in specs:
        if not isinstance(spec.name, str) or not spec.name or spec.name == "__metadata__":
            raise InvalidRequest(f"invalid tensor name {spec.name!r}")
        if spec.kind not in ("parameter", "buffer") or not spec.role:
            raise InvalidRequest(f"tensor {spec.name!r}: invalid kind or role", details={"tensor": spec.name})
        shape = tuple(spec.shape)
        if any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape):
            raise InvalidRequest(f"tensor {spec.name!r}: invalid shape", details={"tensor": spec.name})
        if spec.stride is not None and tuple(spec.stride) != contiguous_stride(shape):
            raise InvalidRequest(
                f"tensor {spec.name!r}: only contiguous layouts are stored", details={"tensor": spec.name}
            )
        spec.info  # noqa: B018 - raises InvalidRequest for an unknown dtype


def plan_payloads(specs: Sequence[StagedTensor], max_file_bytes: int | None = None) -> tuple[PayloadPlan, ...]:
    """Assign tensors to payload files and lay each one out (deterministic for the same specs;
    memoised for hashable specs: a checkpoint's ranks or a churn of same-shaped artifacts
    repeat one plan; a publication plans once and passes the plan to ``Installer.begin``).

    The specs are validated at every call, before the cache: ``(True, 4)`` and ``(2.0, 4)``
    compare and hash equal to int shapes, so a cache hit must not stand in for validation.
    """
    _check_specs(specs)
    if max_file_bytes is not None and max_file_bytes <= 0:
        raise InvalidRequest("max_file_bytes must be positive")
    try:
        return _plan_cached(tuple(specs), max_file_bytes)
    except TypeError:  # unhashable field values (a list shape): plan without the cache
        return _plan(specs, max_file_bytes)


@functools.lru_cache(maxsize=256)
def _plan_cached(specs: tuple[StagedTensor, ...], max_file_bytes: int | None) -> tuple[PayloadPlan, ...]:
    return _plan(specs, max_file_bytes)


def _plan(specs: Sequence[StagedTensor], max_file_bytes: int | None) -> tuple[PayloadPlan, ...]:
    """The layout of validated specs (``plan_payloads`` validates).

    Tensors go, in layout order (larger item size first, then name), into
    ``model-00001.safetensors``, ``model-00002...`` with at most ``max_file_bytes`` of tensor data
    per file; a tensor larger than the limit gets a file of its own.
    """
    order = sorted(specs, key=lambda s: (-s.info.itemsize, s.name))
    groups: list[list[StagedTensor]] = [[]]
    used = 0
    for spec in order:
        size = spec.info.itemsize * _numel(spec.shape)
        if max_file_bytes is not None and groups[-1] and used + size > max_file_bytes:
            groups.append([])
            used = 0
        groups[-1].append(spec)
        used += size
    plans = []
    for index, group in enumerate(groups, start=1):
        head, entries, size = plan_file([(s.name, s.info.code, tuple(s.shape)) for s in group], DEFAULT_METADATA)
        plans.append(PayloadPlan(f"model-{index:05d}.safetensors", head, entries, size))
    return tuple(plans)


def _numel(shape: Sequence[int]) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


@dataclass(frozen=True)
class Staging:
    """A publication in progress. ``placements``: tensor -> (file name, absolute offset, nbytes)."""

    id: str
    key: str
    identity: ArtifactIdentity
    path: Path
    specs: tuple[StagedTensor, ...]
    plans: tuple[PayloadPlan, ...]
    placements: Mapping[str, tuple[str, int, int]] = field(repr=False)
    format_metadata: Mapping[str, Any] = field(default_factory=dict, repr=False)

    @property
    def files(self) -> list[tuple[str, Path, int]]:
        return [(plan.name, self.path / plan.name, plan.size) for plan in self.plans]

    @classmethod
    def from_plans(
        cls,
        id: str,
        identity: ArtifactIdentity,
        path: Path,
        specs: Sequence[StagedTensor],
        plans: tuple[PayloadPlan, ...],
        format_metadata: Mapping[str, Any] | None = None,
    ) -> Staging:
        placements = {
            entry.name: (plan.name, plan.data_offset() + entry.begin, entry.nbytes)
            for plan in plans
            for entry in plan.entries
        }
        return cls(id, identity.key, identity, path, tuple(specs), plans, placements, dict(format_metadata or {}))


_HEX = frozenset("0123456789abcdef")


def _is_digest(value: object) -> bool:
    return isinstance(value, str) and len(value) == 64 and set(value) <= _HEX


@dataclass(frozen=True)
class ProducerDigests:
    """SHA-256 digests that a daemon-owned producer computed while it wrote a staging.

    ``files``: payload file name -> digest of the whole file; ``tensors``: tensor name -> digest
    of its bytes. ``Installer.commit(trusted_digests=...)`` then builds the manifest from them
    instead of re-reading and re-hashing every payload byte.

    Trust argument: only daemon-owned writers report these, never a client:
    ``hwr.daemon.producers`` (code of this package, run by the daemon as the daemon's own uid,
    started from the daemon's interpreter, fed descriptors the daemon opened) and the fleet
    tier's pull (``hwr.daemon.fleet.sink``: the daemon's own threads hash the very buffers they
    write into a staging only they hold; the remote's manifest digests are then compared with
    these as ``expected``, so a remote's bytes are still checked). Such a writer can already
    write any bytes it likes into the staging, so lying about their digests gives it nothing it
    did not have: the manifest it would produce describes bytes that a later ``verify`` or scrub
    re-hashes and, on mismatch, quarantines (tested). A daemon re-hash at commit would not catch
    more anyway: it reads the same page-cache pages the writer just wrote, so neither catches a
    corruption on the way to the disk. Limits: a bug in the writer's hashing, or a page corrupted
    in memory between the write and the commit, is caught only by ``verify``/scrub, not at commit; client
    publications (untrusted writers) never use this path. The headers, sizes and file set are
    still validated at commit as for any publication.
    """

    files: Mapping[str, str]
    tensors: Mapping[str, str]

    @classmethod
    def parse(cls, document: object) -> ProducerDigests | None:
        """From the producer's ``done`` event; None when absent or malformed (commit re-hashes)."""
        if not isinstance(document, Mapping):
            return None
        files, tensors = document.get("files"), document.get("tensors")
        if not isinstance(files, Mapping) or not isinstance(tensors, Mapping):
            return None
        if not all(isinstance(k, str) and _is_digest(v) for k, v in (*files.items(), *tensors.items())):
            return None
        return cls(dict(files), dict(tensors))

    def covers(self, staging: Staging) -> bool:
        """True when these digests name exactly the staging's files and tensors."""
        return set(self.files) == {p.name for p in staging.plans} and set(self.tensors) == set(staging.placements)


def write_tensor(staging: Staging, name: str, tensor: torch.Tensor, fd: int | None = None) -> None:
    """Write one CPU tensor's bytes at its placement (opening the payload file unless ``fd`` is given).

    Raises ``InvalidRequest`` when the tensor's dtype, shape or size differ from the plan.
    """
    spec = next((s for s in staging.specs if s.name == name), None)
    if spec is None:
        raise InvalidRequest(f"tensor {name!r} is not part of this staging")
    if tensor.dtype != spec.info.torch_dtype or tuple(tensor.shape) != tuple(spec.shape):
        raise InvalidRequest(f"tensor {name!r} does not match its spec", details={"tensor": name})
    file_name, offset, nbytes = staging.placements[name]
    if nbytes == 0:
        return
    # Only a writer holding CPU tensors in hwrd's own process calls this: ``Installer.publish``,
    # which tests and benchmarks use to seed a store without a daemon. hwrd never does (clients
    # write their staging descriptors, producers write through ``producers.blocks.TensorSink``).
    import torch

    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    own = fd is None
    fd = os.open(staging.path / file_name, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC) if own else fd
    try:
        store_io.pwrite_all(fd, memoryview(raw), offset)
    finally:
        if own:
            os.close(fd)
