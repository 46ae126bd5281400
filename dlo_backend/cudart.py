"""The few CUDA runtime calls host registration makes, behind one small object (``CudaRuntime``).

Facts this relies on (checked against the sources, not run here):

- ``torch.cuda.cudart()`` binds ``cudaHostRegister(ptr, size, flags)`` and
  ``cudaHostUnregister(ptr)`` and returns their ``cudaError_t`` unchecked
  (``C10_CUDA_ERROR_HANDLED(EXPR)`` is just ``EXPR`` in ``c10/cuda/CUDAException.h``; bindings in
  ``torch/csrc/cuda/shared/cudart.cpp``). It binds neither ``cudaGetLastError`` nor
  ``cudaDeviceGetAttribute``.
- A failing runtime call also stores its error as the calling thread's "last error"
  (CUDA Runtime API, Error Handling: ``cudaGetLastError`` "returns the last error that has been
  produced by any of the runtime calls in the same instance of the CUDA Runtime library in the
  host thread and resets it to cudaSuccess"). torch checks every kernel launch with
  ``C10_CUDA_KERNEL_LAUNCH_CHECK()`` = ``C10_CUDA_CHECK(cudaGetLastError())``, so a failed
  registration left uncleared makes the *next unrelated kernel launch* on that thread raise.
- The last error lives in one *instance* of the runtime library: clearing it through a second
  copy of ``libcudart`` clears nothing. ``TorchCudaRuntime`` therefore only uses a
  ``libcudart`` that is already loaded in the process (the one torch's CUDA library links;
  found in ``/proc/self/maps``, or opened with ``RTLD_NOLOAD``). Where torch links the runtime
  statically there is none to find: the error is then drained through torch itself, by one
  tiny kernel launch whose launch check reads (and so resets) it.
- ``cudaDevAttrHostRegisterSupported`` (99) and ``cudaDevAttrHostRegisterReadOnlySupported``
  (113) say whether a device can register host memory at all, and read-only mappings
  (``cudaHostRegisterReadOnly``; a ``PROT_READ`` mapping cannot be registered without it).

Tests fake this object (the CUDA boundary), never torch.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Iterator
from typing import Protocol

__all__ = [
    "HOST_REGISTER_READ_ONLY_SUPPORTED",
    "HOST_REGISTER_SUPPORTED",
    "CudaRuntime",
    "TorchCudaRuntime",
    "loaded_cudart",
]

HOST_REGISTER_SUPPORTED = 99  # cudaDevAttrHostRegisterSupported
HOST_REGISTER_READ_ONLY_SUPPORTED = 113  # cudaDevAttrHostRegisterReadOnlySupported


class CudaRuntime(Protocol):
    """What ``registration`` needs from CUDA; every call runs on the calling thread."""

    def host_register(self, address: int, length: int, flags: int) -> int:
        """``cudaHostRegister``; the ``cudaError_t`` (0 = success)."""

    def host_unregister(self, address: int) -> int:
        """``cudaHostUnregister``; the ``cudaError_t`` (0 = success)."""

    def clear_last_error(self) -> bool:
        """Reset this thread's last CUDA error; True when it is known to be clear afterwards."""

    def attribute(self, attribute: int, device: int) -> int | None:
        """``cudaDeviceGetAttribute``, or ``None`` when it cannot be asked."""

    def on_device(self, device: int) -> contextlib.AbstractContextManager[None]:
        """Make ``device`` current inside the block (registration acts on the current device)."""

    def current_device(self) -> int:
        """The calling thread's current CUDA device."""


def loaded_cudart() -> ctypes.CDLL | None:
    """The ``libcudart`` instance already loaded in this process, or ``None``."""
    paths: list[str] = []
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                path = line.rstrip("\n").split(maxsplit=5)[-1]
                if "/libcudart.so" in path and path not in paths:
                    paths.append(path)
    except OSError:
        pass
    names = paths or ["libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so"]
    for name in names:
        try:
            # RTLD_NOLOAD: never load a second runtime instance, only find the loaded one.
            lib = ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        except OSError:
            continue
        if hasattr(lib, "cudaGetLastError") and hasattr(lib, "cudaDeviceGetAttribute"):
            lib.cudaGetLastError.restype = ctypes.c_int
            lib.cudaPeekAtLastError.restype = ctypes.c_int
            lib.cudaDeviceGetAttribute.restype = ctypes.c_int
            lib.cudaDeviceGetAttribute.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int]
            return lib
    return None


class TorchCudaRuntime:
    """``CudaRuntime`` over ``torch.cuda.cudart()`` plus the loaded ``libcudart`` (ctypes)."""

    def __init__(self) -> None:
        import torch

        self._torch = torch
        self._cudart = torch.cuda.cudart()
        self._lib = loaded_cudart()

    @property
    def direct(self) -> bool:
        """True when the loaded runtime library is reachable (errors cleared at the source)."""
        return self._lib is not None

    def host_register(self, address: int, length: int, flags: int) -> int:
        return int(self._cudart.cudaHostRegister(address, length, flags))

    def host_unregister(self, address: int) -> int:
        return int(self._cudart.cudaHostUnregister(address))

    def clear_last_error(self) -> bool:
        if self._lib is not None:
            self._lib.cudaGetLastError()
            return int(self._lib.cudaPeekAtLastError()) == 0
        # No reachable runtime instance: let torch's own launch check read (and reset) it.
        device = self._torch.cuda.current_device()
        with contextlib.suppress(RuntimeError):
            self._torch.zeros(1, device=device)
        try:
            self._torch.zeros(1, device=device)
        except RuntimeError:
            return False
        return True

    def attribute(self, attribute: int, device: int) -> int | None:
        if self._lib is None:
            return None
        value = ctypes.c_int(0)
        if int(self._lib.cudaDeviceGetAttribute(ctypes.byref(value), attribute, device)) != 0:
            self._lib.cudaGetLastError()  # the failed query must not poison a later launch either
            return None
        return int(value.value)

    @contextlib.contextmanager
    def on_device(self, device: int) -> Iterator[None]:
        with self._torch.cuda.device(device):
            yield

    def current_device(self) -> int:
        return int(self._torch.cuda.current_device())
