"""Binding a payload file's safetensors header to its manifest, and zero-copy tensor views.

Contract: ``validate_payload_header`` accepts a header only when it describes exactly the
manifest's tensors for that file (same storage keys, dtype, shape, byte count) and the file size
the manifest records; ``tensor_views`` then makes read-only-by-convention CPU tensors that alias
the caller's buffer (no copy). Every inconsistency raises ``ManifestCorrupt``.

Limits: neither function hashes bytes (validation happens once at publication and on demand in
the daemon). The views alias the buffer: they are valid only while it stays mapped, and torch
cannot mark a tensor read-only, so the mapping itself must be read-only (``PROT_READ``) to make a
write fault instead of corrupting shared pages.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING

from hwr.client.errors import ManifestCorrupt
from hwr.client.manifest import FileRecord, Manifest, TensorRecord
from hwr.client.safetensors_header import DTYPES, Header, TensorEntry, dtype_by_torch_name

if TYPE_CHECKING:
    import torch

__all__ = ["tensor_views", "validate_payload_header"]


def _mismatch(message: str, **details: object) -> ManifestCorrupt:
    return ManifestCorrupt(f"payload header disagrees with the manifest: {message}", details=dict(details))


def validate_payload_header(
    header: Header, manifest: Manifest, file_record: FileRecord
) -> list[tuple[TensorRecord, TensorEntry]]:
    """Pair each manifest tensor stored in ``file_record`` with its header entry, checking both.

    Returns the pairs in manifest (name) order. The header's tensors must be exactly the
    manifest's storage keys for that file; extra or missing tensors are corruption.
    """
    if file_record not in manifest.files:
        raise _mismatch(f"file {file_record.name!r} is not in the manifest", file=file_record.name)
    if header.file_size != file_record.size:
        raise _mismatch(
            f"{file_record.name!r} header covers {header.file_size} bytes, manifest says {file_record.size}",
            file=file_record.name,
        )
    entries = {entry.name: entry for entry in header.entries}
    records = manifest.tensors_in(file_record.name)
    if set(entries) != {record.storage_key for record in records}:
        raise _mismatch(f"tensor set of {file_record.name!r} differs", file=file_record.name)
    pairs: list[tuple[TensorRecord, TensorEntry]] = []
    for record in records:
        entry = entries[record.storage_key]
        if DTYPES[entry.dtype].torch_name != record.dtype:
            raise _mismatch(f"dtype of {record.name!r}", tensor=record.name)
        if entry.shape != record.shape:
            raise _mismatch(f"shape of {record.name!r}", tensor=record.name)
        if entry.nbytes != record.nbytes:
            raise _mismatch(f"nbytes of {record.name!r}", tensor=record.name)
        pairs.append((record, entry))
    return pairs


def tensor_views(
    buffer: memoryview | bytes | bytearray | object,
    header: Header,
    records: Sequence[TensorRecord],
) -> dict[str, torch.Tensor]:
    """Map each record to a tensor aliasing ``buffer`` (a whole payload file, e.g. an ``mmap``).

    ``records`` are manifest tensors of this file (typically the first items of
    ``validate_payload_header``'s pairs). Shape, dtype and stride come from the record and are
    re-checked against the header and the buffer's length. Zero-element tensors are fresh empty
    tensors (there are no bytes to alias).
    """
    import torch  # here, not at the top: hwrd validates headers with this module and never loads torch

    view = memoryview(buffer)  # type: ignore[arg-type]
    if view.nbytes < header.file_size:
        raise _mismatch(f"buffer holds {view.nbytes} bytes, the header needs {header.file_size}")
    entries = {entry.name: entry for entry in header.entries}
    tensors: dict[str, torch.Tensor] = {}
    for record in records:
        entry = entries.get(record.storage_key)
        info = dtype_by_torch_name(record.dtype)
        if entry is None or entry.dtype != info.code or entry.shape != record.shape:
            raise _mismatch(f"tensor {record.name!r} does not match its header entry", tensor=record.name)
        if entry.nbytes != record.nbytes:
            raise _mismatch(f"nbytes of {record.name!r}", tensor=record.name)
        numel = record.nbytes // info.itemsize
        if numel == 0:
            tensors[record.name] = torch.empty(record.shape, dtype=info.torch_dtype)
            continue
        with warnings.catch_warnings():
            # torch warns that a non-writable buffer gives a tensor it cannot protect; the
            # read-only mapping is what protects it (see the module's limits).
            warnings.filterwarnings("ignore", message=".*not writable.*", category=UserWarning)
            flat = torch.frombuffer(
                view, dtype=info.torch_dtype, count=numel, offset=header.data_offset + entry.begin
            )
        tensors[record.name] = flat.as_strided(record.shape, record.stride)
    return tensors
