"""The public entry point: ``apply_layerwise_offload`` and the handle it returns."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from hwr.client.carrier import HostLease, LeaseCarrier
from hwr.client.errors import InvalidRequest
from hwr.dlo_backend.backend import LayerwiseOffloadBackend, OffloadOptions, OffloadStats, State
from hwr.dlo_backend.follow import ChannelClient, ChannelFollower
from hwr.dlo_backend.slots import SlotState
from hwr.dlo_backend.switch import RevisionStatus

__all__ = ["OffloadHandle", "apply_layerwise_offload"]


class OffloadHandle:
    """Owns an enabled backend; ``close()`` is idempotent and leaves the model usable.

    After ``close`` every hook is gone, the streamed weights are CPU tensors again (the
    originals, or private copies of lease views / gathered shards) and the lease is closed.
    With AllGather, ``close`` gathers the blocks one last time: call it on every rank.

    Live updates (enabled with ``live_updates=True``): ``update(lease)`` runs a new revision
    from the next pass boundary on (one call of the model's ``forward``), all ranks of an
    AllGather group at the same pass; ``follow(client, channel)`` does that for every revision
    an hwrd channel points to; ``revision`` says where the handle stands. See ``switch``.
    """

    def __init__(self, backend: LayerwiseOffloadBackend) -> None:
        self.backend = backend
        self._follower: ChannelFollower | None = None

    @property
    def closed(self) -> bool:
        return self.backend.state is State.CLOSED

    @property
    def stats(self) -> OffloadStats:
        return self.backend.stats

    def slot_state(self) -> SlotState:
        return self.backend.slot_state()

    @property
    def revision(self) -> RevisionStatus:
        """The revision passes run on (its lease key), switches, a pending update, the last refusal."""
        return self.backend.revision_status()

    def update(self, lease: HostLease | LeaseCarrier) -> None:
        """Switch to ``lease``'s revision at the next pass boundary; the handle owns the lease.

        The old revision's lease is released once no pass uses it. Raises ``RevisionMismatch``
        (lease closed, nothing changed) when the revision does not match the model's tensor
        contract; see ``LayerwiseOffloadBackend.update``.
        """
        self.backend.update(lease)

    def follow(
        self, client: ChannelClient, channel: str, *, acquire_options: Mapping[str, Any] | None = None
    ) -> ChannelFollower:
        """Follow hwrd channel ``channel`` through ``client`` (see ``follow``) until ``close``.

        ``client`` stays the caller's (close it after the handle). ``acquire_options`` are
        passed to ``client.acquire`` for every new revision (e.g. ``populate=True``).
        """
        if self._follower is not None and self._follower.running:
            raise InvalidRequest(f"this handle already follows channel {self._follower.channel!r}")
        if not self.backend.options.live_updates:
            raise InvalidRequest(
                "following a channel needs apply_layerwise_offload(..., live_updates=True)",
                details={"field": "live_updates"},
            )
        self._follower = ChannelFollower(self.backend, client, channel, acquire_options=acquire_options)
        return self._follower

    def close(self) -> None:
        if self._follower is not None:  # first: no update may arrive while the backend closes
            self._follower.close()
        self.backend.disable()

    def __enter__(self) -> OffloadHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        s = self.backend.stats
        return (
            f"OffloadHandle(state={self.backend.state.value}, mode={s.mode}, blocks={s.streamed_blocks}, "
            f"slot_bytes={s.slot_bytes})"
        )


def apply_layerwise_offload(
    model: nn.Module,
    *,
    device: torch.device | str,
    blocks_attr: str | Sequence[str] | None = None,
    host_source: LeaseCarrier | HostLease | None = None,
    use_allgather: bool = False,
    group: Any = None,
    dp_group: Any = None,
    sp_group: Any = None,
    resident_layers: int = 0,
    host_registration_limit_gib: float = 0.0,
    quantization: str | None = None,
    cpu_zero_copy: bool = True,
    allgather_host_copy: bool = False,
    live_updates: bool = False,
) -> OffloadHandle:
    """Stream ``model``'s transformer blocks host -> ``device`` through two device slots.

    - ``blocks_attr``: the block stack attribute(s) (dotted paths allowed); default: the class's
      ``_layerwise_offload_blocks_attrs``, else a scan for lists of same-class blocks.
    - ``host_source``: where block bytes live. ``None`` streams from the module's own CPU
      tensors; a ``LeaseCarrier`` is taken exactly once (a ``HostLease`` is owned as given) and
      its read-only views, named like the model's ``state_dict``, back the blocks with no host
      copy. The backend closes the lease on failure or ``close``.
    - ``use_allgather`` with ``group`` (a process group, or ``None``/``"auto"`` to pick
      ``dp_group`` if its size > 1, else ``sp_group`` if > 1, else rank-local): each rank keeps
      ``1 / world`` of every block and rebuilds it with an all-gather. NCCL on CUDA, gloo on CPU.
      Every rank must run the same blocks in the same order (activations may differ per rank).
      The gathers run on DLO's own communicator, created at enable over the same ranks and
      shut down at close, so the model's and the caller's collectives on those ranks (SP
      all-reduces inside blocks, barriers between or during forwards) never interleave with them.
      With a lease as host source each rank reads its own pieces of every block straight from
      the shared mapping (no private shard); module tensors are sharded into private copies.
    - ``allgather_host_copy``: with a lease and AllGather, build private host shards at enable
      instead (pinned on CUDA: upstream's layout, a second host copy of the model per node;
      kept as the benchmarks' baseline). Ignored without AllGather.
    - ``resident_layers``: the first k blocks stay on the device (rank-local only).
    - ``host_registration_limit_gib``: CUDA only; a lease's mapped regions are registered
      (``cudaHostRegister``, read-only) if they fit (0 = unlimited), else copied through staging.
    - ``quantization``: the online quantization scheme in the weights (``None`` or
      ``"fp8_per_tensor"`` are accepted with AllGather).
    - ``cpu_zero_copy``: with a CPU ``device`` and rank-local streaming, the "device slots"
      would be host memory too, so by default each block's tensors are bound to the host
      tensors themselves (the lease's mapped views or the module's own tensors) instead of
      copied into a slot; the prefetch only pre-faults the next block's pages. Same ring, same
      outputs, no slot bytes. ``False`` copies through two slots exactly as on CUDA (needed by a
      model that writes into its weights: lease views are read-only). AllGather always gathers
      (each rank holds only a shard); CUDA always copies.
    - ``live_updates``: the handle accepts ``update(lease)`` and ``follow(client, channel)``:
      a new revision (it must match the model's tensor contract: every block and non-block
      parameter and persistent buffer, same dtype, shape and stride) is taken at the next call
      of the model's ``forward``. With AllGather the ranks agree at every pass (one small
      all-gather on DLO's own communicator), so all of them switch at the same pass or none
      does; every rank must pass the same value.

    Non-block modules are left untouched: put them on ``device`` yourself. Inference only.
    Raises (after a complete rollback: model usable, lease closed) ``InvalidRequest``,
    ``Unsupported``, ``HostSourceMismatch``, ``ManifestMismatch``, ``OffloadError`` or, when the
    group's state became unknown, ``CollectiveStateError``.
    """
    attrs = blocks_attr if blocks_attr is None or isinstance(blocks_attr, str) else tuple(blocks_attr)
    options = OffloadOptions(
        device=torch.device(device),
        blocks_attr=attrs,
        use_allgather=use_allgather,
        group=group,
        dp_group=dp_group,
        sp_group=sp_group,
        resident_layers=resident_layers,
        host_registration_limit_gib=host_registration_limit_gib,
        quantization=quantization,
        cpu_zero_copy=cpu_zero_copy,
        allgather_host_copy=allgather_host_copy,
        live_updates=live_updates,
    )
    backend = LayerwiseOffloadBackend(model, options, host_source)
    backend.enable()
    return OffloadHandle(backend)
