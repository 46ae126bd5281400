"""The artifact manifest (``manifest.json``) and commit marker (``READY.json``).

Both files are canonical JSON (sorted keys, ``(",", ":")`` separators, ASCII), the same bytes
and field names vLLM-Omni 0.30 writes, so an existing vLLM-Omni HWR root can be adopted:

- manifest: ``schema_version``, ``artifact_key``, ``identity`` (the identity object),
  ``producer_schema``, ``restorer_schema``, ``tensors`` (``name, kind, role, file_name,
  storage_key, shape, dtype, stride, nbytes, sha256``; ``dtype`` in torch form such as
  ``"torch.bfloat16"``; ``storage_key`` is the tensor's key in its safetensors header),
  ``files`` (``file_name, size, sha256`` of the whole file), ``artifact_content_sha256``,
  ``format_metadata``.
- READY.json: ``schema_version, publication_id, manifest_sha256, artifact_content_sha256,
  integrity_mode``; written last, its presence is the commit marker.

Contract: ``from_json`` accepts only byte-exact canonical documents of schema 1 whose records are
internally consistent (sorted unique names, contiguous strides, ``nbytes == numel * itemsize``,
declared files, recomputed content digest, ``artifact_key`` = SHA-256 of the identity); anything
else raises ``ManifestCorrupt`` (or ``ManifestIncompatible`` for another schema version). Limits:
it checks the document, not the payload files (``hwr.client.artifact`` and the store do that).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec

from hwr.client.errors import IdentityError, ManifestCorrupt, ManifestIncompatible
from hwr.client.identity import ArtifactIdentity, canonical_json, parse_canonical
from hwr.client.safetensors_header import contiguous_stride, dtype_by_torch_name

__all__ = [
    "MANIFEST_FILE",
    "MAX_METADATA_BYTES",
    "READY_FILE",
    "SCHEMA_VERSION",
    "FileRecord",
    "Manifest",
    "ReadyMarker",
    "TensorRecord",
    "content_digest",
    "is_payload_name",
]

SCHEMA_VERSION = 1
MANIFEST_FILE = "manifest.json"
READY_FILE = "READY.json"
#: Refuse to parse metadata documents larger than this (a hostile file must not exhaust memory).
MAX_METADATA_BYTES = 64 * 1024 * 1024
_SHA256 = re.compile(r"[0-9a-f]{64}")
_PAYLOAD_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]{0,200}\.safetensors")

NonNegative = Annotated[int, msgspec.Meta(ge=0)]


def is_payload_name(name: object) -> bool:
    """A safe payload basename: no separators, no leading dot, ends in ``.safetensors``."""
    return isinstance(name, str) and _PAYLOAD_NAME.fullmatch(name) is not None and ".." not in name


class TensorRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One tensor: where it lives (``file``, ``storage_key``) and what it is (the rest)."""

    name: str
    kind: Literal["parameter", "buffer"]
    role: str
    file: str = msgspec.field(name="file_name")
    storage_key: str
    shape: tuple[NonNegative, ...]
    dtype: str
    stride: tuple[NonNegative, ...]
    nbytes: NonNegative
    sha256: str

    def semantic_dict(self) -> dict[str, Any]:
        """The fields that define content, independent of which file holds the tensor."""
        return {
            "name": self.name, "kind": self.kind, "role": self.role, "shape": list(self.shape),
            "dtype": self.dtype, "stride": list(self.stride), "nbytes": self.nbytes, "sha256": self.sha256,
        }  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        return {**self.semantic_dict(), "file_name": self.file, "storage_key": self.storage_key}


class FileRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One payload file: its size and the SHA-256 of all its bytes (header included)."""

    name: str = msgspec.field(name="file_name")
    size: NonNegative
    sha256: str

    def to_dict(self) -> dict[str, Any]:
        return {"file_name": self.name, "size": self.size, "sha256": self.sha256}


class _ManifestWire(msgspec.Struct, forbid_unknown_fields=True):
    schema_version: int
    artifact_key: str
    identity: dict[str, Any]
    producer_schema: str
    restorer_schema: str
    tensors: list[TensorRecord]
    files: list[FileRecord]
    artifact_content_sha256: str
    format_metadata: dict[str, Any]


class _Versioned(msgspec.Struct):
    schema_version: int


def _encode_plain(value: Any) -> bytes:
    """Canonical JSON of a value already known to be plain JSON (typed records, decoded JSON).

    Same bytes as ``canonical_json`` without its per-node type walk, which dominated a warm
    acquire's client-side cost; only for values built from validated structs.
    """
    return _PLAIN_ENCODER.encode(value).encode()


_PLAIN_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def content_digest(tensors: Iterable[TensorRecord]) -> str:
    """SHA-256 over the tensors' semantic records in name order (upstream's definition).

    Independent of how tensors are split into files and of their storage keys.
    """
    digest = hashlib.sha256()
    for record in sorted(tensors, key=lambda t: t.name):
        digest.update(_encode_plain(record.semantic_dict()))
    return digest.hexdigest()


def _bad(message: str, **details: Any) -> ManifestCorrupt:
    return ManifestCorrupt(f"manifest: {message}", details=details)


def _check_sha(field: str, value: str) -> None:
    if not _SHA256.fullmatch(value):
        raise _bad(f"{field} is not a lowercase SHA-256 digest", field=field)


def _check_tensor(record: TensorRecord, files: set[str]) -> None:
    if not record.name or not record.role or not record.storage_key:
        raise _bad("tensor name, role and storage_key must be non-empty", tensor=record.name)
    if record.file not in files:
        raise _bad(f"tensor {record.name!r} names an undeclared file", tensor=record.name)
    info = dtype_by_torch_name(record.dtype)
    if record.stride != contiguous_stride(record.shape):
        raise _bad(f"tensor {record.name!r} stride is not contiguous", tensor=record.name)
    if record.nbytes != math.prod(record.shape) * info.itemsize:
        raise _bad(f"tensor {record.name!r} nbytes disagrees with shape and dtype", tensor=record.name)
    _check_sha(f"tensors[{record.name}].sha256", record.sha256)


def _check_unique_sorted(names: list[str], what: str) -> None:
    if names != sorted(names) or len(set(names)) != len(names):
        raise _bad(f"{what} must have unique names in sorted order")


@dataclass(frozen=True)
class Manifest:
    """A validated manifest; build with ``Manifest.build`` or ``Manifest.from_json``."""

    schema_version: int
    identity_bytes: bytes
    producer_schema: str
    restorer_schema: str
    tensors: tuple[TensorRecord, ...]
    files: tuple[FileRecord, ...]
    artifact_content_sha256: str
    format_metadata: bytes = b"{}"

    def __post_init__(self) -> None:
        try:
            identity = ArtifactIdentity.from_canonical_bytes(self.identity_bytes)
        except IdentityError as exc:
            raise _bad(f"identity is invalid: {exc.message}") from None
        if self.schema_version != SCHEMA_VERSION:
            raise ManifestIncompatible(
                f"manifest schema {self.schema_version} is not supported",
                details={"schema_version": self.schema_version},
            )
        if not self.producer_schema or not self.restorer_schema:
            raise _bad("producer_schema and restorer_schema must be non-empty")
        if (self.producer_schema, self.restorer_schema) != (
            identity.producer.manifest_schema,
            identity.producer.restorer_schema,
        ):
            raise _bad("producer/restorer schemas disagree with the identity's producer")
        if not self.tensors or not self.files:
            raise _bad("an artifact needs at least one tensor and one file")
        _check_unique_sorted([t.name for t in self.tensors], "tensors")
        _check_unique_sorted([f.name for f in self.files], "files")
        for record in self.files:
            if not is_payload_name(record.name):
                raise _bad(f"unsafe payload file name {record.name!r}", file=record.name)
            _check_sha(f"files[{record.name}].sha256", record.sha256)
        names = {f.name for f in self.files}
        for tensor in self.tensors:
            _check_tensor(tensor, names)
        bindings = {(t.file, t.storage_key) for t in self.tensors}
        if len(bindings) != len(self.tensors):
            raise _bad("two tensors share one storage key in one file")
        _check_sha("artifact_content_sha256", self.artifact_content_sha256)
        if content_digest(self.tensors) != self.artifact_content_sha256:
            raise _bad("artifact_content_sha256 does not match the tensor records")
        try:
            if self.format_metadata != b"{}" and not isinstance(parse_canonical(self.format_metadata), dict):
                raise _bad("format_metadata must be an object")
        except IdentityError:
            raise _bad("format_metadata is not canonical JSON") from None

    @property
    def key(self) -> str:
        return hashlib.sha256(self.identity_bytes).hexdigest()

    @property
    def identity(self) -> ArtifactIdentity:
        return ArtifactIdentity.from_canonical_bytes(self.identity_bytes)

    def tensors_in(self, file_name: str) -> tuple[TensorRecord, ...]:
        return tuple(t for t in self.tensors if t.file == file_name)

    @classmethod
    def build(
        cls,
        identity: ArtifactIdentity,
        tensors: Iterable[TensorRecord],
        files: Iterable[FileRecord],
        format_metadata: dict[str, Any] | None = None,
    ) -> Manifest:
        """Assemble (and validate) a manifest; records are sorted and the digest computed here."""
        ordered = tuple(sorted(tensors, key=lambda t: t.name))
        return cls(
            schema_version=SCHEMA_VERSION,
            identity_bytes=identity.canonical_bytes,
            producer_schema=identity.producer.manifest_schema,
            restorer_schema=identity.producer.restorer_schema,
            tensors=ordered,
            files=tuple(sorted(files, key=lambda f: f.name)),
            artifact_content_sha256=content_digest(ordered),
            format_metadata=canonical_json(format_metadata or {}),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version,
            "artifact_key": self.key,
            "identity": msgspec.json.decode(self.identity_bytes),
            "producer_schema": self.producer_schema,
            "restorer_schema": self.restorer_schema,
            "tensors": [t.to_dict() for t in self.tensors],
            "files": [f.to_dict() for f in self.files],
            "artifact_content_sha256": self.artifact_content_sha256,
            "format_metadata": msgspec.json.decode(self.format_metadata),
        }

    def to_json(self) -> bytes:
        return _encode_plain(self.to_dict())

    @classmethod
    def from_json(cls, data: bytes) -> Manifest:
        """Parse ``manifest.json`` strictly (see the module contract)."""
        if not isinstance(data, bytes) or len(data) > MAX_METADATA_BYTES:
            raise _bad("manifest is not bytes or is too large")
        try:
            wire = msgspec.json.decode(data, type=_ManifestWire)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            _raise_if_other_version(data)
            raise _bad(f"invalid document: {exc}") from None
        try:
            identity_bytes = canonical_json(wire.identity)
            format_metadata = canonical_json(wire.format_metadata)
        except IdentityError:
            raise _bad("identity or format_metadata is not plain JSON") from None
        manifest = cls(
            schema_version=wire.schema_version,
            identity_bytes=identity_bytes,
            producer_schema=wire.producer_schema,
            restorer_schema=wire.restorer_schema,
            tensors=tuple(wire.tensors),
            files=tuple(wire.files),
            artifact_content_sha256=wire.artifact_content_sha256,
            format_metadata=format_metadata,
        )
        if wire.artifact_key != manifest.key:
            raise _bad("artifact_key is not the SHA-256 of the identity")
        if manifest.to_json() != data:
            raise _bad("manifest is not canonical JSON")
        return manifest


def _raise_if_other_version(data: bytes) -> None:
    try:
        version = msgspec.json.decode(data, type=_Versioned).schema_version
    except (msgspec.DecodeError, msgspec.ValidationError):
        return
    if version != SCHEMA_VERSION:
        raise ManifestIncompatible(f"schema {version} is not supported", details={"schema_version": version})


class ReadyMarker(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``READY.json``: the commit marker, naming the manifest bytes it commits by hash."""

    schema_version: int
    publication_id: str
    manifest_sha256: str
    artifact_content_sha256: str
    integrity_mode: str = "full_checksum"

    def to_json(self) -> bytes:
        return canonical_json(msgspec.to_builtins(self))

    @classmethod
    def for_manifest(cls, manifest_bytes: bytes, manifest: Manifest, publication_id: str) -> ReadyMarker:
        return cls(
            SCHEMA_VERSION,
            publication_id,
            hashlib.sha256(manifest_bytes).hexdigest(),
            manifest.artifact_content_sha256,
        )

    @classmethod
    def from_json(cls, data: bytes) -> ReadyMarker:
        """Strict parse; the marker must be canonical, schema 1, with well-formed digests."""
        if not isinstance(data, bytes) or len(data) > 64 * 1024:
            raise ManifestCorrupt("READY.json is not bytes or is too large")
        try:
            marker = msgspec.json.decode(data, type=cls)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            _raise_if_other_version(data)
            raise ManifestCorrupt(f"READY.json: invalid document: {exc}") from None
        if marker.schema_version != SCHEMA_VERSION:
            raise ManifestIncompatible(f"READY.json schema {marker.schema_version} is not supported")
        if not marker.publication_id or not marker.integrity_mode:
            raise ManifestCorrupt("READY.json: empty publication_id or integrity_mode")
        _check_sha("manifest_sha256", marker.manifest_sha256)
        _check_sha("artifact_content_sha256", marker.artifact_content_sha256)
        if marker.to_json() != data:
            raise ManifestCorrupt("READY.json is not canonical JSON")
        return marker
