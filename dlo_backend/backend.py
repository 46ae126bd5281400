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

The backend is the transaction; it composes parts that own their state, each behind its own
interface: ``held.HeldRevisions`` (the running revision and those not released yet),
``runtime.StreamingRuntime`` (lanes, slots, transfer, the ring, the watchdog),
``installation.Installation`` (hooks and the rollback target), and with ``live_updates``
``live.LiveUpdates`` (the revision switch). Teardown (failure rollback and ``disable``) runs
the parts' releases in the order ``teardown`` documents.

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
from typing import Any

import torch
from torch import nn

from hwr.client.carrier import HostLease, LeaseCarrier
from hwr.client.errors import HwrError, InvalidRequest, LeaseClosed, Unsupported
from hwr.dlo_backend import group as groups
from hwr.dlo_backend import revision as revisions
from hwr.dlo_backend.communicator import DloCommunicator, open_dlo_group
from hwr.dlo_backend.contract import ModelTensor, TensorContract, collect_rest
from hwr.dlo_backend.discovery import find_block_stacks
from hwr.dlo_backend.errors import CollectiveStateError, OffloadError
from hwr.dlo_backend.held import HeldRevisions
from hwr.dlo_backend.installation import Installation
from hwr.dlo_backend.layout import BlockLayout, manifest_digest, plan_block
from hwr.dlo_backend.live import LiveUpdates
from hwr.dlo_backend.revision import Revision, RevisionContext
from hwr.dlo_backend.runtime import StreamingRuntime
from hwr.dlo_backend.slots import SlotState
from hwr.dlo_backend.sources import (
    SUPPORTED_QUANTIZATION,
    BlockSource,
    bind_lease,
    collect_blocks,
    require_host_memory,
    unsupported_reason,
)
from hwr.dlo_backend.switch import RevisionStatus
from hwr.dlo_backend.teardown import teardown

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


class LayerwiseOffloadBackend:
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
        self._group: DloCommunicator | None = None
        self._world = 1
        self._streamed: list[BlockSource] = []
        self._resident: list[BlockSource] = []
        self._rest: list[ModelTensor] = []
        self._layouts: list[BlockLayout] = []
        self._context: RevisionContext | None = None
        self._contract: TensorContract | None = None
        # The parts, each the owner of its state (see the module docstring).
        self._revisions = HeldRevisions()
        self._runtime = StreamingRuntime(options.device, self._poison_error)
        self._installation = Installation(model)
        self._live: LiveUpdates | None = None

    # ----------------------------------------------------------------- observation
    @property
    def state(self) -> State:
        if self._state is State.READY and self._runtime.poisoned:
            return State.POISONED
        return self._state

    def slot_state(self) -> SlotState:
        """Probe: which streamed block each slot holds and which one is bound for compute."""
        return self._runtime.slot_state()

    def materialized_blocks(self) -> list[int]:
        """Probe: streamed blocks whose weights are currently materialized on the device."""
        return [
            i
            for i, src in enumerate(self._streamed)
            if any(ref.current().numel() > 0 for ref in src.refs if ref.original.numel() > 0)
        ]

    @property
    def stats(self) -> OffloadStats:
        source, registration = self._revisions.shards, self._revisions.registration
        transfer, slots = self._runtime.transfer, self._runtime.slots
        return OffloadStats(
            mode=transfer.mode if transfer is not None else "none",
            world=self._world,
            streamed_blocks=len(self._streamed),
            resident_blocks=len(self._resident),
            slot_bytes=slots.nbytes if slots is not None else 0,
            block_bytes=sum(layout.nbytes for layout in self._layouts),
            host_shard_bytes=source.host_bytes if source is not None else 0,
            registered_bytes=registration.nbytes if registration is not None else 0,
            shard_source=source.kind if source is not None else "none",
        )

    # ------------------------------------------------------------------ live updates
    def update(self, lease: HostLease | LeaseCarrier) -> None:
        """Run ``lease``'s revision from the next pass boundary on; the backend owns the lease.

        Raises ``RevisionMismatch`` (the lease closed, nothing changed) when the revision does
        not match the model's tensor contract; ``InvalidRequest`` without ``live_updates`` or
        once closed. With AllGather the switch waits until every rank holds the revision; a
        peer's refusal shows in ``revision_status().last_error``.
        """
        if isinstance(lease, LeaseCarrier):
            lease = lease.take()
        if not isinstance(lease, HostLease):
            raise InvalidRequest("update() takes a lease (a HostLease or a LeaseCarrier)")
        if self._live is None:
            lease.close()
            if not self.options.live_updates:
                raise InvalidRequest(
                    "live updates need apply_layerwise_offload(..., live_updates=True)",
                    details={"field": "live_updates"},
                )
            raise InvalidRequest("update() needs an enabled offload")
        self._live.update(lease)

    def revision_status(self) -> RevisionStatus:
        """The revision passes run on, switches so far, a pending update, the last refusal."""
        if self._live is None:
            return RevisionStatus(self._revisions.key, 0, None, None)
        return self._live.status

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
        self._revisions.running = Revision(self._take_lease())
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
        assert self._runtime.stream is not None
        self._runtime.stream.fill(0, 0)
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
        lease = self._revisions.lease
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
        revision = self._revisions.running
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
        stream = self._runtime.allocate(self._context, revision, self._streamed, self._layouts, self._group)
        self._enter(EnableStep.INSTALL_HOOKS)
        self._installation.install(self._resident, self._streamed, stream, opts.device)
        if opts.live_updates:
            assert self._contract is not None
            self._live = LiveUpdates(
                streamed=self._streamed,
                resident=self._resident,
                rest=self._rest,
                contract=self._contract,
                context=self._context,
                group=self._group,
                revisions=self._revisions,
                runtime=self._runtime,
                poison_error=self._poison_error,
            )
            # First of the model's pre-hooks: nothing of the pass has run when the revision changes.
            self._installation.attach_boundary(self._live.boundary)

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

    def _commit(self) -> None:
        self._installation.commit(self._streamed, allgather=self._group is not None)

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
            if isinstance(self._host_source, LeaseCarrier):
                self._host_source.close()
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
        if self._runtime.gathered or isinstance(exc, CollectiveStateError) or (collective and after_agreement):
            return CollectiveStateError(
                f"enable failed at step {step!r} after collectives were issued ({exc}); the group is in an "
                "unknown state: recreate the backend and reload the pipeline on every rank",
                details={"step": step, "teardown_errors": len(errors)},
            )
        if isinstance(exc, HwrError):
            exc.details.setdefault("step", step)
            return exc
        return OffloadError(f"enable failed at step {step!r}: {exc}", details={"step": step})

    def _teardown(self, *, restore: bool = True) -> list[str]:
        """Every part released, in ``teardown``'s order; DLO's communicator is shut down."""
        group, self._group = self._group, None
        return teardown(
            installation=self._installation,
            runtime=self._runtime,
            live=self._live,
            revisions=self._revisions,
            resident=self._resident,
            streamed=self._streamed,
            group=group,
            host_source=self._host_source,
            restore=restore,
        )

def _device_index(device: torch.device) -> int:
    """The CUDA ordinal of ``device`` (``cuda`` alone means the current device)."""
    return device.index if device.index is not None else torch.cuda.current_device()
