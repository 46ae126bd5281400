"""Test fixtures: tiny DiT-shaped models and a real mmapped safetensors lease double.

``SafetensorsLease`` implements ``HostLease`` over a real read-only ``mmap`` of a file written
with ``safetensors.torch.save_file``: its tensors are ``torch.frombuffer`` views of the mapped
pages. It counts ``close()`` calls and keeps an event log shared with test probes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from hwr.client.safetensors_header import read_header
from hwr.dlo_backend.file_lease import FileLease


class Block(nn.Module):
    """A DiT-ish block: fp32 norm/MLP, a transposed fp32 weight, a bf16 gate, buffers."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        # Stored transposed (stride (1, dim)), as FP8/col-major checkpoints are.
        self.proj_t = nn.Parameter(torch.randn(dim, dim).t() / dim**0.5)
        self.gate = nn.Linear(dim, dim, dtype=torch.bfloat16)
        self.register_buffer("scale", torch.rand(dim))
        self.register_buffer("offset", torch.full((dim,), 0.01), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))
        h = h @ self.proj_t
        g = self.gate(x.to(torch.bfloat16)).float()
        return x + h * self.scale + 0.1 * g + self.offset


class SingleBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


class TinyDiT(nn.Module):
    """Two stacks (``blocks`` with heterogeneous hidden sizes, ``single_blocks``) around non-block layers."""

    _layerwise_offload_blocks_attrs = ("blocks", "single_blocks")

    def __init__(self, depth: int = 3, single: int = 2, dim: int = 16, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(Block(dim, dim * (2 + i % 3)) for i in range(depth))
        self.single_blocks = nn.ModuleList(SingleBlock(dim) for _ in range(single))
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        for block in self.single_blocks:
            x = block(x)
        return self.out(x)


def block_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Persistent tensors (``state_dict`` names) of the model, detached clones."""
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


class SafetensorsLease(FileLease):
    """A ``HostLease`` over a real read-only mapping of a safetensors file (``FileLease``), which
    records its ``close()`` calls; 2-D tensors listed in the file's ``transposed`` metadata are
    restored as transposed views."""

    def __init__(self, path: Path, key: str = "k" * 64, log: list[str] | None = None) -> None:
        self.log = log if log is not None else []
        self.close_calls = 0
        meta = read_header(path, require_alignment=False).metadata or {}
        super().__init__(path, key=key, transposed=json.loads(meta.get("transposed", "[]")))

    @classmethod
    def write(cls, path: Path, tensors: Mapping[str, torch.Tensor], **kwargs: object) -> SafetensorsLease:
        """Save ``tensors`` (non-contiguous 2-D ones stored transposed) and map the file."""
        payload, transposed = {}, []
        for name, t in tensors.items():
            if t.dim() == 2 and not t.is_contiguous() and t.t().is_contiguous():
                payload[name] = t.t().contiguous()
                transposed.append(name)
            else:
                payload[name] = t.contiguous()
        save_file(payload, str(path), metadata={"transposed": json.dumps(transposed)})
        return cls(path, **kwargs)  # type: ignore[arg-type]

    def close(self) -> None:
        self.close_calls += 1
        self.log.append("close")
        super().close()
