"""In-process layerwise offload (DLO) for diffusion transformers.

``apply_layerwise_offload(model, device=..., ...)`` streams a DiT's transformer blocks from host
memory (the module's own tensors or an hwrd lease's read-only views) through exactly two device
slots, prefetching block i+1 while block i computes, optionally sharding host weights across an
AllGather group. On a CPU device (rank-local) the blocks are bound to the host tensors instead
of copied (``cpu_zero_copy``). It returns an ``OffloadHandle`` whose ``close()`` removes every
hook, leaves the model usable and closes the lease. See ``backend`` for the transaction's state
table.

Modules, one concept each. Streaming: ``discovery`` (block stacks), ``sources`` (host bytes),
``layout`` (slot byte plan, shard pieces, manifest digest), ``shards`` (one rank's AllGather
shard: built privately or read from the lease), ``ring`` (prefetch policy), ``hooks`` (hook
registry), ``slots`` (device slots), ``lanes`` (streams and events), ``transfer`` (direct,
staged, AllGather copies; CPU zero-copy binding), ``stream`` (the ring at run time: what a
block's hooks do), ``paging`` (page-table population ahead of compute), ``registration``
(``cudaHostRegister``; ``cudart``, the CUDA runtime calls behind it), ``arena`` (exact-size
pinned host memory), ``watchdog`` (stuck gathers), ``communicator`` (DLO's own AllGather
group), ``group`` (group choice and manifest agreement), ``errors``. The backend and its parts:
``backend`` (the transaction, composing the parts), ``runtime`` (the device side: lanes, slots,
transfer, ring, watchdog), ``installation`` (hooks and the rollback target on the model),
``held`` (the revisions the backend holds), ``teardown`` (the order the parts are released
in), ``offload`` (public entry). Live updates: ``contract`` (what a revision must hold),
``revision`` (one revision's host side), ``agreement`` (the ranks' per-pass decision),
``switch`` (pending updates and the pass boundary), ``live`` (the backend's part the switch
drives), ``follow`` (an hwrd channel as the source of updates). Around it: ``file_lease`` (a
local safetensors file as a host source), ``loader`` (a worker's startup transaction, from an
artifact identity to a model serving with offload), ``vllm_plugin`` (the vLLM-Omni plugin).
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
