"""In-process layerwise offload (DLO) for diffusion transformers.

``apply_layerwise_offload(model, device=..., ...)`` streams a DiT's transformer blocks from host
memory (the module's own tensors or an hwrd lease's read-only views) through exactly two device
slots, prefetching block i+1 while block i computes, optionally sharding host weights across an
AllGather group. On a CPU device (rank-local) the blocks are bound to the host tensors instead
of copied (``cpu_zero_copy``). It returns an ``OffloadHandle`` whose ``close()`` removes every
hook, leaves the model usable and closes the lease. See ``backend`` for the transaction's state
table.

Modules, one concept each: ``discovery`` (block stacks), ``sources`` (host bytes), ``layout``
(slot byte plan, shards, manifest digest), ``sharding`` (one rank's shard), ``ring`` (prefetch
policy), ``hooks`` (hook registry), ``slots`` (device slots), ``lanes`` (streams and events),
``transfer`` (direct, staged, AllGather copies; CPU zero-copy binding), ``paging`` (page-table
population ahead of compute), ``registration`` (``cudaHostRegister``; ``cudart``, the CUDA
runtime calls behind it), ``arena`` (exact-size pinned host memory), ``watchdog`` (stuck gathers),
``group`` (AllGather group and manifest agreement), ``backend`` (transaction and runtime),
``offload`` (public entry), ``errors``. Live updates: ``contract`` (what a revision must hold),
``revision`` (one revision's host side), ``agreement`` (the ranks' per-pass verdict),
``switch`` (pending updates and the pass boundary), ``live`` (the backend's switch),
``follow`` (an hwrd channel as the source of updates).
"""

from hwr.dlo_backend.backend import EnableStep, LayerwiseOffloadBackend, OffloadStats, State
from hwr.dlo_backend.errors import (
    CollectiveStateError,
    HostSourceMismatch,
    ManifestMismatch,
    OffloadError,
    RevisionMismatch,
)
from hwr.dlo_backend.follow import ChannelFollower
from hwr.dlo_backend.offload import OffloadHandle, apply_layerwise_offload
from hwr.dlo_backend.slots import SlotState
from hwr.dlo_backend.switch import RevisionStatus

__all__ = [
    "ChannelFollower",
    "CollectiveStateError",
    "EnableStep",
    "HostSourceMismatch",
    "LayerwiseOffloadBackend",
    "ManifestMismatch",
    "OffloadError",
    "OffloadHandle",
    "OffloadStats",
    "RevisionMismatch",
    "RevisionStatus",
    "SlotState",
    "State",
    "apply_layerwise_offload",
]
