"""The AllGather group: which process group shards the weights, and the manifest agreement.

Selection (``select_group``), a pure decision over the groups the caller passes in (hwr does
not depend on vLLM, so the caller hands over its parallel groups):

- ``use_allgather=False``: no group (rank-local streaming); passing ``group`` is an error.
- ``group`` is a process group: that group.
- ``group`` is ``None`` or ``"auto"``: the DP group if its size is > 1, else the SP group if its
  size is > 1, else none. TP is never a DLO group.
- A group of size 1 means no collective: the backend streams rank-locally.

Lockstep: a gather completes only when every rank of the group issues it, so every rank must
run the same forwards (same count, same blocks, same order; activations may differ). ``"auto"``
picks the DP group when it has more than one rank, and DP ranks are exactly the ones that may
have no request at a given step: a DP rank that skips its forward leaves its peers' gathers
pending until the watchdog (NCCL) or the group timeout (gloo) fails them with
``CollectiveStateError``. Use AllGather over DP only where idle DP ranks still run a (dummy)
forward in step with the others; otherwise pass the SP group (``group=``) or stream rank-locally.

``exchange_manifest`` is the first collective of a backend: every rank contributes whether its
local preparation succeeded and the digest of its block manifest; every rank then sees the same
verdict, so one rank's local failure or a disagreement fails all ranks promptly (within the
group's timeout at worst) instead of hanging in a later gather.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from hwr.client.errors import InvalidRequest
from hwr.dlo_backend.communicator import DloCommunicator
from hwr.dlo_backend.errors import CollectiveStateError, ManifestMismatch, OffloadError

__all__ = ["all_gather_bytes", "exchange_manifest", "group_rank", "group_size", "select_group"]

# ``all_gather_single`` replaces the deprecated ``all_gather_into_tensor`` in recent torch.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_gather_bytes(output: torch.Tensor, local: torch.Tensor, group: Any) -> None:
    """Gather every rank's ``local`` into ``output`` in rank order (both 1-D, same dtype).

    ``group`` is DLO's own ``DloCommunicator`` (the backend's gathers) or a process group.
    """
    if isinstance(group, DloCommunicator):
        group.all_gather(output, local)
        return
    _all_gather(output, local, group=group)


_DIGEST_BYTES = 32


def group_size(group: Any) -> int:
    if isinstance(group, DloCommunicator):
        return group.size
    return 1 if group is None else int(dist.get_world_size(group))


def group_rank(group: Any) -> int:
    if isinstance(group, DloCommunicator):
        return group.rank
    return 0 if group is None else int(dist.get_rank(group))


def select_group(*, use_allgather: bool, group: Any = None, dp_group: Any = None, sp_group: Any = None) -> Any:
    """Return the process group to shard over, or ``None`` for rank-local streaming."""
    if not use_allgather:
        if group is not None and group != "auto":
            raise InvalidRequest("a process group was given but use_allgather is False", details={"field": "group"})
        return None
    if group is not None and group != "auto":
        chosen = group
    elif dp_group is not None and group_size(dp_group) > 1:
        chosen = dp_group
    elif sp_group is not None and group_size(sp_group) > 1:
        chosen = sp_group
    else:
        chosen = None
    return chosen if group_size(chosen) > 1 else None


def exchange_manifest(group: Any, digest: bytes, ok: bool, device: torch.device) -> None:
    """All-gather ``(ok, digest)`` over ``group`` and fail every rank on any failure or mismatch.

    Raises ``OffloadError`` when another rank failed locally (a locally failed rank raises its
    own error afterwards), ``ManifestMismatch`` when digests differ, and
    ``CollectiveStateError`` when the exchange itself failed (a peer died or timed out).
    """
    if len(digest) != _DIGEST_BYTES:
        raise ValueError("digest must be 32 bytes")
    world = group_size(group)
    # On the offload device: NCCL groups only take CUDA tensors, gloo groups CPU ones.
    mine = torch.tensor([1 if ok else 0, *digest], dtype=torch.uint8, device=device)
    everyone = torch.empty(world * mine.numel(), dtype=torch.uint8, device=device)
    try:
        all_gather_bytes(everyone, mine, group)
        # Inside the try: with NCCL the gather only fails when its result is waited for, here.
        rows = everyone.view(world, mine.numel()).cpu()
    except Exception as exc:
        raise CollectiveStateError(
            f"manifest exchange over the AllGather group failed ({exc}); a peer stopped or timed out",
        ) from exc
    failed = [rank for rank in range(world) if int(rows[rank, 0]) != 1]
    if failed:
        if ok:
            raise OffloadError(
                f"ranks {failed} of the AllGather group failed to prepare offload",
                details={"failed_ranks": ",".join(map(str, failed))},
            )
        return  # this rank failed too; the caller raises its own error
    reference = bytes(rows[0, 1:].tolist())
    differing = [rank for rank in range(world) if bytes(rows[rank, 1:].tolist()) != reference]
    if differing:
        raise ManifestMismatch(
            f"ranks {differing} disagree with rank 0 on the block manifest; every rank must load the same model",
            details={"ranks": ",".join(map(str, differing))},
        )
