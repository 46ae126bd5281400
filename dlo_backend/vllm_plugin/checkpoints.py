"""Direct checkpoint mmap plans served by hwrd checkpoint leases.

vLLM-Omni 0.30 loads some DiTs (pipelines with ``_remap_ckpt_key``: Cosmos3, MAGI-2) without the
ordinary loader: ``build_checkpoint_mmap_plan`` binds every runtime tensor to a
``(checkpoint_key, file_path)`` of the canonical safetensors files, and the DLO backend realizes
that plan with ``safe_open`` mappings of its own. Through hwrd the files come from *checkpoint
leases* instead: the daemon keeps the registered checkpoint open and hands out read-only
descriptors of the exact registered files, so the node keeps one mapping owner and a worker
streams from the same page-cache pages as every other worker.

``lease_checkpoint_plan(plan, target)``:

1. refuses a plan with a loader transform (MAGI-2's MoE head slices, MiniMax-H3's QKV reorder:
   the runtime tensor is then not a view of checkpoint bytes) with ``ValueError``;
2. opens every planned file itself, with the worker's own rights (a file the worker may not read
   is refused, ``PermissionDeniedError``: the daemon's access never stands in for the worker's);
3. finds the registered checkpoint (``hwrctl checkpoints add``) containing each file
   (``CheckpointNotFound`` when none does), leases it, and checks that the leased file is the
   one the worker opened (same device and inode, ``CheckpointModified`` otherwise);
4. returns ``CheckpointPlanLeases``: the runtime name -> leased view map (``tensors``), the
   mapped regions, and ``bind()``, which realizes the plan on the pipeline the way vLLM-Omni's
   backend does (DiTs to ``meta``, planned tensors bound to views, non-persistent buffers kept,
   ``post_load_weights`` and ``validate_loaded_weights`` run, no DiT tensor left on ``meta``).

The loader's coverage check is not repeated or changed: the plan was proven complete by
vLLM-Omni before it skipped ordinary materialization; ``bind`` only fails when a planned
checkpoint key is missing from the leased checkpoint (``CheckpointModified``).
Limits: one hwrd session per plan (opened here, closed by ``close()``); a checkpoint registered
under another path that holds the same files is not found (files are matched by path under the
registered path).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hwr.client import connect
from hwr.client.carrier import MappedRegion
from hwr.client.checkpoint_lease import CheckpointLease
from hwr.client.client import Client
from hwr.client.errors import CheckpointModified, CheckpointNotFound, PermissionDeniedError
from hwr.dlo_backend.vllm_plugin.config import DaemonTarget

__all__ = ["CheckpointPlanLeases", "lease_checkpoint_plan", "relative_in"]

log = logging.getLogger("hwr.vllm_plugin")


def relative_in(file: str, root: str) -> str | None:
    """``file``'s name relative to the registered ``root`` (a directory or the file itself), or None.

    Pure over paths (both made absolute, symlinks in the directories not resolved: an HF snapshot's
    files are links into its blobs and are registered under their snapshot names).
    """
    file, root = os.path.abspath(file), os.path.abspath(root)
    if file == root:
        return os.path.basename(file)
    if not file.startswith(root.rstrip("/") + "/"):
        return None
    return file[len(root.rstrip("/")) + 1:]


class CheckpointPlanLeases:
    """The checkpoint leases behind one plan; ``close()`` releases them and the session."""

    def __init__(self, client: Client, leases: list[CheckpointLease], tensors: dict[str, torch.Tensor]) -> None:
        self._client = client
        self._leases = leases
        self.tensors: Mapping[str, torch.Tensor] = tensors
        self.key = ",".join(lease.key[:12] for lease in leases)
        self.regions: tuple[MappedRegion, ...] = tuple(r for lease in leases for r in lease.mapped_regions)
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def bind(self, pipeline: nn.Module, dits: Any, *, restore_device: torch.device) -> None:
        """Realize the plan on ``pipeline``'s DiTs (``dits``: vLLM-Omni's resolved components)."""
        modules = [(component.path, component.module) for component in dits]
        kept: dict[int, dict[str, torch.Tensor]] = {}
        for _path, module in modules:
            kept[id(module)] = {name: buf.detach().clone() for name, buf in module.named_buffers()
                                if _non_persistent(module, name)}
        for _path, module in modules:  # nested DiTs: the parent's conversion covers the child
            if not any(p.is_meta for p in module.parameters()):
                module.to_empty(device="meta")
        for name, view in self.tensors.items():
            parent_path, _, leaf = name.rpartition(".")
            parent = pipeline.get_submodule(parent_path)
            target = parent._parameters.get(leaf)
            if target is not None:
                parent._parameters[leaf] = nn.Parameter(view, requires_grad=target.requires_grad)
            elif leaf in parent._buffers:
                parent._buffers[leaf] = view
            else:
                raise RuntimeError(f"host-weight plan target tensor {name!r} no longer exists")
        for path, module in modules:
            for name, buf in kept[id(module)].items():
                parent_path, _, leaf = name.rpartition(".")
                module.get_submodule(parent_path)._buffers[leaf] = buf.to(restore_device)
            post_load = getattr(module, "post_load_weights", None)
            if callable(post_load):
                post_load()
            validate = getattr(module, "validate_loaded_weights", None)
            if callable(validate):
                validate({n.removeprefix(f"{path}.") for n in self.tensors if n.startswith(f"{path}.")})
        left = [f"{path}.{name}" for path, module in modules for name, t in
                (*module.named_parameters(), *module.named_buffers())
                if t.is_meta and not _non_persistent(module, name)]
        if left:
            raise RuntimeError(f"the checkpoint plan left {len(left)} DiT tensors on meta (first: {left[:5]})")

    def close(self) -> None:
        """Release every checkpoint lease, then the session; idempotent."""
        if self._closed:
            return
        self._closed = True
        self.tensors = {}
        for lease in self._leases:
            lease.close()
        self._client.close()


def _non_persistent(module: nn.Module, name: str) -> bool:
    parent_path, _, leaf = name.rpartition(".")
    owner = module.get_submodule(parent_path) if parent_path else module
    return leaf in owner._non_persistent_buffers_set


def _own_identity(path: str) -> tuple[int, int]:
    """(device, inode) of ``path`` opened with this process's own rights."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except PermissionError:
        raise PermissionDeniedError(f"this worker may not read the checkpoint file {path}",
                                    details={"file": path}) from None
    except OSError as exc:
        raise CheckpointNotFound(f"cannot open the checkpoint file {path}: {exc.strerror}",
                                 details={"file": path}) from None
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    return st.st_dev, st.st_ino


def lease_checkpoint_plan(plan: Any, target: DaemonTarget) -> CheckpointPlanLeases:
    """Lease the plan's checkpoint files from hwrd (see the module docstring)."""
    transformed = sorted(name for name, b in plan.bindings.items() if b.transform is not None)
    if transformed:
        raise ValueError(f"the plan applies a checkpoint transform to {transformed[0]!r} (and {len(transformed) - 1} "
                         "more); a leased view cannot carry it")
    files = sorted({b.file_path for b in plan.bindings.values()})
    own = {path: _own_identity(path) for path in files}
    client = connect(target.socket, timeout=target.connect_timeout_s, client_name=f"vllm-omni-{os.getpid()}")
    leases: list[CheckpointLease] = []
    try:
        registered = [c for c in client.list_checkpoints() if c.get("state") == "ready"]
        by_file: dict[str, tuple[CheckpointLease, str]] = {}
        for path in files:
            match = next(((c, rel) for c in registered if (rel := relative_in(path, c["path"])) is not None), None)
            if match is None:
                raise CheckpointNotFound(f"no checkpoint registered with hwrd contains {path} "
                                         "(register it: hwrctl checkpoints add DIR)", details={"file": path})
            ckpt, rel = match
            lease = next((x for x in leases if x.key == ckpt["checkpoint_id"]), None)
            if lease is None:
                lease = client.acquire_checkpoint(ckpt["checkpoint_id"])
                leases.append(lease)
            if lease.file_ids.get(rel) != own[path]:
                raise CheckpointModified(f"{path} is not the file registered as {rel!r} in checkpoint "
                                         f"{lease.key[:12]}", details={"file": path})
            by_file[path] = (lease, rel)
        tensors: dict[str, torch.Tensor] = {}
        for name, binding in plan.bindings.items():
            lease, rel = by_file[binding.file_path]
            view = lease.tensors.get(binding.checkpoint_key)
            if view is None:
                raise CheckpointModified(f"checkpoint key {binding.checkpoint_key!r} is not in the leased {rel!r}",
                                         details={"file": binding.file_path})
            tensors[name] = view
    except BaseException:
        for lease in leases:
            with contextlib.suppress(Exception):
                lease.close()
        client.close()
        raise
    log.debug("leased %d checkpoint(s) for %d planned files under %s", len(leases), len(files),
              Path(files[0]).parent if files else "-")
    return CheckpointPlanLeases(client, leases, tensors)
