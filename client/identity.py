"""Exact artifact identity, interoperable with vLLM-Omni 0.30's ``WeightArtifactIdentity``.

An identity names *exactly* the bytes a worker would otherwise rebuild: the canonical source, the
component, the representation (dtype, quantization), the runtime layout (TP rank/size, SP size;
never a DP rank: DP replicas share one artifact), the adaptation and the producer. Its ``key`` is
the SHA-256 hex digest of its canonical JSON; for the same field values it equals the key
vLLM-Omni computes.

Canonical JSON: sorted keys, ``(",", ":")`` separators, ASCII only, no NaN/Infinity, string keys
only. No coercion: an int where a string is expected (or a bool where an int is expected) is
rejected, unknown and missing fields are rejected. Identity strings are never used as paths; only
the 64-hex key is.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from hwr.client.errors import IdentityError

__all__ = [
    "KEY_PATTERN",
    "AdaptationIdentity",
    "ArtifactIdentity",
    "ComponentIdentity",
    "ProducerIdentity",
    "RuntimeLayout",
    "SourceIdentity",
    "WeightRepresentation",
    "canonical_json",
    "find_lone_surrogate",
    "has_lone_surrogate",
    "is_key",
    "parse_canonical",
]

KEY_PATTERN = re.compile(r"[0-9a-f]{64}")
#: A surrogate code point in a ``str`` is always a lone one (JSON's escaped pairs decode to one
#: character): not Unicode text, it cannot be encoded as UTF-8, so no identity, name or document
#: may hold one.
_SURROGATE = re.compile("[\ud800-\udfff]")


def has_lone_surrogate(text: str) -> bool:
    return _SURROGATE.search(text) is not None


def find_lone_surrogate(value: object, path: str = "$") -> str | None:
    """The path of the first string (or key) in a decoded JSON ``value`` that holds a lone
    surrogate, or None."""
    if isinstance(value, str):
        return path if has_lone_surrogate(value) else None
    if isinstance(value, list):
        for i, item in enumerate(value):
            found = find_lone_surrogate(item, f"{path}[{i}]")
            if found is not None:
                return found
    elif isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str) and has_lone_surrogate(key):
                return f"{path}.{key.encode('utf-8', 'backslashreplace').decode()}"
            found = find_lone_surrogate(item, f"{path}.{key}")
            if found is not None:
                return found
    return None


def is_key(value: object) -> bool:
    """True for a full 64-hex lowercase identity key."""
    return isinstance(value, str) and KEY_PATTERN.fullmatch(value) is not None


def _check_json(value: object, path: str) -> Any:
    if isinstance(value, str) and has_lone_surrogate(value):
        raise IdentityError(f"{_printable(path)} holds a lone surrogate (not Unicode text)",
                            details={"path": _printable(path)})
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise IdentityError(f"{path} contains a non-finite float", details={"path": path})
        return value
    if isinstance(value, (list, tuple)):
        return [_check_json(item, f"{path}[{i}]") for i, item in enumerate(value)]
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key in value:
            if not isinstance(key, str):
                raise IdentityError(f"{path} contains a non-string key", details={"path": path})
            if has_lone_surrogate(key):
                raise IdentityError(f"a key of {_printable(path)} holds a lone surrogate (not Unicode text)",
                                    details={"path": _printable(path)})
            out[key] = _check_json(value[key], f"{path}.{key}")
        return out
    raise IdentityError(
        f"{path} has unsupported type {type(value).__qualname__}", details={"path": path}
    )


def _printable(path: str) -> str:
    return path.encode("utf-8", "backslashreplace").decode()


def canonical_json(value: object) -> bytes:
    """The one stable encoding of a JSON value; raises ``IdentityError`` for non-JSON values."""
    try:
        checked = _check_json(value, "$")
    except RecursionError:
        raise IdentityError("JSON value is nested too deeply") from None
    return json.dumps(
        checked, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    ).encode("ascii")


def _loads(data: bytes) -> Any:
    """``json.loads`` with its failures as ``IdentityError``."""
    try:
        return json.loads(data)
    except (UnicodeDecodeError, ValueError) as exc:
        raise IdentityError("identity is not valid JSON") from exc
    except RecursionError:
        raise IdentityError("identity JSON is nested too deeply") from None


def parse_canonical(data: bytes) -> Any:
    """Decode bytes that must already be canonical JSON; non-canonical input is rejected, not fixed."""
    value = _loads(data)
    if canonical_json(value) != data:
        raise IdentityError("identity JSON is not in canonical form")
    return value


def _text(path: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise IdentityError(f"{path} must be a non-empty string", details={"path": path})
    return value


def _int(path: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise IdentityError(f"{path} must be an integer", details={"path": path})
    return value


def _meta(path: str, value: object) -> bytes:
    """Metadata is kept as canonical bytes so the frozen identity stays hashable and immutable."""
    return canonical_json(_check_json(value, path))


def _exact(value: object, expected: tuple[str, ...], kind: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise IdentityError(f"{kind} must be a JSON object", details={"section": kind})
    keys = set(value)
    if keys != set(expected):
        missing = sorted(set(expected) - keys)
        unexpected = sorted(str(k) for k in keys - set(expected))
        raise IdentityError(
            f"{kind} fields differ: missing={missing}, unexpected={unexpected}",
            details={"section": kind, "missing": ",".join(missing), "unexpected": ",".join(unexpected)},
        )
    return value


@dataclass(frozen=True)
class SourceIdentity:
    model_id: str
    revision: str
    fingerprint: str
    metadata: bytes = b"{}"

    def __post_init__(self) -> None:
        _text("source.model_id", self.model_id)
        _text("source.revision", self.revision)
        _text("source.fingerprint", self.fingerprint)
        parse_canonical(self.metadata)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model_id": self.model_id,
            "revision": self.revision,
            "fingerprint": self.fingerprint,
            "metadata": json.loads(self.metadata),
        }

    @classmethod
    def from_dict(cls, d: object) -> SourceIdentity:
        v = _exact(d, ("model_id", "revision", "fingerprint", "metadata"), "source")
        return cls(
            _text("source.model_id", v["model_id"]),
            _text("source.revision", v["revision"]),
            _text("source.fingerprint", v["fingerprint"]),
            _meta("source.metadata", v["metadata"]),
        )


@dataclass(frozen=True)
class ComponentIdentity:
    name: str
    ownership: str
    metadata: bytes = b"{}"

    def __post_init__(self) -> None:
        _text("component.name", self.name)
        _text("component.ownership", self.ownership)
        parse_canonical(self.metadata)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "ownership": self.ownership, "metadata": json.loads(self.metadata)}

    @classmethod
    def from_dict(cls, d: object) -> ComponentIdentity:
        v = _exact(d, ("name", "ownership", "metadata"), "component")
        return cls(
            _text("component.name", v["name"]),
            _text("component.ownership", v["ownership"]),
            _meta("component.metadata", v["metadata"]),
        )


@dataclass(frozen=True)
class WeightRepresentation:
    name: str
    dtype: str
    metadata: bytes = b"{}"

    def __post_init__(self) -> None:
        _text("representation.name", self.name)
        _text("representation.dtype", self.dtype)
        parse_canonical(self.metadata)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "metadata": json.loads(self.metadata)}

    @classmethod
    def from_dict(cls, d: object) -> WeightRepresentation:
        v = _exact(d, ("name", "dtype", "metadata"), "representation")
        return cls(
            _text("representation.name", v["name"]),
            _text("representation.dtype", v["dtype"]),
            _meta("representation.metadata", v["metadata"]),
        )


_LAYOUT_FIELDS = (
    "name",
    "tensor_parallel_size",
    "tensor_parallel_rank",
    "sequence_parallel_size",
    "sequence_parallel_backend",
    "metadata",
)


@dataclass(frozen=True)
class RuntimeLayout:
    """Runtime layout: TP rank/size and SP size are part of the identity; DP and SP ranks are not."""

    name: str
    tensor_parallel_size: int = 1
    tensor_parallel_rank: int = 0
    sequence_parallel_size: int = 1
    sequence_parallel_backend: str = "none"
    metadata: bytes = b"{}"

    def __post_init__(self) -> None:
        _text("layout.name", self.name)
        size = _int("layout.tensor_parallel_size", self.tensor_parallel_size)
        rank = _int("layout.tensor_parallel_rank", self.tensor_parallel_rank)
        sp = _int("layout.sequence_parallel_size", self.sequence_parallel_size)
        if size < 1:
            raise IdentityError("layout.tensor_parallel_size must be positive")
        if not 0 <= rank < size:
            raise IdentityError("layout.tensor_parallel_rank must be within [0, tensor_parallel_size)")
        if sp < 1:
            raise IdentityError("layout.sequence_parallel_size must be positive")
        _text("layout.sequence_parallel_backend", self.sequence_parallel_backend)
        parse_canonical(self.metadata)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "tensor_parallel_size": self.tensor_parallel_size,
            "tensor_parallel_rank": self.tensor_parallel_rank,
            "sequence_parallel_size": self.sequence_parallel_size,
            "sequence_parallel_backend": self.sequence_parallel_backend,
            "metadata": json.loads(self.metadata),
        }

    @classmethod
    def from_dict(cls, d: object) -> RuntimeLayout:
        v = _exact(d, _LAYOUT_FIELDS, "layout")
        return cls(
            _text("layout.name", v["name"]),
            _int("layout.tensor_parallel_size", v["tensor_parallel_size"]),
            _int("layout.tensor_parallel_rank", v["tensor_parallel_rank"]),
            _int("layout.sequence_parallel_size", v["sequence_parallel_size"]),
            _text("layout.sequence_parallel_backend", v["sequence_parallel_backend"]),
            _meta("layout.metadata", v["metadata"]),
        )


@dataclass(frozen=True)
class AdaptationIdentity:
    kind: str = "base"
    fingerprint: str | None = None
    metadata: bytes = b"{}"

    def __post_init__(self) -> None:
        _text("adaptation.kind", self.kind)
        if self.fingerprint is not None:
            _text("adaptation.fingerprint", self.fingerprint)
        elif self.kind != "base":
            raise IdentityError("adaptation.fingerprint is required unless kind is 'base'")
        parse_canonical(self.metadata)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "fingerprint": self.fingerprint, "metadata": json.loads(self.metadata)}

    @classmethod
    def from_dict(cls, d: object) -> AdaptationIdentity:
        v = _exact(d, ("kind", "fingerprint", "metadata"), "adaptation")
        fp = v["fingerprint"]
        if fp is not None and not isinstance(fp, str):
            raise IdentityError("adaptation.fingerprint must be a string or null")
        return cls(_text("adaptation.kind", v["kind"]), fp, _meta("adaptation.metadata", v["metadata"]))


_PRODUCER_FIELDS = (
    "producer_id",
    "version",
    "implementation_fingerprint",
    "manifest_schema",
    "restorer_schema",
)


@dataclass(frozen=True)
class ProducerIdentity:
    producer_id: str
    version: str
    implementation_fingerprint: str
    manifest_schema: str
    restorer_schema: str

    def __post_init__(self) -> None:
        for name in _PRODUCER_FIELDS:
            _text(f"producer.{name}", getattr(self, name))

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _PRODUCER_FIELDS}

    @classmethod
    def from_dict(cls, d: object) -> ProducerIdentity:
        v = _exact(d, _PRODUCER_FIELDS, "producer")
        return cls(*(_text(f"producer.{name}", v[name]) for name in _PRODUCER_FIELDS))


_IDENTITY_FIELDS = (
    "schema_version",
    "source",
    "component",
    "representation",
    "layout",
    "adaptation",
    "producer",
)


@dataclass(frozen=True)
class ArtifactIdentity:
    """The exact identity of one final-layout artifact; frozen and hashable.

    ``from_dict`` accepts the JSON object form of vLLM-Omni's ``WeightArtifactIdentity`` (same
    names and nesting); ``key`` equals the key vLLM-Omni computes for it.
    """

    schema_version: int
    source: SourceIdentity
    component: ComponentIdentity
    representation: WeightRepresentation
    layout: RuntimeLayout
    adaptation: AdaptationIdentity = field(default_factory=AdaptationIdentity)
    producer: ProducerIdentity = field(
        default_factory=lambda: ProducerIdentity("client-publish", "1", "none", "hwr-manifest-1", "none")
    )

    def __post_init__(self) -> None:
        if _int("schema_version", self.schema_version) < 1:
            raise IdentityError("schema_version must be positive")
        for name, cls in (
            ("source", SourceIdentity),
            ("component", ComponentIdentity),
            ("representation", WeightRepresentation),
            ("layout", RuntimeLayout),
            ("adaptation", AdaptationIdentity),
            ("producer", ProducerIdentity),
        ):
            if not isinstance(getattr(self, name), cls):
                raise IdentityError(f"identity {name} must be a {cls.__name__}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version,
            "source": self.source.to_dict(),
            "component": self.component.to_dict(),
            "representation": self.representation.to_dict(),
            "layout": self.layout.to_dict(),
            "adaptation": self.adaptation.to_dict(),
            "producer": self.producer.to_dict(),
        }

    # Computed once per (immutable) identity: the publish and acquire paths ask for them often.
    @functools.cached_property
    def canonical_bytes(self) -> bytes:
        return canonical_json(self.to_dict())

    @functools.cached_property
    def key(self) -> str:
        return hashlib.sha256(self.canonical_bytes).hexdigest()

    @classmethod
    def from_dict(cls, d: object) -> ArtifactIdentity:
        v = _exact(d, _IDENTITY_FIELDS, "identity")
        return cls(
            schema_version=_int("schema_version", v["schema_version"]),
            source=SourceIdentity.from_dict(v["source"]),
            component=ComponentIdentity.from_dict(v["component"]),
            representation=WeightRepresentation.from_dict(v["representation"]),
            layout=RuntimeLayout.from_dict(v["layout"]),
            adaptation=AdaptationIdentity.from_dict(v["adaptation"]),
            producer=ProducerIdentity.from_dict(v["producer"]),
        )

    @classmethod
    def from_canonical_bytes(cls, data: bytes) -> ArtifactIdentity:
        """Parse wire/stored bytes, which must already be canonical (rejected, not re-encoded).

        Results are memoised by the exact bytes (identities are immutable; a bounded LRU), so
        the manifests, records and requests that carry one identity parse it once."""
        if not isinstance(data, bytes):
            data = bytes(data)
        return _identity_from_bytes(data)

    @classmethod
    def simple(
        cls,
        model_id: str,
        *,
        revision: str = "main",
        fingerprint: str | None = None,
        component: str = "transformer",
        dtype: str = "bfloat16",
        layout: str = "dense",
        tp_size: int = 1,
        tp_rank: int = 0,
    ) -> ArtifactIdentity:
        """A convenience identity for scripts and demos (the fingerprint defaults to the model id)."""
        return cls(
            schema_version=1,
            source=SourceIdentity(model_id, revision, fingerprint or f"name:{model_id}@{revision}"),
            component=ComponentIdentity(component, "diffusion-transformer"),
            representation=WeightRepresentation("final-layout", dtype),
            layout=RuntimeLayout(layout, tp_size, tp_rank),
        )


@functools.lru_cache(maxsize=4096)
def _identity_from_bytes(data: bytes) -> ArtifactIdentity:
    # One canonical encoding, not two: bytes that are not the canonical encoding of the value
    # they parse to can not equal the canonical bytes of the identity built from it.
    identity = ArtifactIdentity.from_dict(_loads(data))
    if identity.canonical_bytes != data:
        raise IdentityError("identity JSON is not in canonical form")
    return identity
