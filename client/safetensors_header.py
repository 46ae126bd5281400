"""Strict reading and deterministic planning of safetensors headers.

Byte layout of one payload file (all integers little-endian)::

    offset 0          8                    8+N = data_offset (multiple of 8)        file_size
           +----------+--------------------+--------------------------------------------+
           | N: u64   | header JSON, N B   | data section: tensors back to back         |
           +----------+--------------------+--------------------------------------------+
                      | {"__metadata__":{...},                                          |
                      |  "<name>":{"dtype":"BF16","shape":[..],"data_offsets":[b,e]}}   |
                      | padded with spaces (0x20) so that 8+N is a multiple of 8        |
                                           |<- t0: [0,e0) ->|<- t1: [e0,e1) ->| ... |<-tk->|

``data_offsets`` are relative to the data section. The tensors tile it exactly: sorted by
offset, the first begins at 0, each begins where the previous ends, the last ends at
``file_size - data_offset``; ``end - begin == prod(shape) * itemsize(dtype)``. Our writer
orders the data section by descending item size, then name (what safetensors' own writer does), so
every tensor starts at a multiple of its item size; the header JSON itself has sorted keys.

Contract: ``parse_header`` never trusts a byte it has not checked and raises ``ManifestCorrupt``
(with ``details["check"]`` naming the violated rule) for every malformed input, never another
exception type. Limits: it checks the layout, not the tensor bytes (hashes live in the manifest);
duplicate JSON keys, NaN/Infinity literals and non-string metadata are rejected even though some
readers tolerate them.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from hwr.client.errors import ManifestCorrupt

__all__ = [
    "DEFAULT_METADATA",
    "DTYPES",
    "MAX_HEADER_BYTES",
    "DtypeInfo",
    "Header",
    "TensorEntry",
    "contiguous_stride",
    "dtype_by_torch_name",
    "parse_header",
    "plan_file",
    "read_header",
]

#: safetensors' own limit on the header length (its Rust reader refuses more).
MAX_HEADER_BYTES = 100_000_000
MAX_DIMS = 64
DEFAULT_METADATA: Mapping[str, str] = {"format": "pt", "host_weight_runtime": "1"}
_LENGTH = struct.Struct("<Q")


@dataclass(frozen=True)
class DtypeInfo:
    """One safetensors dtype: its header code, torch attribute, item size and torch name (manifest form).

    The table is static so that parsing headers never imports torch (hwrd does not load torch);
    ``torch_dtype`` imports it on first use.
    """

    code: str
    attr: str
    itemsize: int

    @property
    def torch_name(self) -> str:
        return f"torch.{self.attr}"

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.attr)


def _dtype_table() -> dict[str, DtypeInfo]:
    names = {
        "F64": ("float64", 8), "F32": ("float32", 4), "F16": ("float16", 2), "BF16": ("bfloat16", 2),
        "I64": ("int64", 8), "I32": ("int32", 4), "I16": ("int16", 2), "I8": ("int8", 1), "U8": ("uint8", 1),
        "BOOL": ("bool", 1), "F8_E4M3": ("float8_e4m3fn", 1), "F8_E5M2": ("float8_e5m2", 1),
        "U16": ("uint16", 2), "U32": ("uint32", 4), "U64": ("uint64", 8),
    }  # fmt: skip
    return {code: DtypeInfo(code, attr, size) for code, (attr, size) in names.items()}


#: safetensors dtype code -> (torch dtype, item size).
DTYPES: Mapping[str, DtypeInfo] = _dtype_table()
_BY_TORCH_NAME: Mapping[str, DtypeInfo] = {info.torch_name: info for info in DTYPES.values()}


def dtype_by_torch_name(name: str) -> DtypeInfo:
    """The dtype whose ``str(torch_dtype)`` is ``name`` (the manifest's form); ``ManifestCorrupt`` if none."""
    info = _BY_TORCH_NAME.get(name) if isinstance(name, str) else None
    if info is None:
        raise ManifestCorrupt(f"unsupported dtype {name!r}", details={"check": "dtype"})
    return info


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major element strides, computed like torch (a zero dimension counts as one)."""
    stride: list[int] = []
    running = 1
    for dim in reversed(shape):
        stride.append(running)
        running *= max(dim, 1)
    return tuple(reversed(stride))


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a header; ``begin``/``end`` are byte offsets relative to the data section."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class Header:
    """A validated header; ``entries`` sorted by name. ``file_size`` is implied by the tiling rule."""

    entries: tuple[TensorEntry, ...]
    metadata: dict[str, str] | None
    data_offset: int

    @property
    def file_size(self) -> int:
        return self.data_offset + max((e.end for e in self.entries), default=0)

    def entry(self, name: str) -> TensorEntry:
        for item in self.entries:
            if item.name == name:
                return item
        raise ManifestCorrupt(f"tensor {name!r} is not in the header", details={"check": "names"})


def _corrupt(check: str, message: str, **details: Any) -> ManifestCorrupt:
    return ManifestCorrupt(f"safetensors header: {message}", details={"check": check, **details})


def _pairs_without_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _corrupt("json", f"duplicate key {key!r}")
        out[key] = value
    return out


def _reject_constant(name: str) -> Any:
    raise _corrupt("json", f"non-finite number {name}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _decode_json(raw: bytes) -> dict[str, Any]:
    if not raw.startswith(b"{"):
        raise _corrupt("json", "header does not start with '{'")
    try:
        text = raw.decode("utf-8")
        value = json.loads(text, object_pairs_hook=_pairs_without_duplicates, parse_constant=_reject_constant)
    except ManifestCorrupt:
        raise
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise _corrupt("json", f"invalid JSON ({type(exc).__name__})") from None
    if not isinstance(value, dict):
        raise _corrupt("json", "header is not a JSON object")
    return value


def _metadata(value: object) -> dict[str, str]:
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise _corrupt("metadata", "__metadata__ must map strings to strings")
    return dict(value)


def _entry(name: str, value: object) -> TensorEntry:
    if not name:
        raise _corrupt("names", "empty tensor name")
    if not isinstance(value, dict) or set(value) != {"dtype", "shape", "data_offsets"}:
        raise _corrupt("fields", f"tensor {name!r} must have exactly dtype, shape, data_offsets", tensor=name)
    dtype, shape, offsets = value["dtype"], value["shape"], value["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise _corrupt("dtype", f"tensor {name!r} has unsupported dtype {dtype!r}", tensor=name)
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(_is_int(d) and d >= 0 for d in shape):
        raise _corrupt("shape", f"tensor {name!r} has an invalid shape", tensor=name)
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) and o >= 0 for o in offsets):
        raise _corrupt("offsets", f"tensor {name!r} has invalid data_offsets", tensor=name)
    begin, end = offsets
    if end < begin:
        raise _corrupt("offsets", f"tensor {name!r} ends before it begins", tensor=name)
    if math.prod(shape) * DTYPES[dtype].itemsize != end - begin:
        raise _corrupt("size", f"tensor {name!r}: shape and dtype disagree with its byte range", tensor=name)
    return TensorEntry(name, dtype, tuple(shape), begin, end)


def _check_tiling(entries: Sequence[TensorEntry], data_size: int, require_alignment: bool) -> None:
    cursor = 0
    for item in sorted(entries, key=lambda e: (e.begin, e.end)):
        if item.begin != cursor:
            rule = "overlap" if item.begin < cursor else "gap"
            raise _corrupt(
                rule, f"tensor {item.name!r} begins at {item.begin}, expected {cursor}", tensor=item.name
            )
        if require_alignment and item.begin % DTYPES[item.dtype].itemsize:
            raise _corrupt("alignment", f"tensor {item.name!r} is not aligned to its dtype", tensor=item.name)
        cursor = item.end
    if cursor != data_size:
        rule = "bounds" if cursor > data_size else "trailing"
        raise _corrupt(rule, f"tensors cover {cursor} bytes but the data section holds {data_size}")


def parse_header(
    head: bytes | bytearray | memoryview,
    file_size: int,
    *,
    require_alignment: bool = True,
    max_header_bytes: int = MAX_HEADER_BYTES,
) -> Header:
    """Validate a safetensors header against the size of its file.

    ``head`` must hold at least the first ``8 + N`` bytes of the file (more is ignored). Raises
    ``ManifestCorrupt`` for any violation: length beyond ``max_header_bytes`` or the file, bad
    UTF-8/JSON, duplicate keys, unknown dtypes, bad shapes, offsets out of bounds, overlapping,
    gapped or unaligned (``require_alignment``: data section 8-aligned, each tensor aligned to
    its item size), byte ranges that disagree with shape x dtype, or bytes after the last tensor.
    """
    if not _is_int(file_size) or not _is_int(max_header_bytes):
        raise _corrupt("input", "file_size and max_header_bytes must be integers")
    try:
        head = bytes(memoryview(head)[: 8 + max(0, min(max_header_bytes, file_size))])
    except TypeError:
        raise _corrupt("input", "header bytes are not a buffer") from None
    if file_size < 8 or len(head) < 8:
        raise _corrupt("length", "file too short for a header length")
    (length,) = _LENGTH.unpack_from(head)
    if length > max_header_bytes:
        raise _corrupt("length", f"header length {length} exceeds {max_header_bytes}", length=length)
    if 8 + length > file_size:
        raise _corrupt("length", f"header length {length} runs past the end of the file", length=length)
    if len(head) < 8 + length:
        raise _corrupt("length", "not enough header bytes supplied", length=length)
    data_offset = 8 + length
    if require_alignment and data_offset % 8:
        raise _corrupt("alignment", "data section does not start 8-byte aligned")
    document = _decode_json(head[8:data_offset])
    metadata = _metadata(document.pop("__metadata__")) if "__metadata__" in document else None
    entries = tuple(_entry(name, value) for name, value in sorted(document.items()))
    _check_tiling(entries, file_size - data_offset, require_alignment)
    return Header(entries, metadata, data_offset)


def pread_exact(fd: int, size: int, offset: int) -> bytes:
    """Up to ``size`` bytes of ``fd`` from ``offset`` (pread until done; shorter only at EOF)."""
    chunks: list[bytes] = []
    while size > 0:
        chunk = os.pread(fd, size, offset)
        if not chunk:
            break
        chunks.append(chunk)
        size -= len(chunk)
        offset += len(chunk)
    return b"".join(chunks)


def read_header(
    source: int | str | os.PathLike[str],
    *,
    require_alignment: bool = True,
    max_header_bytes: int = MAX_HEADER_BYTES,
) -> Header:
    """Read and validate only the header of a file (a path, opened O_NOFOLLOW, or an open fd).

    Uses ``os.pread``, so an fd's offset is untouched. I/O errors propagate as ``OSError``;
    malformed content raises ``ManifestCorrupt``.
    """
    if isinstance(source, int):
        return _read_header_fd(source, require_alignment, max_header_bytes)
    fd = os.open(Path(source), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        return _read_header_fd(fd, require_alignment, max_header_bytes)
    finally:
        os.close(fd)


def _read_header_fd(fd: int, require_alignment: bool, max_header_bytes: int) -> Header:
    file_size = os.fstat(fd).st_size
    prefix = pread_exact(fd, 8, 0)
    if len(prefix) < 8:
        raise _corrupt("length", "file too short for a header length")
    (length,) = _LENGTH.unpack(prefix)
    if length > max_header_bytes or 8 + length > file_size:
        return parse_header(
            prefix, file_size, require_alignment=require_alignment, max_header_bytes=max_header_bytes
        )
    head = prefix + pread_exact(fd, length, 8)
    return parse_header(
        head, file_size, require_alignment=require_alignment, max_header_bytes=max_header_bytes
    )


def plan_file(
    specs: Sequence[tuple[str, str, Sequence[int]]],
    metadata: Mapping[str, str] | None = DEFAULT_METADATA,
) -> tuple[bytes, tuple[TensorEntry, ...], int]:
    """Lay out ``(name, dtype code, shape)`` specs as one safetensors file.

    Returns ``(head, entries, file_size)``: ``head`` is the complete ``8 + N`` byte prefix, the
    entries are sorted by name, and the result is deterministic for the same specs in any order.
    Raises ``ValueError`` for an unknown dtype, a duplicate or empty name or a negative dimension
    (a programming error of the caller, not a corrupt file).
    """
    names = [name for name, _, _ in specs]
    if len(set(names)) != len(names) or not all(
        isinstance(n, str) and n and n != "__metadata__" for n in names
    ):
        raise ValueError("tensor names must be unique, non-empty strings")
    for name, dtype, shape in specs:
        if dtype not in DTYPES:
            raise ValueError(f"tensor {name!r}: unsupported dtype {dtype!r}")
        if not all(_is_int(d) and d >= 0 for d in shape):
            raise ValueError(f"tensor {name!r}: invalid shape {tuple(shape)!r}")
    # Larger items first: every size is a multiple of its item size and item sizes are powers of
    # two, so each tensor then starts aligned for its own dtype.
    order = sorted(specs, key=lambda s: (-DTYPES[s[1]].itemsize, s[0]))
    entries: list[TensorEntry] = []
    cursor = 0
    for name, dtype, shape in order:
        size = math.prod(shape) * DTYPES[dtype].itemsize
        entries.append(TensorEntry(name, dtype, tuple(int(d) for d in shape), cursor, cursor + size))
        cursor += size
    document: dict[str, Any] = {
        e.name: {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [e.begin, e.end]} for e in entries
    }
    if metadata is not None:
        document["__metadata__"] = dict(metadata)
    raw = json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")
    raw += b" " * (-(8 + len(raw)) % 8)
    head = _LENGTH.pack(len(raw)) + raw
    return head, tuple(sorted(entries, key=lambda e: e.name)), len(head) + cursor
