"""vLLM-Omni's DLO backend with the hwrd-backed DiT rings streamed by ``hwr.dlo_backend``.

``HwrdOffloadBackend`` subclasses vLLM-Omni 0.30's ``DistributedLayerwiseOffloadBackend`` and
changes exactly two things; everything else a pipeline gets from that backend (the offload plan
resolver, non-block DiT modules placed on the device, text-encoder rings, staged and resident
modules, the residency controller, the carrier's single ``take()``, the teardown order, the
poisoned state after a skipped AllGather restore) is vLLM-Omni's own code path:

1. **DiT rings over an hwrd source with AllGather** (group size > 1): instead of vLLM-Omni's
   hooks, which copy every rank's shard of every block into private pinned memory at enable,
   ``_install_hook_group`` hands the ring's blocks to ``hwr.dlo_backend.apply_layerwise_offload``
   with a ``BorrowedLease`` of the leased views: each rank reads only its own pieces of each
   block from the shared mapping into a bounded gather input (no private shard), on CUDA from
   its own ``cudaHostRegister``-ed ranges or bounded pinned staging, and gathers on DLO's own
   communicator over the DP (or, when DP = 1, SP) ranks, so the model's own SP collectives never
   interleave with the gathers. The lease stays owned by this backend and is closed in
   vLLM-Omni's order, after the hwr rings are closed and their host registrations undone.
2. **Checkpoint plans** (``backing_kind == "checkpoint_mmap"``, pipelines loaded by direct
   checkpoint mmap): ``_load_weights_via_mmap`` binds the plan's runtime tensors to views of
   hwrd checkpoint leases (``checkpoints.lease_checkpoint_plan``) instead of the worker's own
   ``safe_open`` mappings; rank-local rings are vLLM-Omni's (they keep the views, no private
   shard), AllGather rings are hwr's as in 1.

Options hwr does not serve (a plan tensor with a loader transform, a DiT tensor hwr's AllGather
refuses, a checkpoint hwrd does not have) leave vLLM-Omni's own path in place with one warning
naming the option, or, in ``required`` mode, fail the start with that reason. Teardown:
``disable()`` closes the hwr rings (AllGather: one gather-back, a collective on every rank, as
vLLM-Omni's own restore); ``shutdown()`` closes them without restoring (no collective), like
vLLM-Omni's, which then marks itself poisoned. If an hwr ring could not undo a host
registration, the lease is kept open and the teardown raises (unmapping registered memory is
undefined behaviour).

Limits: each hwr ring has its own two device slots (vLLM-Omni's rings share two across every
group), so a pipeline with two hwrd-backed DiT rings holds four slots.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed
from torch import nn
from vllm_omni.diffusion.offloader.config import DIT_COMPONENT
from vllm_omni.diffusion.offloader.distributed_layerwise_backend import DistributedLayerwiseOffloadBackend

from hwr.client.errors import HwrError
from hwr.dlo_backend.errors import CollectiveStateError
from hwr.dlo_backend.offload import OffloadHandle, apply_layerwise_offload
from hwr.dlo_backend.vllm_plugin.borrowed import BorrowedLease, regions_of
from hwr.dlo_backend.vllm_plugin.checkpoints import CheckpointPlanLeases, lease_checkpoint_plan
from hwr.dlo_backend.vllm_plugin.config import DaemonTarget

__all__ = ["HwrdOffloadBackend", "block_paths"]

log = logging.getLogger("hwr.vllm_plugin")


def block_paths(pipeline: nn.Module, blocks: Sequence[nn.Module]) -> list[str] | None:
    """The attribute paths (from ``pipeline``) whose module lists are exactly ``blocks``, in order.

    ``None`` when the blocks are not the complete contents of consecutive module lists (a
    resident head, a hand-built list): hwr discovers blocks by attribute path, so such a ring
    stays on vLLM-Omni's hooks. Pure over the module tree.
    """
    names = {id(module): name for name, module in pipeline.named_modules()}
    paths: list[str] = []
    for block in blocks:
        name = names.get(id(block))
        if name is None or "." not in name:
            return None
        parent = name.rpartition(".")[0]
        if not paths or paths[-1] != parent:
            paths.append(parent)
    covered = [block for path in paths for block in pipeline.get_submodule(path).children()]
    if len(covered) != len(blocks) or any(a is not b for a, b in zip(covered, blocks, strict=True)):
        return None
    return paths


class HwrdOffloadBackend(DistributedLayerwiseOffloadBackend):
    """See the module docstring; built by ``factory.get_offload_backend``."""

    def __init__(self, config: Any, device: torch.device, host_weight_plan: Any = None, *,
                 target: DaemonTarget, required: bool) -> None:
        super().__init__(config, device, host_weight_plan=host_weight_plan)
        self.hwrd_target = target
        self.hwrd_required = required
        self._hwr_handles: list[OffloadHandle] = []
        self._hwr_pipeline: nn.Module | None = None
        self._checkpoint_leases: CheckpointPlanLeases | None = None
        self._warned: set[str] = set()

    # ------------------------------------------------------------------ decisions
    def _unsupported(self, option: str, reason: str) -> None:
        """An option hwr does not serve: fail in required mode, else warn once and go on."""
        message = f"hwrd cannot serve {option}: {reason}"
        if self.hwrd_required:
            raise RuntimeError(f"required Host Weight Runtime through hwrd at {self.hwrd_target.socket}: {message}")
        if option not in self._warned:
            self._warned.add(option)
            log.warning("%s; vLLM-Omni's own DLO path is used for it", message)

    def _hwrd_source(self) -> BorrowedLease | None:
        """The leased views the DiT rings read, or None (no hwrd source: vLLM-Omni's hooks)."""
        lease = self._host_weight_lease
        if lease is not None and not lease.closed:
            return BorrowedLease(lease.identity.key, lease.tensors, regions_of(lease.mapped_regions),
                                 lambda: lease.closed)
        leases = self._checkpoint_leases
        if leases is not None and not leases.closed:
            return BorrowedLease(leases.key, leases.tensors, leases.regions, lambda: leases.closed)
        return None

    # ------------------------------------------------------------------ enable
    def _enable(self, pipeline: nn.Module) -> None:
        self._hwr_pipeline = pipeline
        try:
            super()._enable(pipeline)
        finally:
            self._hwr_pipeline = None
        if self._hwr_handles:
            # vLLM-Omni counts only its own hook groups; the hwr rings are this backend's too.
            self.enabled = True

    def _install_hook_group(self, blocks: Sequence[nn.Module] | nn.ModuleList, component: str, *,
                            use_dit_mmap: bool = False) -> list[Any]:
        group, size, _rank = self._component_transport(component)
        pipeline = self._hwr_pipeline
        if component != DIT_COMPONENT or not use_dit_mmap or size <= 1 or pipeline is None:
            return super()._install_hook_group(blocks, component, use_dit_mmap=use_dit_mmap)
        source = self._hwrd_source()
        paths = block_paths(pipeline, list(blocks))
        if not self._all_ranks(source is not None and paths is not None, group):
            if source is not None:
                source.close()
                if paths is None:
                    self._unsupported("DLO AllGather of this DiT ring", "its blocks are not whole module lists")
                else:
                    log.warning("DLO AllGather: not every rank of the group streams this DiT from hwrd (a rank "
                                "loaded it canonically: a cold start's ranks race its publication); vLLM-Omni's "
                                "own AllGather is used on every rank for this start")
                # Its hooks shard from the restored views into private memory (its rank-local mmap
                # mode refuses a group); the lease is then released at the end of enable.
                self._using_rank_local_mmap = False
            return super()._install_hook_group(blocks, component, use_dit_mmap=use_dit_mmap)
        assert source is not None and paths is not None
        try:
            handle = apply_layerwise_offload(
                pipeline, device=self.device, blocks_attr=paths, host_source=source, use_allgather=True,
                group=group, host_registration_limit_gib=self.config.dlo_host_registration_limit_gib)
        except HwrError as exc:
            source.close()
            if isinstance(exc, CollectiveStateError):
                raise  # gathers were issued: the group's state is unknown, nothing to fall back to
            # Before the first gather hwr's ranks agree on success (a failing rank makes every
            # rank fail the same enable), so every rank falls back here together.
            self._unsupported("DLO AllGather of this DiT ring", str(exc))
            # vLLM-Omni's AllGather hooks shard from the bound views into private pinned memory;
            # its rank-local mmap mode cannot serve a group (it would refuse dp_size > 1).
            self._using_rank_local_mmap = False
            return super()._install_hook_group(blocks, component, use_dit_mmap=use_dit_mmap)
        self._hwr_handles.append(handle)
        log.info("DLO AllGather of %s streams from hwrd (%s, group size %d, no private shard)",
                 ", ".join(paths), source.key[:12], size)
        return []

    def _all_ranks(self, mine: bool, group: Any) -> bool:
        """Whether ``mine`` holds on every rank of the DLO group (``group``; None: this rank alone).

        A collective issued by every rank at the same point of enable, on the caller's thread:
        the DiT rings' transports (and a checkpoint plan's source) must be the same on every rank,
        or their gathers would never meet.
        """
        if group is None:
            return mine
        flag = torch.tensor([1 if mine else 0], dtype=torch.int32,
                            device=self.device if self.device.type == "cuda" else "cpu")
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=group)
        return bool(flag.item())

    def _load_weights_via_mmap(self, pipeline: nn.Module, dits: Any, plan: Any) -> None:
        leases, why = None, ("", "")
        try:
            leases = lease_checkpoint_plan(plan, self.hwrd_target)
        except HwrError as exc:
            why = ("the checkpoint of this direct mmap plan", exc.message)
        except ValueError as exc:  # a loader transform: views cannot carry it
            why = ("this direct checkpoint mmap plan", str(exc))
        group, size, _rank = self._component_transport(DIT_COMPONENT)
        # Every rank takes the same source, decided before anything can fail on one rank alone.
        if not self._all_ranks(leases is not None, group if size > 1 else None):
            if leases is not None:
                leases.close()
                leases = None
                why = ("the checkpoint of this direct mmap plan", "another rank of the group could not lease it")
            self._unsupported(*why)
        if leases is None:
            return super()._load_weights_via_mmap(pipeline, dits, plan)
        self._checkpoint_leases = leases
        leases.bind(pipeline, dits, restore_device=torch.device("cpu") if self._using_rank_local_mmap
                    else self.device)
        self._mmap_transforms_by_tensor_id.clear()  # plans with transforms were refused above
        log.info("DLO direct checkpoint mmap from hwrd checkpoint lease(s) %s: %d tensors",
                 leases.key, len(plan.bindings))

    # ------------------------------------------------------------------ teardown
    def _release_mmap_handles(self) -> None:
        if self._hwr_handles:
            return  # the hwr rings still read the lease: released after they are closed (_disable)
        super()._release_mmap_handles()
        leases, self._checkpoint_leases = self._checkpoint_leases, None
        if leases is not None:
            leases.close()

    def _disable(self, *, restore_allgather_weights: bool) -> None:
        handles, self._hwr_handles = self._hwr_handles, []
        still_registered = []
        for handle in reversed(handles):
            handle.backend.disable(restore=restore_allgather_weights)
            if handle.stats.registered_bytes:
                still_registered.append(handle)
        if still_registered:
            # The lease must outlive registered host memory; keep it (and the rings) for a retry.
            self._hwr_handles = still_registered
            raise RuntimeError("hwr DLO could not unregister host memory; the lease stays open")
        if not restore_allgather_weights and handles:
            self._poisoned_reason = (
                "Distributed layerwise offload skipped AllGather weight restoration; "
                "recreate the backend and reload the pipeline before retrying")
        super()._disable(restore_allgather_weights=restore_allgather_weights)
