"""A publication request checked before anything is sized, reserved or staged (transport-neutral).

Both transports decode their own wire form (gRPC ``TensorSpec`` messages; the peer socket's JSON
``[name, dtype, shape, kind, role]`` lists) into ``RequestedTensor`` values, then call
``tensor_specs`` and ``format_metadata`` here, so a publication is held to the same limits
whichever way it arrives. Every refusal is ``InvalidRequest`` naming the field or tensor.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from hwr.client.errors import IdentityError, InvalidRequest
from hwr.client.identity import parse_canonical
from hwr.client.safetensors_header import DTYPES
from hwr.client.wire import MAX_WAIT_TIMEOUT_MS
from hwr.daemon.store.staging import StagedTensor

__all__ = ["KINDS", "MAX_PUBLICATION_BYTES", "MAX_TENSORS", "RequestedTensor", "format_metadata", "tensor_specs",
           "wait_timeout_s"]

MAX_TENSORS = 1 << 20
MAX_PUBLICATION_BYTES = 1 << 50  # 1 PiB: far above any model, far below int64 overflow
MAX_FORMAT_METADATA_BYTES = 1 << 20
KINDS = frozenset({"parameter", "buffer"})


@dataclass(frozen=True)
class RequestedTensor:
    """One tensor as a transport decoded it; ``kind`` is None when the wire value is unknown."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    kind: str | None
    role: str


def tensor_specs(tensors: Sequence[RequestedTensor]) -> list[StagedTensor]:
    if not tensors:
        raise InvalidRequest("a publication needs at least one tensor", details={"field": "tensors"})
    if len(tensors) > MAX_TENSORS:
        raise InvalidRequest("too many tensors", details={"limit": MAX_TENSORS})
    seen: set[str] = set()
    specs = []
    total_bytes = 0
    for t in tensors:
        if not t.name or len(t.name) > 1024 or t.name in seen or t.name.startswith("__"):
            raise InvalidRequest("tensor names must be unique, non-empty, at most 1024 characters",
                                 details={"field": "tensors.name", "tensor": t.name[:200]})
        if t.dtype not in DTYPES:
            raise InvalidRequest(f"unsupported dtype {t.dtype[:16]!r}", details={"tensor": t.name[:200]})
        if len(t.shape) > 16 or any(d > (1 << 40) for d in t.shape):
            raise InvalidRequest("tensor shape out of range", details={"tensor": t.name[:200]})
        # Bounded before anything sizes, reserves or preallocates it (and before eviction makes
        # room for it): byte counts past 2**63 overflow the syscalls downstream.
        total_bytes += math.prod(t.shape) * DTYPES[t.dtype].itemsize
        if total_bytes > MAX_PUBLICATION_BYTES:
            raise InvalidRequest("the tensors' total size is out of range",
                                 details={"tensor": t.name[:200], "limit": MAX_PUBLICATION_BYTES})
        if t.kind not in KINDS:
            raise InvalidRequest("unknown tensor kind", details={"tensor": t.name[:200]})
        seen.add(t.name)
        specs.append(StagedTensor(name=t.name, dtype=t.dtype, shape=tuple(int(d) for d in t.shape),
                                kind="buffer" if t.kind == "buffer" else "parameter", role=t.role or "weight"))
    return specs


def wait_timeout_s(wait_ms: object) -> float:
    """How long a begin may wait for another publisher of the same identity: ``wait_timeout_ms``
    (an int in [0, MAX_WAIT_TIMEOUT_MS]) in seconds."""
    if not isinstance(wait_ms, int) or isinstance(wait_ms, bool) or not 0 <= wait_ms <= MAX_WAIT_TIMEOUT_MS:
        raise InvalidRequest("wait_timeout_ms is out of range",
                             details={"field": "wait_timeout_ms", "limit": MAX_WAIT_TIMEOUT_MS})
    return wait_ms / 1000.0


def format_metadata(data: bytes) -> dict[str, object] | None:
    """An optional canonical JSON object; anything else is INVALID_ARGUMENT."""
    if not data:
        return None
    if len(data) > MAX_FORMAT_METADATA_BYTES:
        raise InvalidRequest("format_metadata_json is too large", details={"field": "format_metadata_json"})
    try:
        value = parse_canonical(data)
    except IdentityError as exc:
        raise InvalidRequest(f"format_metadata_json: {exc.message}",
                             details={"field": "format_metadata_json"}) from None
    if not isinstance(value, dict):
        raise InvalidRequest("format_metadata_json must be a JSON object", details={"field": "format_metadata_json"})
    return value
