"""The paged form of ``InspectArtifact`` (``hwrctl show`` of an artifact with many tensors).

A manifest of 10^5 tensors is several MiB of JSON, past gRPC's default 4 MiB message limit,
while a publication may have up to 2^20 tensors. ``page`` splits the manifest: the manifest
without its tensor list, and the tensor entries from an offset on, at most a count and about
``PAGE_BYTES`` of JSON per page (always at least one entry, so a page always advances).
"""

from __future__ import annotations

import msgspec

__all__ = ["PAGE_BYTES", "PAGE_TENSORS", "page"]

PAGE_BYTES = 1 << 20
PAGE_TENSORS = 50_000
_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode


_last: list[tuple[bytes, bytes, list[object]]] = []  # the last manifest split: pages of one show


def page(manifest_json: bytes, offset: int, limit: int) -> tuple[bytes, bytes, int, int]:
    """(manifest without tensors, JSON array of the page's tensors, tensor count, next offset)."""
    if _last and _last[0][0] is manifest_json:  # the daemon's cached bytes: the same manifest
        _, head, tensors = _last[0]
    else:
        manifest = _decode(manifest_json)
        tensors = manifest.get("tensors", []) if isinstance(manifest, dict) else []
        if isinstance(manifest, dict):
            manifest["tensors"] = []
        head = _encode(manifest)
        _last[:] = [(manifest_json, head, tensors)]
    limit = min(limit or PAGE_TENSORS, PAGE_TENSORS)
    parts: list[bytes] = []
    size = 0
    end = min(offset, len(tensors))
    while end < len(tensors) and len(parts) < limit and (not parts or size < PAGE_BYTES):
        part = _encode(tensors[end])
        parts.append(part)
        size += len(part) + 1
        end += 1
    return head, b"[" + b",".join(parts) + b"]", len(tensors), end
