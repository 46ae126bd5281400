"""Hashing a staging file while the rest of its publication is still being written.

A large publication for a live update is laid out in several payload files
(``staging.overlap_file_bytes``). When the writer has written every tensor of one file, it closes
its descriptor of that file and hands the file over; ``prehash`` then proves it is the sole
opener (``exclusive.open_sole``: no other process holds the file open or mapped), checks the
header and the allocation, and hashes the file and its tensors, while the writer goes on with
the next file. The commit (``sealing.seal``) takes these digests instead of hashing the file
again.

Why the digests still describe what is served: after the proof nobody but the daemon can write
the file. The writer's descriptor is gone (a mapping would have kept an open file description:
the proof refuses it), hwrd hands out no staging descriptor of a publication once a file was
handed over (``Publishing.staging_descriptors``), and the file lives in the daemon's private ``tmp/``
(0700). As a second check, ``seal`` compares the file's mtime and size with the ones recorded
here, before it installs the file. Limits: a file handed over before its last write is the
writer's loss (its bytes are what is served, and hashed); when the proof fails (a descriptor still
open), the result is None and the commit hashes that file itself (then its own proof applies).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from hwr.client.errors import HwrError, ManifestCorrupt
from hwr.daemon.store import fileio as store_io
from hwr.daemon.store.reuse import ReuseSource
from hwr.daemon.store.staging import Staging
from hwr.daemon.store.writer_bounds import allocation_ok
from hwr.daemon.system.exclusive import open_sole

__all__ = ["PreHashed", "prehash"]


@dataclass(frozen=True)
class PreHashed:
    """The digests of one handed-over staging file. ``fd``: its read-only descriptor, opened by
    the proof; whoever takes the result closes it (``seal``, or the publication's end)."""

    name: str
    fd: int
    size: int
    mtime_ns: int
    file_sha256: str
    tensor_sha256: dict[str, str]

    def unchanged(self, st: os.stat_result) -> bool:
        """The file is as it was hashed (the commit's second check)."""
        return (st.st_size, st.st_mtime_ns) == (self.size, self.mtime_ns)


def prehash(staging: Staging, index: int, reuse: ReuseSource | None = None) -> PreHashed | None:
    """Prove, check and hash file ``index`` of ``staging`` (see the module docstring); None when
    the proof or a check fails (the commit then does the work itself and reports the error).
    ``reuse``: first copy the file's reused tensors from the base (``reuse.ReuseSource.fill``:
    after the proof, so no writer can change them afterwards) and take their digests."""
    plan = staging.plans[index]
    try:
        fd = open_sole(staging.path / plan.name)
    except (HwrError, OSError):
        return None
    try:
        st = os.fstat(fd)
        if not allocation_ok(st, plan.size) or os.pread(fd, len(plan.head), 0) != plan.head:
            raise ManifestCorrupt("handed-over file resized or its header overwritten")
        file_sha: str | None = None
        known: dict[str, str] = {}
        if reuse is not None and reuse.covers(plan):
            writer = os.open(staging.path / plan.name, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                file_sha, known = reuse.fill(plan, writer)
            finally:
                os.close(writer)
            st = os.fstat(fd)
        ranges = [(e.name, len(plan.head) + e.begin, len(plan.head) + e.end) for e in plan.entries
                  if e.name not in known]
        tensor_sha = dict(known)
        if file_sha is None:
            (file_sha,), hashed = store_io.hash_ranges([(fd, plan.size, ranges)])
            tensor_sha.update(hashed)
        if os.fstat(fd).st_mtime_ns != st.st_mtime_ns:
            raise ManifestCorrupt("a handed-over file changed while it was hashed")
    except (HwrError, OSError):
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return PreHashed(plan.name, fd, st.st_size, st.st_mtime_ns, file_sha, tensor_sha)
