"""One revision of the weights as the backend's host source, and everything built over it.

A ``Revision`` owns what streaming needs from one lease (or, for the revision ``enable()``
starts on, possibly the module's own tensors):

- ``lease``: the ``HostLease`` (``None`` for module tensors);
- ``hosts`` / ``resident``: per streamed / resident block, the host tensor of each of its
  ``TensorRef``s (the lease's view for parameters and persistent buffers, the module's own
  tensor for non-persistent buffers, which no checkpoint holds);
- ``rest``: the lease's views of the model's non-block tensors (``contract.collect_rest``);
- ``shards``: the AllGather shard source (``LeaseShards``: views of this rank's pieces;
  ``PrivateShards``: copies in an arena);
- ``registration``: the ``cudaHostRegister`` of the lease ranges this rank reads (CUDA);
- ``arenas``: exact-size host memory for private shards and transfer staging (``arena``).

The building functions are the ones ``enable()`` runs (steps SHARD and REGISTER_HOST, and the
staging of ALLOCATE), so a live update gets exactly enable's choices and fallbacks: a lease
whose ranges cannot be registered is copied through pinned staging, on the switch as at
enable. ``transfer_kind`` is the pure decision of which transfer streams a revision.

``close()`` releases in the one safe order: drop the views (shards, hosts), unregister, unmap
the arenas, close the lease. If unregistration fails, the lease (and a still-registered arena)
stays open, because unmapping registered memory is undefined behaviour; ``close`` returns the
failures and may be called again later to retry. The caller must first make sure that no copy,
gather or compute still reads the revision's memory (drain the lanes).
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from hwr.client.carrier import HostLease
from hwr.dlo_backend.arena import HostArena, arena_bytes
from hwr.dlo_backend.contract import ModelTensor
from hwr.dlo_backend.layout import BlockLayout
from hwr.dlo_backend.paging import populate
from hwr.dlo_backend.registration import HostRegistration, register_regions
from hwr.dlo_backend.shards import LeaseShards, PrivateShards, ShardSource, build_shard, input_nbytes
from hwr.dlo_backend.sources import BlockSource

__all__ = [
    "Revision",
    "RevisionContext",
    "TransferKind",
    "key_digest",
    "lease_hosts",
    "prefault",
    "register_host",
    "shard",
    "stage",
    "transfer_kind",
]


def key_digest(key: str | None) -> bytes:
    """32 bytes naming a revision in the ranks' agreement (zeros for the module's own tensors)."""
    return bytes(32) if key is None else hashlib.sha256(key.encode()).digest()


class TransferKind(enum.Enum):
    BIND = "bind"
    DIRECT = "direct"
    STAGED = "staged"
    ALLGATHER = "allgather"


@dataclass(frozen=True)
class RevisionContext:
    """What the backend fixed at ``enable()`` that every revision is built against."""

    device: torch.device
    layouts: tuple[BlockLayout, ...]
    world: int = 1
    rank: int = 0
    allgather: bool = False
    cpu_zero_copy: bool = True
    allgather_host_copy: bool = False
    registration_limit_gib: float = 0.0

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


@dataclass(eq=False)
class Revision:
    """The host side of one revision (see the module docstring); ``close`` is idempotent."""

    lease: HostLease | None
    hosts: list[list[torch.Tensor]] = field(default_factory=list)
    resident: list[list[torch.Tensor]] = field(default_factory=list)
    rest: dict[str, torch.Tensor] = field(default_factory=dict)
    shards: ShardSource | None = None
    registration: HostRegistration | None = None
    arenas: list[HostArena] = field(default_factory=list)
    staging: HostArena | None = None
    closed: bool = False

    @property
    def key(self) -> str | None:
        return None if self.lease is None else self.lease.key

    @property
    def digest(self) -> bytes:
        return key_digest(self.key)

    @property
    def registered(self) -> bool:
        return self.registration is not None and self.registration.complete

    def arena(self, sizes: Iterable[int], device: torch.device) -> HostArena:
        """Exact-size host memory for buffers of ``sizes``, pinned for a CUDA ``device``."""
        made = HostArena(arena_bytes(sizes), device=device if device.type == "cuda" else None)
        self.arenas.append(made)
        return made

    def drop_views(self) -> None:
        """Forget every view of the lease (hosts, rest, shard pieces); the lease stays open."""
        close = getattr(self.shards, "close", None)
        if close is not None:
            close()
        self.shards = None
        self.hosts, self.resident, self.rest = [], [], {}
        self.staging = None

    def close(self) -> list[str]:
        """Release everything in order; the failures (empty when all of it was released)."""
        self.drop_views()
        failures: list[str] = []
        if self.registration is not None:
            failures = self.registration.close()
            if not failures:
                self.registration = None
        kept: list[HostArena] = []
        for arena in self.arenas:
            arena_failures = arena.close()
            if arena_failures:
                failures.extend(arena_failures)
                kept.append(arena)
        self.arenas = kept
        if self.registration is None and self.lease is not None:
            self.lease.close()
        self.closed = not failures
        return failures


def lease_hosts(sources: Sequence[BlockSource], tensors: Mapping[str, torch.Tensor]) -> list[list[torch.Tensor]]:
    """Each block's host tensors taken from a checked revision's ``tensors`` (the lease's views)."""
    return [
        [tensors[ref.name] if ref.persistent else ref.backing for ref in source.refs] for source in sources
    ]


def rest_views(rest: Sequence[ModelTensor], tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {ref.name: tensors[ref.name] for ref in rest}


def shard(revision: Revision, ctx: RevisionContext) -> None:
    """With AllGather: this rank's shard source over ``revision.hosts`` (enable's step SHARD).

    Read in place (``LeaseShards``) from a lease unless ``allgather_host_copy``; otherwise
    private copies in one arena (pinned on CUDA).
    """
    if not ctx.allgather:
        return
    if revision.lease is not None and not ctx.allgather_host_copy:
        revision.shards = LeaseShards(ctx.layouts, revision.hosts, ctx.rank)
        return
    arena = revision.arena((g.shard_nbytes for layout in ctx.layouts for g in layout.groups), ctx.device)
    shards = [
        build_shard(layout, hosts, ctx.rank, pin=ctx.cuda, arena=arena)
        for layout, hosts in zip(ctx.layouts, revision.hosts, strict=True)
    ]
    revision.shards = PrivateShards(shards, ctx.layouts)


def register_host(revision: Revision, ctx: RevisionContext, device_index: int) -> None:
    """CUDA: register the lease ranges this rank reads (enable's step REGISTER_HOST).

    Rank-local: every mapped region of the lease; AllGather from the lease: only this rank's
    own pieces. ``None`` (nothing registered) when it fails: ``stage`` then adds staging.
    """
    lease = revision.lease
    if not ctx.cuda or lease is None:
        return
    if not ctx.allgather:
        revision.registration = register_regions(lease.mapped_regions, ctx.registration_limit_gib, device=device_index)
    elif isinstance(revision.shards, LeaseShards):
        regions = revision.shards.regions(lease.mapped_regions)
        revision.registration = register_regions(regions, ctx.registration_limit_gib, device=device_index)


def transfer_kind(ctx: RevisionContext, revision: Revision) -> tuple[TransferKind, bool]:
    """Which transfer streams ``revision``, and whether it needs pinned staging (pure)."""
    if ctx.allgather:
        staging = ctx.cuda and isinstance(revision.shards, LeaseShards) and not revision.registered
        return TransferKind.ALLGATHER, staging
    if not ctx.cuda:
        return (TransferKind.BIND if ctx.cpu_zero_copy else TransferKind.DIRECT), False
    if revision.lease is not None:
        readable = revision.registered
    else:
        readable = all(t.is_pinned() for hosts in revision.hosts for t in hosts)
    return (TransferKind.DIRECT, False) if readable else (TransferKind.STAGED, True)


def stage(revision: Revision, ctx: RevisionContext) -> None:
    """Allocate the two staging buffers' arena the revision's transfer needs (if any)."""
    kind, staging = transfer_kind(ctx, revision)
    if not staging:
        return
    if kind is TransferKind.ALLGATHER:
        size = max(input_nbytes(layout) for layout in ctx.layouts)
    else:
        size = max(layout.nbytes for layout in ctx.layouts)
    revision.staging = revision.arena([size] * 2, ctx.device)


def prefault(revision: Revision) -> None:
    """Map the pages of the lease this rank will read (``paging.populate``, best effort).

    Run where ``update`` prepares a revision, off the compute thread: otherwise the first pass
    on a new revision takes every first-touch page fault of its mapping itself (with AllGather
    only this rank's pieces, which is all it reads).
    """
    if revision.lease is None:
        return
    if isinstance(revision.shards, LeaseShards):
        tensors = [piece.source for block in revision.shards.pieces for piece in block]
    else:
        tensors = [t for hosts in revision.hosts + revision.resident for t in hosts]
    for tensor in [*tensors, *revision.rest.values()]:
        populate(tensor)
