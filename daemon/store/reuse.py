"""Reusing tensors of a committed revision in a new publication, instead of writing them again.

A publisher that updates a model often changes only some tensors. It may name a *base* artifact
(the channel's current revision) and the tensors that are equal to the base's: hwrd then takes
those tensors' bytes from the base's own payload files, and their digests from the base's
manifest, and the publisher never writes them. ``open_reuse`` (at begin) opens the base's
payloads and checks each named tensor against the new spec (dtype and shape); ``fill`` (once the
writer is proven gone from a file: ``prehash``) copies the reused ranges into the staging file
in the kernel (``copy_file_range``, no user-space copy) and reports their digests.

Why integrity still holds: the bytes served for a reused tensor are the base's bytes, copied by
hwrd from the base's own immutable files (0444, in the daemon's private root, re-checked by
``fstat`` against the base's validated fingerprints when opened), never anything the publisher
wrote or claimed; the publisher's claim that they are equal only chooses WHICH bytes go there
(a wrong claim publishes the base's bytes for that tensor, which the publisher could have
written itself). Their digests are the ones the base was committed with, exactly as serving the
base trusts them; a payload corrupted on disk since is caught by ``verify``/scrub for both
artifacts, as it would be for the base alone. The file digest is still computed over the whole
file, copied bytes included, unless the file is byte for byte one of the base's files: every
tensor reused and the header identical (then each tensor sits at the same offset, and the file's
digest is the base file's). Limits: the copy costs what writing would (new page cache pages);
what it saves is the publisher's write and hwrd's hashing of those bytes; a base evicted after
``open_reuse`` is still read through the descriptors opened then.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from hwr.client.errors import InvalidRequest
from hwr.client.manifest import TensorRecord
from hwr.client.safetensors_header import read_header
from hwr.daemon.store.inspection import ArtifactRecord
from hwr.daemon.store.staging import PayloadPlan, StagedTensor

__all__ = ["MAX_REUSED", "ReuseSource", "open_reuse"]

#: The most tensors one publication may name for reuse (bounds the request).
MAX_REUSED = 1 << 20


@dataclass
class ReuseSource:
    """The base of a publication's reused tensors: its payloads open read-only, and where each
    reused tensor lies in them. ``close`` is idempotent."""

    base_key: str
    tensors: dict[str, TensorRecord]  # reused name -> the base's record (file, digest)
    offsets: dict[str, int]  # reused name -> absolute offset in its base file
    heads: dict[str, bytes]  # base file name -> its header bytes (data offset long)
    file_sha256: dict[str, str]  # base file name -> digest of the whole file
    file_sizes: dict[str, int]
    fds: dict[str, int] = field(default_factory=dict)  # base file name -> read-only descriptor

    def close(self) -> None:
        fds, self.fds = self.fds, {}
        for fd in fds.values():
            os.close(fd)

    def whole_file(self, plan: PayloadPlan) -> str | None:
        """The base file that ``plan``'s file will be byte for byte, or None: every tensor of
        the plan reused, and that base file's header equal to the plan's (same tensors at the
        same offsets, same size)."""
        names = [e.name for e in plan.entries]
        if not names or any(n not in self.tensors for n in names):
            return None
        base = self.tensors[names[0]].file
        if self.heads.get(base) != plan.head or self.file_sizes.get(base) != plan.size:
            return None
        return base if all(self.tensors[n].file == base for n in names) else None

    def fill(self, plan: PayloadPlan, fd: int) -> tuple[str | None, dict[str, str]]:
        """Copy the reused tensors of ``plan``'s file into it (``fd``: writable) and return
        (the whole file's digest when it is one of the base's files, else None; the reused
        tensors' digests)."""
        whole = self.whole_file(plan)
        start = len(plan.head)
        if whole is not None:
            _copy(self.fds[whole], start, fd, start, plan.size - start)
            return self.file_sha256[whole], {e.name: self.tensors[e.name].sha256 for e in plan.entries}
        digests = {}
        for entry in plan.entries:
            record = self.tensors.get(entry.name)
            if record is None:
                continue
            _copy(self.fds[record.file], self.offsets[entry.name], fd, start + entry.begin, entry.nbytes)
            digests[entry.name] = record.sha256
        return None, digests

    def covers(self, plan: PayloadPlan) -> bool:
        return any(e.name in self.tensors for e in plan.entries)


def open_reuse(record: ArtifactRecord, fds: Sequence[tuple[str, int]], names: Sequence[str],
               specs: Mapping[str, StagedTensor]) -> ReuseSource:
    """The ``ReuseSource`` of ``names`` in the base ``record`` whose payloads are ``fds`` (from
    ``RecordCache.open_payloads``; taken: closed by the source, or here on failure). Raises
    ``InvalidRequest`` for a name the new publication does not have, or whose dtype or shape
    differ from the base's."""
    source = ReuseSource(record.key, {}, {}, {}, {}, {}, dict(fds))
    try:
        if len(names) > MAX_REUSED or len(set(names)) != len(names):
            raise InvalidRequest("reused tensor names must be unique", details={"field": "reuse"})
        by_name = {t.name: t for t in record.manifest.tensors}
        for name in names:
            spec, base = specs.get(name), by_name.get(name)
            if spec is None or base is None:
                raise InvalidRequest(f"tensor {str(name)[:200]!r} is not in both the publication and its base",
                                     details={"tensor": str(name)[:200], "base": record.key})
            if base.dtype != spec.info.torch_name or tuple(base.shape) != tuple(spec.shape):
                raise InvalidRequest(f"tensor {name!r} differs from the base's in dtype or shape",
                                     details={"tensor": name[:200], "base": record.key})
            source.tensors[name] = base
        for file_record in record.manifest.files:
            fd = source.fds[file_record.name]
            header = read_header(fd)
            source.heads[file_record.name] = os.pread(fd, header.data_offset, 0)
            source.file_sha256[file_record.name] = file_record.sha256
            source.file_sizes[file_record.name] = file_record.size
            for tensor in record.manifest.tensors_in(file_record.name):
                if tensor.name in source.tensors:
                    source.offsets[tensor.name] = header.data_offset + header.entry(tensor.storage_key).begin
    except BaseException:
        source.close()
        raise
    return source


def _copy(src: int, src_offset: int, dst: int, dst_offset: int, nbytes: int) -> None:
    """``nbytes`` from ``src`` to ``dst`` in the kernel (``copy_file_range``; it may copy less
    than asked per call)."""
    while nbytes > 0:
        done = os.copy_file_range(src, dst, nbytes, src_offset, dst_offset)
        if done <= 0:
            raise OSError("copy_file_range copied nothing: the base file is shorter than its manifest says")
        src_offset += done
        dst_offset += done
        nbytes -= done
