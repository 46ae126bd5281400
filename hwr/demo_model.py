"""A small DiT-shaped transformer for the demo, tests and benchmarks.

Shape of a real diffusion transformer where it matters to the host side: a patch embedding,
``depth`` identical blocks (adaLN modulation, attention, MLP) declared for layerwise offload,
and a final projection. ``canonical_checkpoint`` writes deterministic fp32 weights as safetensors;
the *final layout* a worker runs is bf16 (``final_layout``), so loading canonically costs a cast
into private memory while a lease maps the bf16 artifact.

Names match ``state_dict``: ``x_embed.*``, ``blocks.{i}.{adaln,attn.qkv,attn.proj,mlp.fc1,mlp.fc2}.*``,
``final.*``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "DemoConfig",
    "DemoDiT",
    "Linear",
    "build_skeleton",
    "canonical_checkpoint",
    "final_layout",
    "load_canonical",
]


@dataclass(frozen=True)
class DemoConfig:
    hidden: int = 256
    depth: int = 4
    heads: int = 4
    in_channels: int = 64

    @classmethod
    def for_size(cls, size_mb: float, hidden: int = 1024, heads: int = 16) -> DemoConfig:
        """A config whose fp32 checkpoint is about ``size_mb`` MiB."""
        per_block = (18 * hidden * hidden + 15 * hidden) * 4
        return cls(hidden=hidden, depth=max(2, round(size_mb * (1 << 20) / per_block)), heads=heads)


class Linear(nn.Linear):
    """``nn.Linear`` that skips random initialisation on the meta device.

    A skeleton's weights are always bound to a lease or loaded from the checkpoint afterwards, so
    initialising meta tensors is pure Python overhead (about half of building the skeleton) that
    the cold and the warm start would both pay. Real devices initialise as ``nn.Linear`` does.
    """

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            super().reset_parameters()


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = Linear(hidden, 3 * hidden)
        self.proj = Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc1 = Linear(hidden, 4 * hidden)
        self.fc2 = Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class DiTBlock(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.adaln = Linear(hidden, 6 * hidden)
        self.attn = Attention(hidden, heads)
        self.mlp = MLP(hidden)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift1, scale1, gate1, shift2, scale2, gate2 = self.adaln(F.silu(c)).unsqueeze(1).chunk(6, dim=-1)
        h = F.layer_norm(x, x.shape[-1:]) * (1 + scale1) + shift1
        x = x + gate1 * self.attn(h)
        h = F.layer_norm(x, x.shape[-1:]) * (1 + scale2) + shift2
        return x + gate2 * self.mlp(h)


class DemoDiT(nn.Module):
    _layerwise_offload_blocks_attrs = ("blocks",)

    def __init__(self, config: DemoConfig) -> None:
        super().__init__()
        self.config = config
        self.x_embed = Linear(config.in_channels, config.hidden)
        self.blocks = nn.ModuleList(DiTBlock(config.hidden, config.heads) for _ in range(config.depth))
        self.final = Linear(config.hidden, config.in_channels)

    def timestep_embedding(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        half = self.config.hidden // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32) / half)
        args = t.float()[:, None] * freqs[None]
        return torch.cat([torch.cos(args), torch.sin(args)], dim=-1).to(dtype)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        dtype = self.x_embed.weight.dtype
        h = self.x_embed(x.to(dtype))
        c = self.timestep_embedding(t, dtype)
        for block in self.blocks:
            h = block(h, c)
        return self.final(h)


def build_skeleton(config: DemoConfig, *, device: str = "meta", dtype: torch.dtype = torch.bfloat16) -> DemoDiT:
    """The model with no weights loaded (``meta``), in the final layout's dtype."""
    with torch.device(device):
        return DemoDiT(config).to(dtype)


def canonical_checkpoint(config: DemoConfig, path: Path, *, seed: int = 0) -> Path:
    """Write deterministic fp32 weights for ``config`` to ``path`` (safetensors)."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    skeleton = build_skeleton(config)
    tensors = {name: torch.randn(tuple(t.shape), generator=gen, dtype=torch.float32) * 0.02
               for name, t in skeleton.state_dict().items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path))
    return path


def final_layout(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The final-layout transform: floating tensors cast to bf16 (new, private memory)."""
    return {name: t.to(torch.bfloat16) if t.is_floating_point() else t for name, t in tensors.items()}


def load_canonical(config: DemoConfig, checkpoint: Path) -> DemoDiT:
    """The canonical path a worker takes without hwr: read the checkpoint, cast, assign."""
    from safetensors.torch import load_file

    model = build_skeleton(config)
    model.load_state_dict(final_layout(load_file(str(checkpoint))), assign=True, strict=True)
    return model
