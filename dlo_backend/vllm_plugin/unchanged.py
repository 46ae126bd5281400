"""Proof that a restored final-layout tensor is unchanged, from metadata, for tensors leased from hwrd.

vLLM-Omni 0.30's loader snapshots every restored final-layout tensor right after a warm restore
(``HWRLoaderMixin._snapshot_final_layout_tensors``: per tensor ``(storage pointer, sha256 of its
bytes)``) and again after the shared warm finalization (``_assert_final_layout_tensors_unchanged``,
which compares the two). Hashing reads every byte twice: O(model bytes) on every warm start.

For a tensor leased from hwrd that read is redundant. Its bytes are a read-only shared mapping
(``PROT_READ``, ``MAP_SHARED``) of a 0444 payload file that hwrd opened read-only and never
writes; the kernel refuses a write through the mapping (the process faults) and refuses to make
it writable (``mprotect`` on a read-only descriptor's shared mapping fails). hwrd hashed every
byte of the file when the artifact was committed (or adopted), and the manifest it sent carries
each tensor's SHA-256. So while the tensor is still *that* lease view (same storage, same
address, same layout, lease open), its bytes are the manifest's bytes; the mapping cannot go away
under it (the view's storage holds a buffer export of the mapping). The proof is that identity.

The seam is the snapshot function itself (the narrowest one: both snapshots go through it, and
nothing else reads its result but the equality check). The plugin wraps the static method:

    tensor of ``names``                                   -> snapshot entry
    the registered lease view of the same name (storage    -> (storage pointer, "hwrd-lease:" +
      pointer, data pointer, nbytes, dtype, shape and         lease key, lease id, manifest sha256,
      stride all equal), lease open, region read-only          pointer, layout): no byte read
    anything else (private copy, other store, changed       -> vLLM-Omni's own entry (sha256 of the
      layout, closed lease, meta or missing tensor)            bytes, or its own error)

A tensor that was a lease view at the first snapshot and is anything else at the second gets a
different entry, so vLLM-Omni's comparison still reports it as changed. Leases register here when
the store wraps them (``register``) and leave when they close (the returned callable).

Contract: ``token`` is O(1) per tensor and never raises for a tensor; the wrapper returns the
same keys, in the same order, as vLLM-Omni's function. Thread-safe. ``install``/``uninstall``
are idempotent; the original is kept in ``__wrapped__``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["install", "installed", "register", "stats", "token", "uninstall"]

_MARK = "_hwr_vllm_unchanged"
_lock = threading.Lock()


@dataclass(frozen=True)
class _View:
    """What a lease view was when its lease was registered (metadata only: no tensor reference,
    so the registry never keeps a mapping alive past its lease)."""

    name: str
    data_ptr: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    sha256: str
    lease: str  # "<key>:<lease id>"


# storage data pointer -> the lease view that owns it (each lease view has its own storage).
_views: dict[int, _View] = {}
_proven = [0, 0]  # tensors proven from metadata, tensors left to vLLM-Omni's hash (this process)


def register(key: str, lease_id: str, tensors: Mapping[str, torch.Tensor], digests: Mapping[str, str],
             read_only: Callable[[int, int], bool]) -> Callable[[], None]:
    """Record an open hwrd lease's views; return the callable that forgets them (call it when the
    lease closes; idempotent). ``digests``: name -> the manifest's SHA-256; ``read_only(address,
    nbytes)``: whether that range lies in one of the lease's read-only mapped regions. Views that
    are empty, not in ``digests`` or not in a read-only region are not registered (they keep
    vLLM-Omni's hash)."""
    owner = f"{key}:{lease_id}"
    records: dict[int, _View] = {}
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        digest = digests.get(name)
        if not nbytes or digest is None:
            continue
        storage = tensor.untyped_storage()
        if storage.nbytes() != nbytes or not read_only(tensor.data_ptr(), nbytes):
            continue
        records[storage.data_ptr()] = _View(name, tensor.data_ptr(), nbytes, tensor.dtype, tuple(tensor.shape),
                                            tuple(tensor.stride()), digest, owner)
    with _lock:
        _views.update(records)

    def forget() -> None:
        with _lock:
            for pointer, view in records.items():
                if _views.get(pointer) is view:
                    del _views[pointer]
        records.clear()

    return forget


def token(name: str, tensor: torch.Tensor) -> str | None:
    """The metadata proof for ``tensor`` restored as ``name``, or None (hash it instead)."""
    try:
        if tensor.device.type != "cpu" or tensor.is_meta:
            return None
        storage = tensor.untyped_storage()
        view = _views.get(storage.data_ptr())
        if (view is None or view.name != name or storage.nbytes() != view.nbytes
                or tensor.data_ptr() != view.data_ptr or tensor.dtype != view.dtype
                or tuple(tensor.shape) != view.shape or tuple(tensor.stride()) != view.stride):
            return None
    except (RuntimeError, NotImplementedError):  # tensors without a plain storage: vLLM-Omni's check
        return None
    return f"hwrd-lease:{view.lease}:{view.sha256}:{view.data_ptr:#x}:{view.dtype}:{view.shape}:{view.stride}"


def stats() -> dict[str, int]:
    """Tensors this process proved from metadata and tensors it left to vLLM-Omni's hash."""
    return {"proven": _proven[0], "hashed": _proven[1]}


def _tensor_of(model: torch.nn.Module, name: str) -> torch.Tensor | None:
    parent_path, _, leaf = name.rpartition(".")
    try:
        parent = model.get_submodule(parent_path)
    except AttributeError:
        return None
    tensor = parent._parameters.get(leaf)
    return parent._buffers.get(leaf) if tensor is None else tensor


def _snapshot(original: Callable[..., dict[str, tuple[int, str]]], model: torch.nn.Module,
              names: Iterable[str]) -> dict[str, tuple[int, str]]:
    ordered = list(names)
    entries: dict[str, tuple[int, str]] = {}
    rest: list[str] = []
    for name in ordered:
        tensor = _tensor_of(model, name)
        proof = None if tensor is None else token(name, tensor)
        if proof is None:
            rest.append(name)
        else:
            assert tensor is not None
            entries[name] = (tensor.untyped_storage().data_ptr(), proof)
    if rest:
        entries.update(original(model, rest))  # raises for a missing or meta tensor, as upstream
    _proven[0] += len(ordered) - len(rest)
    _proven[1] += len(rest)
    return {name: entries[name] for name in ordered}


def _mixin() -> Any:
    from vllm_omni.diffusion.model_loader.host_weight_loader import HWRLoaderMixin

    return HWRLoaderMixin


def installed() -> bool:
    return getattr(_mixin().__dict__["_snapshot_final_layout_tensors"].__func__, _MARK, False)


def install() -> bool:
    """Wrap ``HWRLoaderMixin._snapshot_final_layout_tensors``; False when already wrapped."""
    mixin = _mixin()
    with _lock:
        original = mixin.__dict__["_snapshot_final_layout_tensors"].__func__
        if getattr(original, _MARK, False):
            return False

        def _snapshot_final_layout_tensors(model: torch.nn.Module, names: Iterable[str]) -> dict[str, tuple[int, str]]:
            return _snapshot(original, model, names)

        setattr(_snapshot_final_layout_tensors, _MARK, True)
        _snapshot_final_layout_tensors.__wrapped__ = original  # type: ignore[attr-defined]
        _snapshot_final_layout_tensors.__doc__ = original.__doc__
        mixin._snapshot_final_layout_tensors = staticmethod(_snapshot_final_layout_tensors)
        return True


def uninstall() -> bool:
    mixin = _mixin()
    with _lock:
        current = mixin.__dict__["_snapshot_final_layout_tensors"].__func__
        if not getattr(current, _MARK, False):
            return False
        mixin._snapshot_final_layout_tensors = staticmethod(current.__wrapped__)
        return True
