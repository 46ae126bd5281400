"""The layerwise offload backend: a transaction that installs streaming, and its runtime.

State table (enforced by ``enable``/``disable`` and the hooks)::

    state      | enable()                     | forward of a block       | disable()
    -----------+------------------------------+--------------------------+-----------------------
    NEW        | -> ENABLING                  | (no hooks)               | -> CLOSED (closes lease)
    ENABLING   | ok -> READY; error -> FAILED | (not reachable)          | (not reachable)
    READY      | InvalidRequest               | streams the block        | -> CLOSED (restores)
               |                              | (live updates: switched  |
               |                              |  at the model's forward) |
    POISONED   | InvalidRequest               | CollectiveStateError /   | -> CLOSED (no restore
               |                              | OffloadError             |    of streamed blocks)
    FAILED     | InvalidRequest               | (hooks removed)          | no-op
    CLOSED     | InvalidRequest               | (hooks removed)          | no-op

``enable`` runs the steps of ``EnableStep`` in order. The lease is taken first, before any
asynchronous work. With AllGather, OPEN_GROUP then creates DLO's own communicator over the
chosen group's ranks (``communicator``: DLO's collectives never share a group with the model's
or the caller's), and the ranks agree twice (``group.exchange_manifest``): at
EXCHANGE_MANIFEST on the manifest digest, after the local steps DISCOVER..VALIDATE, and at
AGREE_READY after the local steps SHARD..INSTALL_HOOKS. A rank that failed locally still joins
the exchange (reporting failure), so every rank fails together before the first gather. A
failure at PREFETCH or COMMIT (after the first gather was issued) cannot be agreed on: the
failing rank raises ``CollectiveStateError`` and its peers fail at their next gather, within the
group's timeout.

Teardown (failure rollback and ``disable``) runs in the order ``teardown`` documents.

A failed collective leaves the group in an unknown state: the backend becomes POISONED and
every further use raises ``CollectiveStateError`` (recreate the backend, reload the pipeline).
NCCL reports failures asynchronously, so a gather that stays pending for 90% of the group's
timeout is declared failed by ``watchdog.CollectiveWatchdog`` (which also aborts the group).

Inference only: streamed weights are swapped in and out under the model, so do not backprop.
"""

from __future__ import annotations

import enum
import hashlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from hwr.client.carrier import HostLease, LeaseCarrier
from hwr.client.errors import HwrError, InvalidRequest, LeaseClosed, Unsupported
from hwr.dlo_backend import group as groups
from hwr.dlo_backend import revision as revisions
from hwr.dlo_backend.communicator import DloCommunicator, open_dlo_group
from hwr.dlo_backend.contract import TensorContract, collect_rest
from hwr.dlo_backend.discovery import find_block_stacks
from hwr.dlo_backend.errors import CollectiveStateError, OffloadError
from hwr.dlo_backend.hooks import HookRegistry
from hwr.dlo_backend.lanes import CudaLane, CurrentStreamLane, InlineLane, Lane, ThreadLane
from hwr.dlo_backend.layout import BlockLayout, manifest_digest, plan_block
from hwr.dlo_backend.live import LiveUpdates
from hwr.dlo_backend.registration import HostRegistration
from hwr.dlo_backend.revision import Revision, RevisionContext, TransferKind
from hwr.dlo_backend.shards import ShardSource
from hwr.dlo_backend.slots import SlotPair, SlotState
from hwr.dlo_backend.sources import (
    SUPPORTED_QUANTIZATION,
    BlockSource,
    bind_lease,
    collect_blocks,
    require_host_memory,
    unsupported_reason,
)
from hwr.dlo_backend.stream import BlockStream
from hwr.dlo_backend.switch import RevisionSwitch
from hwr.dlo_backend.teardown import Teardown
from hwr.dlo_backend.transfer import AllGatherTransfer, DirectTransfer, HostBindTransfer, StagedTransfer, Transfer
from hwr.dlo_backend.watchdog import CollectiveWatchdog, abort_group, watchdog_timeout_s

if TYPE_CHECKING:
    from hwr.dlo_backend.arena import HostArena
    from hwr.dlo_backend.contract import ModelTensor

__all__ = ["EnableStep", "LayerwiseOffloadBackend", "OffloadOptions", "OffloadStats", "State"]

_log = logging.getLogger(__name__)


class State(enum.Enum):
    NEW = "new"
    ENABLING = "enabling"
    READY = "ready"
    POISONED = "poisoned"
    FAILED = "failed"
    CLOSED = "closed"


class EnableStep(enum.Enum):
    TAKE_LEASE = "take_lease"
    OPEN_GROUP = "open_group"
    DISCOVER = "discover"
    BIND_SOURCES = "bind_sources"
    VALIDATE = "validate"
    EXCHANGE_MANIFEST = "exchange_manifest"
    SHARD = "shard"
    REGISTER_HOST = "register_host"
    ALLOCATE = "allocate"
    INSTALL_HOOKS = "install_hooks"
    AGREE_READY = "agree_ready"
    PREFETCH = "prefetch"
    COMMIT = "commit"


@dataclass(frozen=True)
class OffloadOptions:
    """Validated-at-enable options (see ``apply_layerwise_offload`` for their meaning)."""

    device: torch.device
    blocks_attr: str | tuple[str, ...] | None = None
    use_allgather: bool = False
    group: Any = None
    dp_group: Any = None
    sp_group: Any = None
    resident_layers: int = 0
    host_registration_limit_gib: float = 0.0
    quantization: str | None = None
    cpu_zero_copy: bool = True
    allgather_host_copy: bool = False
    live_updates: bool = False


@dataclass(frozen=True)
class OffloadStats:
    """What the backend holds: bytes per slot, per streamed model, per rank shard."""

    mode: str
    world: int
    streamed_blocks: int
    resident_blocks: int
    slot_bytes: int
    block_bytes: int
    host_shard_bytes: int
    registered_bytes: int
    shard_source: str = "none"


class LayerwiseOffloadBackend(LiveUpdates, Teardown):
    """Streams a model's blocks through two device slots; ``enable`` once, ``disable`` once.

    With ``live_updates``, ``update(lease)`` switches the host source between two passes
    (``live.LiveUpdates``).
    """

    def __init__(
        self, model: nn.Module, options: OffloadOptions, host_source: LeaseCarrier | HostLease | None = None
    ) -> None:
        self.model = model
        self.options = options
        self._host_source = host_source
        self._state = State.NEW
        self._step: EnableStep | None = None
        self._revision: Revision | None = None  # the host source passes run on
        self._retired: list[Revision] = []  # revisions closed but not released yet (registered)
        self._group: DloCommunicator | None = None
        self._world = 1
        self._streamed: list[BlockSource] = []
        self._resident: list[BlockSource] = []
        self._rest: list[ModelTensor] = []
        self._layouts: list[BlockLayout] = []
        self._context: RevisionContext | None = None
        self._contract: TensorContract | None = None
        self._switch: RevisionSwitch | None = None
        self._packer: ThreadLane | None = None
        self._lanes: list[Lane] = []
        self._compute: Lane = InlineLane()
        self._slots: SlotPair | None = None
        self._transfer: Transfer | None = None
        self._hooks = HookRegistry()
        self._installed: list[BlockSource] = []
        self._committed = False
        self._stream: BlockStream | None = None
        self._watchdog: CollectiveWatchdog | None = None

    # ----------------------------------------------------------------- observation
    @property
    def _lease(self) -> HostLease | None:
        return None if self._revision is None else self._revision.lease

    @property
    def _registration(self) -> HostRegistration | None:
        return None if self._revision is None else self._revision.registration

    @property
    def _shard_source(self) -> ShardSource | None:
        return None if self._revision is None else self._revision.shards

    @property
    def _arenas(self) -> list[HostArena]:
        """Host arenas (shards, staging) of the running revision and of those not released yet."""
        held = ([] if self._revision is None else [self._revision]) + self._retired
        return [arena for revision in held for arena in revision.arenas]

    @property
    def state(self) -> State:
        if self._state is State.READY and self._stream is not None and self._stream.poisoned:
            return State.POISONED
        return self._state

    @property
    def _gathered(self) -> bool:
        return self._stream is not None and self._stream.gathered

    def slot_state(self) -> SlotState:
        """Probe: which streamed block each slot holds and which one is bound for compute."""
        return SlotState((None, None), None) if self._stream is None else self._stream.slot_state()

    def materialized_blocks(self) -> list[int]:
        """Probe: streamed blocks whose weights are currently materialized on the device."""
        return [
            i
            for i, src in enumerate(self._streamed)
            if any(ref.current().numel() > 0 for ref in src.refs if ref.original.numel() > 0)
        ]

    @property
    def stats(self) -> OffloadStats:
        world = self._world
        source = self._shard_source
        return OffloadStats(
            mode=self._transfer.mode if self._transfer is not None else "none",
            world=world,
            streamed_blocks=len(self._streamed),
            resident_blocks=len(self._resident),
            slot_bytes=self._slots.nbytes if self._slots is not None else 0,
            block_bytes=sum(layout.nbytes for layout in self._layouts),
            host_shard_bytes=source.host_bytes if source is not None else 0,
            registered_bytes=self._registration.nbytes if self._registration is not None else 0,
            shard_source=source.kind if source is not None else "none",
        )

    # ------------------------------------------------------------------ transaction
    def _enter(self, step: EnableStep) -> None:
        """Mark the step being run (the rollback reports it; tests inject faults here)."""
        self._step = step

    def enable(self) -> None:
        """Install streaming, all or nothing (see the state table)."""
        if self._state is not State.NEW:
            raise InvalidRequest(f"enable() runs once per backend (state {self._state.value}); create a new one")
        self._state = State.ENABLING
        try:
            self._enable()
        except BaseException as exc:
            error = self._abort(exc)
            if error is exc:
                raise
            raise error from exc
        self._state = State.READY

    def _enable(self) -> None:
        opts = self.options
        self._enter(EnableStep.TAKE_LEASE)
        self._revision = Revision(self._take_lease())
        chosen = groups.select_group(
            use_allgather=opts.use_allgather, group=opts.group, dp_group=opts.dp_group, sp_group=opts.sp_group
        )
        if chosen is not None:
            # From here every DLO collective runs on DLO's own communicator (see ``communicator``).
            self._enter(EnableStep.OPEN_GROUP)
            self._group = open_dlo_group(chosen, opts.device)
            self._world = groups.group_size(self._group)
        self._agreed(EnableStep.EXCHANGE_MANIFEST, self._prepare)
        self._agreed(EnableStep.AGREE_READY, self._build)
        self._enter(EnableStep.PREFETCH)
        assert self._stream is not None
        self._stream.fill(0, 0)
        self._enter(EnableStep.COMMIT)
        self._commit()

    def _agreed(self, step: EnableStep, local: Callable[[], None]) -> None:
        """Run ``local``; with a group, every rank then learns whether all ranks succeeded.

        A rank whose ``local`` failed still takes part in the exchange (with ``ok=False``), so
        the collectives of all ranks stay matched and peers fail now instead of at a timeout.
        The phase is folded into the digest, so exchanges of different phases never match.
        """
        error: BaseException | None = None
        try:
            local()
        except Exception as exc:
            error = exc
        if self._group is not None:
            self._enter(step)
            ok = error is None
            # Live updates add a collective to every pass: ranks must agree on them too.
            live = b"live" if self.options.live_updates else b""
            manifest = manifest_digest(self._layouts) if ok else b""
            digest = hashlib.sha256(step.value.encode() + live + manifest).digest()
            groups.exchange_manifest(self._group, digest, ok, self.options.device)
        if error is not None:
            raise error

    def _prepare(self) -> None:
        """Local: discover blocks, bind host sources, validate, plan layouts."""
        opts = self.options
        self._enter(EnableStep.DISCOVER)
        stacks = find_block_stacks(self.model, opts.blocks_attr)
        blocks = [block for stack in stacks for block in stack.blocks]
        self._enter(EnableStep.BIND_SOURCES)
        sources = collect_blocks(self.model, blocks)
        lease = self._lease
        if lease is not None:
            bind_lease(sources, lease.tensors)
        require_host_memory(sources)
        self._enter(EnableStep.VALIDATE)
        self._validate(sources)
        self._resident = sources[: opts.resident_layers]
        self._streamed = sources[opts.resident_layers :]
        self._layouts = [plan_block(src.name, src.metas(), self._world) for src in self._streamed]
        if opts.live_updates:  # what every later revision must match (``contract``)
            self._rest = collect_rest(self.model, blocks)
            self._contract = TensorContract.of(sources, self._rest)

    def _build(self) -> None:
        """Local: shards, host registration, slots and lanes, hooks."""
        opts = self.options
        revision = self._revision
        assert revision is not None
        self._context = RevisionContext(
            device=opts.device,
            layouts=tuple(self._layouts),
            world=self._world,
            rank=groups.group_rank(self._group) if self._group is not None else 0,
            allgather=self._group is not None,
            cpu_zero_copy=opts.cpu_zero_copy,
            allgather_host_copy=opts.allgather_host_copy,
            registration_limit_gib=opts.host_registration_limit_gib,
        )
        revision.hosts = [src.host for src in self._streamed]
        revision.resident = [src.host for src in self._resident]
        self._enter(EnableStep.SHARD)
        revisions.shard(revision, self._context)
        self._enter(EnableStep.REGISTER_HOST)
        if opts.device.type == "cuda":
            revisions.register_host(revision, self._context, _device_index(opts.device))
        self._enter(EnableStep.ALLOCATE)
        revisions.stage(revision, self._context)
        self._allocate()
        self._enter(EnableStep.INSTALL_HOOKS)
        self._install()

    def _take_lease(self) -> HostLease | None:
        source = self._host_source
        if source is None:
            return None
        lease = source.take() if isinstance(source, LeaseCarrier) else source
        if not isinstance(lease, HostLease):
            raise InvalidRequest("host_source must be a LeaseCarrier, a HostLease or None")
        if lease.closed:
            raise LeaseClosed(f"lease {lease.key} is already closed")
        return lease

    def _validate(self, sources: Sequence[BlockSource]) -> None:
        opts = self.options
        allgather = self._group is not None
        if opts.device.type not in ("cpu", "cuda"):
            raise Unsupported(f"device type {opts.device.type!r} (cpu and cuda are supported)")
        if opts.resident_layers < 0:
            raise InvalidRequest("resident_layers must be >= 0", details={"field": "resident_layers"})
        if opts.resident_layers and opts.use_allgather:
            raise Unsupported("resident layers require rank-local streaming (use_allgather=False)")
        if opts.use_allgather and opts.quantization not in SUPPORTED_QUANTIZATION:
            raise Unsupported(f"quantization {opts.quantization!r} is not validated for AllGather sharding")
        if len(sources) - opts.resident_layers < 2:
            raise InvalidRequest(
                f"{len(sources) - opts.resident_layers} streamable blocks; the ring needs at least two",
                details={"blocks": len(sources), "resident_layers": opts.resident_layers},
            )
        for source in sources:
            for ref, host in zip(source.refs, source.host, strict=True):
                reason = unsupported_reason(ref.original, allgather=allgather) or unsupported_reason(
                    host, allgather=allgather
                )
                if reason is not None:
                    raise Unsupported(f"{ref.name}: {reason}", details={"tensor": ref.name})

    def _allocate(self) -> None:
        device = self.options.device
        if device.type == "cuda":
            self._lanes = [CudaLane(device), CudaLane(device)]
            self._compute = CurrentStreamLane(device)
        else:
            self._lanes = [ThreadLane("copy"), ThreadLane("comm")]
            self._compute = InlineLane()
        assert self._context is not None and self._revision is not None
        kind, _ = revisions.transfer_kind(self._context, self._revision)
        # Bound host tensors need no slot bytes; every other transfer writes the largest block.
        nbytes = 0 if kind is TransferKind.BIND else max(layout.nbytes for layout in self._layouts)
        self._slots = SlotPair(nbytes, device)
        self._transfer = self._make_transfer(self._revision)
        # The caching allocator handed the slot (and shard) buffers out on the current stream,
        # where blocks freed earlier may still be read by queued kernels: reuse is ordered only
        # on that stream. The lanes write these buffers first, so they start after it.
        allocated = self._compute.record()
        for lane in self._lanes:
            lane.wait(allocated)
        self._stream = BlockStream(
            self._streamed,
            self._layouts,
            self._slots,
            self._transfer,
            self._compute,
            device,
            collective=self._group is not None,
            poison_error=self._poison_error,
            watchdog=self._start_watchdog(),
        )

    def _make_transfer(self, revision: Revision, reuse: Transfer | None = None) -> Transfer:
        """The transfer that streams ``revision`` (``revision.transfer_kind``) over this backend's
        lanes and slots; ``reuse``: the transfer it replaces, whose device buffers it keeps."""
        assert self._context is not None and self._slots is not None
        device = self.options.device
        copy_lane, comm_lane = self._lanes[-2:]
        kind, _ = revisions.transfer_kind(self._context, revision)
        arena = revision.staging
        if kind is TransferKind.BIND:
            # The "device" is the host: copying a block into a slot would only duplicate bytes
            # compute can read where they are. The ring, prefetch order and slot ownership stay.
            return HostBindTransfer(revision.hosts, self._slots, copy_lane)
        if kind is TransferKind.ALLGATHER:
            # Each rank holds only a shard, so even on a CPU device the block must be gathered.
            assert revision.shards is not None and self._group is not None
            return AllGatherTransfer(
                revision.shards,
                self._layouts,
                self._slots,
                copy_lane,
                comm_lane,
                self._group,
                device,
                inputs=2 if device.type == "cuda" else 1,
                staging=arena is not None,
                arena=arena,
                buffers=reuse.inputs if isinstance(reuse, AllGatherTransfer) else None,
            )
        if kind is TransferKind.DIRECT:
            return DirectTransfer(revision.hosts, self._layouts, self._slots, copy_lane)
        # Host memory the device cannot read asynchronously goes through pinned staging.
        packer = self._packer_lane()
        return StagedTransfer(
            revision.hosts, self._layouts, self._slots, copy_lane, pin=True, packer=packer, arena=arena
        )

    def _packer_lane(self) -> ThreadLane:
        """The staged transfer's packing thread; drained first at teardown (it feeds the copy lane)."""
        if self._packer is None:
            self._packer = ThreadLane("pack")
            self._lanes.insert(0, self._packer)
        return self._packer

    def _start_watchdog(self) -> CollectiveWatchdog | None:
        """With a group: the watchdog that turns a gather no peer joins into a typed error."""
        if self._group is None:
            return None
        self._watchdog = CollectiveWatchdog(watchdog_timeout_s(self._group, self.options.device), self._stuck)
        return self._watchdog

    def _stuck(self, reason: str) -> None:
        """Watchdog thread: a gather is stuck; poison the stream and abort the group (NCCL)."""
        if self._stream is not None:
            self._stream.poison(f"{reason}; a peer died, hung or skipped a forward")
        failure = abort_group(self._group, self.options.device)
        if failure is not None:
            _log.warning("AllGather group not aborted: %s", failure)

    def _set(self, ref: Any, value: torch.Tensor) -> None:
        current = ref.current()
        if current.is_meta:
            # ``.data`` cannot move a meta tensor to a real device: register a new object instead.
            # A fresh object per tensor (``detach`` aliases): placeholders are shared per dtype.
            fresh = (
                nn.Parameter(value.detach(), requires_grad=current.requires_grad) if ref.is_param else value.detach()
            )
            ref.replace_object(fresh)
        else:
            current.data = value

    def _install(self) -> None:
        device = self.options.device
        for source in self._resident:
            self._installed.append(source)
            for ref, host in zip(source.refs, source.host, strict=True):
                resident = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=device)
                resident.copy_(host)
                self._set(ref, resident)
        stream = self._stream
        assert stream is not None
        for index, source in enumerate(self._streamed):
            self._installed.append(source)
            for ref in source.refs:
                self._set(ref, stream.placeholder(ref.original.dtype))
            self._hooks.attach(source.module, lambda i=index: stream.before(i), lambda i=index: stream.after(i))
        if self.options.live_updates:
            self._install_switch()

    def _commit(self) -> None:
        # From here on the original host tensors are no longer a rollback target; drop the ones
        # the backend does not stream from, so AllGather ranks keep only their shards.
        if self._group is not None:
            for source in self._streamed:
                source.host = []
        self._committed = True

    def _poison_error(self, message: str) -> HwrError:
        if self._world > 1:
            return CollectiveStateError(f"{message}; recreate the backend and reload the pipeline on every rank")
        return OffloadError(f"{message}; recreate the backend and reload the pipeline")

    # --------------------------------------------------------------------- teardown
    def disable(self, *, restore: bool = True) -> None:
        """Remove every hook, restore weights, release everything, close the lease; idempotent.

        ``restore=False`` (process shutdown) skips step 3 for streamed blocks: no gather-back (no
        collective, so a rank whose peers are gone still tears down) and no host copies; their
        tensors stay empty placeholders and the model is unusable afterwards.
        """
        if self._state in (State.CLOSED, State.FAILED):
            return
        if self._state is State.NEW:
            self._close_lease()
            self._state = State.CLOSED
            return
        errors = self._teardown(restore=restore)
        self._state = State.CLOSED
        if errors:
            _log.error("offload teardown finished with errors: %s", "; ".join(errors))

    def _abort(self, exc: BaseException) -> BaseException:
        step = self._step.value if self._step is not None else "start"
        errors = self._teardown()
        self._state = State.FAILED
        after_agreement = self._step in (EnableStep.PREFETCH, EnableStep.COMMIT)
        collective = self._world > 1  # the communicator itself is already shut down by the teardown
        if self._gathered or isinstance(exc, CollectiveStateError) or (collective and after_agreement):
            return CollectiveStateError(
                f"enable failed at step {step!r} after collectives were issued ({exc}); the group is in an "
                "unknown state: recreate the backend and reload the pipeline on every rank",
                details={"step": step, "teardown_errors": len(errors)},
            )
        if isinstance(exc, HwrError):
            exc.details.setdefault("step", step)
            return exc
        return OffloadError(f"enable failed at step {step!r}: {exc}", details={"step": step})

def _device_index(device: torch.device) -> int:
    """The CUDA ordinal of ``device`` (``cuda`` alone means the current device)."""
    return device.index if device.index is not None else torch.cuda.current_device()
