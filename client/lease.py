"""A lease on an artifact: read-only shared mappings of its payload files, as CPU tensors.

Built by ``Client.acquire``: the daemon hands over read-only descriptors on the peer socket; the
lease maps each one (``PROT_READ``, ``MAP_SHARED``; or ``MAP_PRIVATE`` copy-on-write when asked),
closes the descriptor, re-parses every safetensors header from the mapping's file and checks it
against the manifest the daemon sent, then exposes zero-copy tensor views.

Per-process cache (the acquire hot path): the header check's result, a *view plan* (per tensor:
dtype, element count, byte offset, shape, stride), is kept per (device, inode, size, mtime,
ctime) of the payload file and the manifest object it was checked against. Payloads are
immutable files, and a write, truncate, chmod or replacement changes one of those ``fstat``
fields, so a hit proves the header bytes are the ones checked.

Views: every tensor gets its own storage over exactly its bytes of the mapping
(``torch.frombuffer`` over one ``memoryview`` of the file at the tensor's offset, then one
``as_strided`` unless the tensor is 1-D), never a slice of one storage spanning the file.
Consumers rely on this: vLLM-Omni's final-layout restorer refuses two tensors whose
``(untyped_storage().data_ptr(), nbytes)`` are equal ("aliases"), and a storage per tensor also
bounds what a consumer that walks ``untyped_storage()`` can reach to that tensor's own bytes.
The cost, against slices of one shared storage: one more torch call (about a microsecond) per
tensor of two or more dimensions (``benchmarks/lease_views.py``).

Contract:
- ``tensors``: name -> CPU tensor aliasing shared page-cache pages (no copy), each backed by its
  own storage of exactly its bytes (``storage_offset() == 0``). With the default read-only
  mapping, writing into one faults (SIGSEGV) instead of corrupting other workers' weights; ask
  for ``copy_on_write=True`` to get private, writable pages instead.
- ``mapped_regions``: one page-aligned region per payload file, for ``cudaHostRegister`` (empty once closed).
- ``close()`` is idempotent and thread-safe: it tells the daemon (only from the process that
  acquired the lease: a forked child never releases its parent's lease) and drops the lease's
  references. The mapping itself is unmapped when the last tensor view is garbage collected, so a
  stale view never points at unmapped memory. Limit: while such views live, the pages stay
  mapped and the daemon's eviction treats the artifact as in use (by design).
- Not picklable: a lease is bound to this process's mappings.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import threading
import warnings
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import NamedTuple

import torch

from hwr.client.artifact import validate_payload_header
from hwr.client.carrier import MappedRegion
from hwr.client.errors import HwrError, LeaseClosed, ManifestCorrupt
from hwr.client.manifest import Manifest
from hwr.client.safetensors_header import dtype_by_torch_name, read_header
from hwr.client.wire import close_fds

__all__ = ["Lease", "MappedLease"]

log = logging.getLogger("hwr.client")
PAGE = mmap.PAGESIZE


class MappedLease:
    """What every lease shares: mappings of daemon-passed descriptors and one idempotent close.

    Subclasses (``Lease`` for artifacts, ``CheckpointLease`` for canonical checkpoints) decide
    how each file is validated and viewed, through ``_map_files`` and ``_attach``; the lifecycle
    (close once, never from a forked child, views outlive the lease safely, not picklable) is
    this class's.
    """

    def __init__(self, *, lease_id: str, key: str, release: Callable[[str], None]) -> None:
        self._lock = threading.Lock()
        self._closed = False
        self._maps: list[mmap.mmap] = []
        self._bases: list[torch.Tensor] = []
        self._lease_id = lease_id
        self._key = key
        self._release = release
        self._owner_pid = os.getpid()
        self._tensors: dict[str, torch.Tensor] = {}
        self._regions: tuple[MappedRegion, ...] = ()
        self._view = MappingProxyType(self._tensors)

    def _map_files(self, fds: list[int], expected: int, map_one: Callable[[int, int], MappedRegion]) -> None:
        """Map each descriptor with ``map_one(index, fd)``; descriptors are closed in every case.

        On any failure the lease unmaps what it mapped, tells the daemon, and re-raises.
        """
        regions: list[MappedRegion] = []
        try:
            if len(fds) != expected:
                raise ManifestCorrupt(f"daemon sent {len(fds)} descriptors for {expected} files")
            for index, fd in enumerate(fds):
                regions.append(map_one(index, fd))
        except BaseException:
            self._teardown_local()
            self._tell_daemon()
            raise
        finally:
            close_fds(fds)
        self._regions = tuple(regions)
        self._view = MappingProxyType(self._tensors)

    def _attach(self, fd: int, size: int, name: str, *, copy_on_write: bool,
                populate: bool) -> tuple[memoryview, MappedRegion]:
        """Map one file; return the memoryview that every tensor view of it must be built on."""
        mapped = _map(fd, size, copy_on_write=copy_on_write, populate=populate)
        self._maps.append(mapped)
        buffer = memoryview(mapped)
        base = _base_view(buffer)
        self._bases.append(base)
        return buffer, MappedRegion(name, base.data_ptr(), -(-size // PAGE) * PAGE, not copy_on_write)

    @property
    def key(self) -> str:
        return self._key

    @property
    def lease_id(self) -> str:
        return self._lease_id

    @property
    def tensors(self) -> Mapping[str, torch.Tensor]:
        if self._closed:
            raise_closed()
        return self._view

    @property
    def mapped_regions(self) -> tuple[MappedRegion, ...]:
        """One region per payload file; empty once the lease is closed (the addresses are no
        longer mapped: reading one would fault)."""
        return () if self._closed else self._regions

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def nbytes(self) -> int:
        return sum(region.length for region in self._regions)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._teardown_local()
        if os.getpid() == self._owner_pid:
            self._tell_daemon()

    def rebind(self, lease_id: str) -> bool:
        """Bind this lease to ``lease_id`` (the client's reattach after a daemon restart); False,
        nothing changed, when it is already closed. Atomic with ``close``, which releases
        whichever id the lease holds when it closes."""
        with self._lock:
            if self._closed:
                return False
            self._lease_id = lease_id
            return True

    def _tell_daemon(self) -> None:
        try:
            self._release(self._lease_id)
        except HwrError as exc:
            # The daemon or the session is gone: the lease ended with the session already.
            log.debug("release of lease %s not confirmed: %s", self._lease_id, exc)

    def _teardown_local(self) -> None:
        self._tensors = {}
        self._view = MappingProxyType(self._tensors)
        self._bases = []
        maps, self._maps = self._maps, []
        for mapped in maps:
            # BufferError: tensor views still alias the mapping; it is unmapped once they die.
            with contextlib.suppress(BufferError):
                mapped.close()

    def __enter__(self) -> MappedLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __reduce__(self) -> object:
        raise TypeError(f"a {type(self).__name__} is bound to this process's mappings and cannot be pickled")

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._tensors)} tensors"
        return f"{type(self).__name__}(key={self._key[:12]}…, {self.nbytes} bytes, {state})"


class Lease(MappedLease):
    """A lease on a committed artifact (see the module contract)."""

    def __init__(
        self,
        *,
        lease_id: str,
        key: str,
        manifest: Manifest,
        fds: list[int],
        release: Callable[[str], None],
        copy_on_write: bool = False,
        populate: bool = False,
    ) -> None:
        super().__init__(lease_id=lease_id, key=key, release=release)
        self.manifest = manifest
        file_ids: list[tuple[int, int]] = []

        def map_one(index: int, fd: int) -> MappedRegion:
            file_record = manifest.files[index]
            st = os.fstat(fd)
            size = st.st_size
            if size != file_record.size:
                raise ManifestCorrupt(f"payload {file_record.name!r} has the wrong size",
                                      details={"file": file_record.name})
            plan = _view_plan(fd, st, manifest, file_record)
            buffer, region = self._attach(fd, size, file_record.name, copy_on_write=copy_on_write,
                                          populate=populate)
            self._tensors.update(_views(plan, buffer))
            file_ids.append((st.st_dev, st.st_ino))
            return region

        self._map_files(fds, len(manifest.files), map_one)
        #: (device, inode) of each payload in manifest order (the client's reattach check).
        self.file_ids = tuple(file_ids)

    @property
    def nbytes(self) -> int:
        return sum(f.size for f in self.manifest.files)


class _Plan(NamedTuple):
    """How to view one checked payload file: per tensor with bytes, (name, dtype, element count,
    byte offset in the file, shape and stride, or None for a 1-D tensor, which ``frombuffer``
    already returns in its final shape); zero-byte tensors get fresh empties."""

    views: tuple[tuple[str, torch.dtype, int, int, tuple[tuple[int, ...], tuple[int, ...]] | None], ...]
    empty: tuple[tuple[str, tuple[int, ...], torch.dtype], ...]


_PLANS: dict[tuple[int, int, int, int, int], tuple[Manifest, object, _Plan]] = {}
_PLANS_LOCK = threading.Lock()


def _view_plan(fd: int, st: os.stat_result, manifest: Manifest, file_record: object) -> _Plan:
    """The checked view plan of one payload (see the module docstring's cache)."""
    ident = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    cached = _PLANS.get(ident)
    if cached is not None and cached[0] is manifest and cached[1] == file_record:
        return cached[2]
    header = read_header(fd)
    pairs = validate_payload_header(header, manifest, file_record)  # type: ignore[arg-type]
    views, empty = [], []
    for record, entry in pairs:
        info = dtype_by_torch_name(record.dtype)
        offset = header.data_offset + entry.begin
        shape, stride = tuple(record.shape), tuple(record.stride)
        if record.nbytes == 0:
            empty.append((record.name, shape, info.torch_dtype))
        elif offset + record.nbytes > st.st_size:
            raise ManifestCorrupt(f"tensor {record.name!r} lies outside its payload file",
                                  details={"tensor": record.name})
        else:
            # A 1-D tensor needs no as_strided (about a microsecond each, half of a DiT's tensors).
            layout = None if len(shape) == 1 else (shape, stride)
            views.append((record.name, info.torch_dtype, record.nbytes // info.itemsize, offset, layout))
    plan = _Plan(tuple(views), tuple(empty))
    with _PLANS_LOCK:
        if len(_PLANS) > 4096:
            _PLANS.clear()
        _PLANS[ident] = (manifest, file_record, plan)
    return plan


def _views(plan: _Plan, buffer: memoryview) -> dict[str, torch.Tensor]:
    """One tensor per plan entry, each over its own storage of exactly its bytes of ``buffer``
    (the memoryview of the mapped file; each storage keeps a reference to it, so the mapping
    cannot be closed under a live tensor). ``as_strided`` is bounds-checked by torch against that
    storage, so a plan can never reach a neighbour's bytes."""
    out: dict[str, torch.Tensor] = {}
    frombuffer = torch.frombuffer
    with warnings.catch_warnings():
        # The read-only mapping protects the pages; torch only warns that it cannot.
        warnings.filterwarnings("ignore", message=".*not writable.*", category=UserWarning)
        for name, dtype, count, offset, layout in plan.views:
            flat = frombuffer(buffer, dtype=dtype, count=count, offset=offset)
            out[name] = flat if layout is None else flat.as_strided(*layout)
    for name, shape, dtype in plan.empty:
        out[name] = torch.empty(shape, dtype=dtype)
    return out


def raise_closed() -> None:
    raise LeaseClosed("the lease is closed")


def _map(fd: int, size: int, *, copy_on_write: bool, populate: bool) -> mmap.mmap:
    if copy_on_write:
        flags, prot = mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE
    else:
        flags, prot = mmap.MAP_SHARED, mmap.PROT_READ
    if populate:
        # Pre-fault the page tables from the page cache so first touches are not minor faults.
        flags |= getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(fd, size, flags=flags, prot=prot)


def _base_view(buffer: memoryview) -> torch.Tensor:
    """A uint8 view of a whole mapped file (its address is the file's mapped region)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not writable.*", category=UserWarning)
        # Through a memoryview: the tensor's storage then holds a buffer export of the mmap, so
        # ``mmap.close()`` refuses (BufferError) while any view built on ``buffer`` lives.
        # (``frombuffer(mapped)`` itself keeps only a reference: close() would unmap under views.)
        return torch.frombuffer(buffer, dtype=torch.uint8)
