"""Restore: bind a lease's tensors into a model skeleton, planned first, committed once.

    plan = plan_restore(skeleton, lease)   # validates, mutates nothing
    carrier = plan.commit()                # one-shot: binds, then hands the lease to a carrier
    apply_layerwise_offload(skeleton, device=..., host_source=carrier)   # takes it once

``plan_restore`` checks exact coverage: every ``state_dict`` entry of the skeleton (parameters
and persistent buffers) has a lease tensor with the same kind, shape, dtype and stride, and the
lease has nothing else. Tensors outside the ``state_dict`` (non-persistent buffers) must already
be real (not ``meta``): the skeleton builder creates them. A failure raises
``RestorePreflightFailed`` naming what differs; the model and the lease are untouched (the
caller closes the lease).

``commit`` replaces parameters with ``requires_grad=False`` parameters viewing the lease (tied
parameters stay tied) and buffers with the lease views, then returns a ``LeaseCarrier``. It runs
at most once; a failure part-way raises ``RestoreCommitFailed``, closes the lease, and the model
must be discarded (it is half bound).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hwr.client.carrier import HostLease, LeaseCarrier
from hwr.client.errors import RestoreCommitFailed, RestorePreflightFailed

__all__ = ["Binding", "RestorePlan", "plan_restore", "skeleton_entries"]


@dataclass(frozen=True)
class Binding:
    name: str
    module_path: str
    leaf: str
    kind: str  # "parameter" | "buffer"


def skeleton_entries(model: nn.Module) -> dict[str, tuple[Binding, torch.Tensor]]:
    """The model's ``state_dict`` names mapped to where they live and their current tensor."""
    entries: dict[str, tuple[Binding, torch.Tensor]] = {}
    for module_path, module in model.named_modules(remove_duplicate=False):
        prefix = f"{module_path}." if module_path else ""
        for leaf, param in module._parameters.items():
            if param is not None:
                entries[prefix + leaf] = (Binding(prefix + leaf, module_path, leaf, "parameter"), param)
        non_persistent = getattr(module, "_non_persistent_buffers_set", set())
        for leaf, buf in module._buffers.items():
            if buf is not None and leaf not in non_persistent:
                entries[prefix + leaf] = (Binding(prefix + leaf, module_path, leaf, "buffer"), buf)
    return entries


class RestorePlan:
    def __init__(self, model: nn.Module, lease: HostLease, bindings: list[Binding],
                 fault: Callable[[str], None] | None = None) -> None:
        self._model = model
        self._lease = lease
        self._bindings = bindings
        self._committed = False
        self._fault = fault

    @property
    def bindings(self) -> tuple[Binding, ...]:
        return tuple(self._bindings)

    def commit(self) -> LeaseCarrier:
        if self._committed:
            raise RestoreCommitFailed("a restore plan commits at most once")
        self._committed = True
        tensors = self._lease.tensors
        replaced: dict[int, nn.Parameter] = {}
        try:
            for binding in self._bindings:
                if self._fault is not None:
                    self._fault(binding.name)
                module = self._model.get_submodule(binding.module_path)
                view = tensors[binding.name]
                if binding.kind == "parameter":
                    original = module._parameters[binding.leaf]
                    param = replaced.get(id(original))
                    if param is None:
                        param = nn.Parameter(view, requires_grad=False)
                        replaced[id(original)] = param
                    module._parameters[binding.leaf] = param
                else:
                    module._buffers[binding.leaf] = view
        except Exception as exc:
            self._lease.close()
            raise RestoreCommitFailed(f"binding lease tensors failed at {binding.name!r}: {exc}",
                                      details={"tensor": binding.name}) from None
        return LeaseCarrier(self._lease)


def plan_restore(model: nn.Module, lease: HostLease, *, fault: Callable[[str], None] | None = None) -> RestorePlan:
    entries = skeleton_entries(model)
    tensors = lease.tensors
    manifest = getattr(lease, "manifest", None)
    kinds = {t.name: t.kind for t in manifest.tensors} if manifest is not None else {}
    missing = sorted(set(entries) - set(tensors))
    unexpected = sorted(set(tensors) - set(entries))
    mismatched: list[str] = []
    for name, (binding, current) in entries.items():
        view = tensors.get(name)
        if view is None:
            continue
        if (tuple(view.shape) != tuple(current.shape) or view.dtype != current.dtype
                or view.stride() != current.stride() or kinds.get(name, binding.kind) != binding.kind):
            mismatched.append(name)
    not_real = sorted(
        f"{path}.{leaf}" if path else leaf
        for path, module in model.named_modules()
        for leaf, buf in module._buffers.items()
        if buf is not None and buf.is_meta and leaf in getattr(module, "_non_persistent_buffers_set", set())
    )
    if missing or unexpected or mismatched or not_real:
        details: dict[str, Any] = {"missing": len(missing), "unexpected": len(unexpected),
                                   "mismatched": len(mismatched), "meta_buffers": len(not_real)}
        for label, names in (("first_missing", missing), ("first_unexpected", unexpected),
                             ("first_mismatched", mismatched), ("first_meta_buffer", not_real)):
            if names:
                details[label] = names[0]
        raise RestorePreflightFailed("the lease does not cover the model exactly", details=details)
    return RestorePlan(model, lease, [binding for binding, _ in entries.values()], fault)
