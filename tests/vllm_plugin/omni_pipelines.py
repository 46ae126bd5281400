"""Tiny vLLM-Omni pipelines for the harness: checkpoints in the loader's on-disk layout, DiT inputs.

Each ``PipelineSpec`` names a vLLM-Omni pipeline class (``model_class_name``, resolved by
vLLM-Omni's own registry), writes a random checkpoint at a tiny size in the folder layout its
loader reads (diffusers ``model_index.json`` plus one subfolder per component, each written by
diffusers or transformers themselves: nothing is committed, everything is generated at test
time), and runs one deterministic forward of the pipeline's DiT on inputs derived from a seed.
The DiT forward (not the whole denoise loop and VAE decode) is what a warm start restores and
what DLO streams; it is run inside vLLM-Omni's forward context by the worker.

Imports of diffusers, transformers and vLLM-Omni happen inside the functions (worker processes
only).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["PIPELINES", "PipelineSpec"]


@dataclass(frozen=True)
class PipelineSpec:
    """One pipeline the harness can drive."""

    name: str
    model_class_name: str
    write_checkpoint: Callable[[Path, int], None]
    dit_inputs: Callable[[int], dict[str, Any]]
    run_dit: Callable[[torch.nn.Module, dict[str, Any]], torch.Tensor]
    dit_attr: str = "transformer"
    extra_config: tuple[tuple[str, Any], ...] = ()


# --- FLUX.2-klein -----------------------------------------------------------------------------
_FLUX2_DIT = {"patch_size": 1, "in_channels": 16, "num_layers": 2, "num_single_layers": 2,
              "attention_head_dim": 16, "num_attention_heads": 2, "joint_attention_dim": 32,
              "timestep_guidance_channels": 16, "mlp_ratio": 2.0, "axes_dims_rope": (4, 4, 4, 4),
              "guidance_embeds": False}
# Benchmarks scale the DiT up (benchmarks/vllm_omni_dlo.py): a JSON object of Flux2Transformer2DModel
# arguments that replace the tiny ones above, in the process that writes and the ones that load.
_FLUX2_DIT.update(json.loads(os.environ.get("HWR_BENCH_FLUX2_DIT", "{}")))
_FLUX2_IMAGE_TOKENS, _FLUX2_TEXT_TOKENS = 16, 8


def _write_qwen_tokenizer(folder: Path) -> None:
    """A byte-level BPE tokenizer with a 32-token vocabulary, saved as ``Qwen2TokenizerFast``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import Qwen2TokenizerFast

    vocab = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    vocab.update({ch: i + 3 for i, ch in enumerate("abcdefghijklmnopqrstuvwxyz ĠĊ")})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    Qwen2TokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>",
                       pad_token="<|endoftext|>").save_pretrained(folder)


def _write_flux2_klein(root: Path, seed: int) -> None:
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    FlowMatchEulerDiscreteScheduler().save_pretrained(root / "scheduler")
    _write_qwen_tokenizer(root / "tokenizer")
    text = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
                       tie_word_embeddings=False)
    Qwen3ForCausalLM(text).to(torch.bfloat16).save_pretrained(root / "text_encoder")
    AutoencoderKLFlux2(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",),
                       up_block_types=("UpDecoderBlock2D",), block_out_channels=(8,), layers_per_block=1,
                       latent_channels=4, norm_num_groups=4, sample_size=32).save_pretrained(root / "vae")
    Flux2Transformer2DModel(**_FLUX2_DIT).to(torch.bfloat16).save_pretrained(root / "transformer")
    index = {"_class_name": "Flux2KleinPipeline", "_diffusers_version": "0.40.0", "is_distilled": True,
             "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
             "text_encoder": ["transformers", "Qwen3ForCausalLM"],
             "tokenizer": ["transformers", "Qwen2TokenizerFast"],
             "transformer": ["diffusers", "Flux2Transformer2DModel"],
             "vae": ["diffusers", "AutoencoderKLFlux2"]}
    (root / "model_index.json").write_text(json.dumps(index, indent=1))


def _flux2_inputs(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    image = torch.zeros(_FLUX2_IMAGE_TOKENS, 4)
    image[:, 1], image[:, 2] = torch.arange(_FLUX2_IMAGE_TOKENS) // 4, torch.arange(_FLUX2_IMAGE_TOKENS) % 4
    text = torch.zeros(_FLUX2_TEXT_TOKENS, 4)
    text[:, 3] = torch.arange(_FLUX2_TEXT_TOKENS)
    return {
        "hidden_states": torch.randn(1, _FLUX2_IMAGE_TOKENS, _FLUX2_DIT["in_channels"], generator=g).to(torch.bfloat16),
        "encoder_hidden_states": torch.randn(1, _FLUX2_TEXT_TOKENS, _FLUX2_DIT["joint_attention_dim"],
                                             generator=g).to(torch.bfloat16),
        "timestep": torch.rand(1, generator=g),
        "img_ids": image,
        "txt_ids": text,
    }


def _flux2_forward(dit: torch.nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
    return dit(**inputs, return_dict=False)[0]


PIPELINES: dict[str, PipelineSpec] = {
    "flux2-klein": PipelineSpec("flux2-klein", "Flux2KleinPipeline", _write_flux2_klein, _flux2_inputs,
                                _flux2_forward),
}
