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
    #: Writes the parts of the checkpoint only vLLM-Omni's own classes can lay out, in the worker
    #: after its distributed setup (before the first start): (root, seed, OmniDiffusionConfig).
    complete_checkpoint: Callable[[Path, int, Any], None] | None = None
    #: The ``model`` argument, relative to the checkpoint root (some pipelines read a subfolder).
    model_subpath: str = ""


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


# --- MiniMax-H3 (FL2VA partition, no local text encoder) -----------------------------------------
# Latent widths are the real ones: vLLM-Omni's packed-row builders fix them (96 video, 32 audio).
_H3_ARCH = {"num_layers": 2, "token_refiner_num_layers": 2, "hidden_size": 32, "num_attention_heads": 2,
            "attention_head_dim": 16, "ffn_hidden_size": 64, "latents_dim": 24, "audio_latents_dim": 32,
            "patch_size": [1, 2, 2], "text_dim": 32, "timestep_input_dim": 16, "time_embed_hidden_size": 32,
            "time_embed_dim": 16, "adaln_out_features": 18 * 32, "final_adaln_out_features": 64,
            "rope_inv_freq_len": 2}

# MiniMax-H3's VAEs are modeling code shipped inside its checkpoint (``auto_map.AutoModel``, loaded
# with --trust-remote-code); neither vLLM-Omni nor diffusers/transformers carry it. A tiny
# checkpoint therefore ships tiny VAE code of its own: the parts vLLM-Omni's adapters look up
# (``model.encoder`` ...), no decoder (the harness never decodes).
_H3_VAE_PARALLEL = '''
_STATE = {}


def get_parallel_state():
    return _STATE
'''
_H3_VAE_CODE = '''
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from .parallel import get_parallel_state  # noqa: F401  (vLLM-Omni reads the package's parallel state)


class TinyH3VAEConfig(PretrainedConfig):
    model_type = "hwr_tiny_h3_vae"

    def __init__(self, parts=("encoder",), channels=4, **kwargs):
        super().__init__(**kwargs)
        self.parts = list(parts)
        self.channels = channels


class TinyH3VAE(PreTrainedModel):
    config_class = TinyH3VAEConfig
    base_model_prefix = "model"

    def __init__(self, config):
        super().__init__(config)
        self.model = nn.Module()
        for name in config.parts:
            setattr(self.model, name, nn.Linear(config.channels, config.channels))
        self.post_init()

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight)
            nn.init.zeros_(module.bias)
'''


def _import_folder_module(folder: Path, name: str) -> Any:
    """Import ``folder/name.py`` as a module of a package named after the folder."""
    import importlib
    import sys

    sys.path.insert(0, str(folder.parent))
    try:
        (folder / "__init__.py").touch()
        return importlib.import_module(f"{folder.name}.{name}")
    finally:
        sys.path.remove(str(folder.parent))
        (folder / "__init__.py").unlink()


def _write_minimax_h3(root: Path, seed: int) -> None:
    partition = root / "FL2VA"
    for name, parts, extra in (("video_vae", ("encoder", "quant_conv", "post_quant_conv"), {}),
                               ("audio_vae", ("encoder", "pre_block", "mean_proj"), {"sample_rate": 16000})):
        folder = partition / name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "modeling_tiny_h3_vae.py").write_text(_H3_VAE_CODE)
        (folder / "parallel.py").write_text(_H3_VAE_PARALLEL)
        module = _import_folder_module(folder, "modeling_tiny_h3_vae")
        torch.manual_seed(seed)
        config = module.TinyH3VAEConfig(
            parts=parts, channels=4, latent_channels=4, latents_mean=[0.0] * 4, latents_std=[1.0] * 4,
            auto_map={"AutoConfig": "modeling_tiny_h3_vae.TinyH3VAEConfig",
                      "AutoModel": "modeling_tiny_h3_vae.TinyH3VAE"}, **extra)
        module.TinyH3VAE(config).save_pretrained(folder)
    (partition / "transformer").mkdir(parents=True, exist_ok=True)
    (partition / "transformer" / "config.json").write_text(json.dumps({"_class_name": "MiniMaxH3DiTModel",
                                                                        **_H3_ARCH}, indent=1))
    (partition / "model_index.json").write_text(json.dumps({
        "_class_name": "MiniMaxH3Pipeline", "_diffusers_version": "0.40.0",
        "_minimax_h3": {"partition": "fl2va", "tasks": ["t2va", "fl2va"]}}, indent=1))


def _complete_minimax_h3(root: Path, seed: int, od_config: Any) -> None:
    """The DiT's native checkpoint: vLLM-Omni's ``MiniMaxH3DiTModel`` at the tiny size, random."""
    from safetensors.torch import save_file
    from vllm_omni.diffusion.models.minimax_h3.minimax_h3_transformer import MiniMaxH3DiTModel

    target = root / "FL2VA" / "transformer" / "diffusion_pytorch_model.safetensors"
    if target.exists():
        return
    g = torch.Generator().manual_seed(seed)
    with torch.device("cpu"):
        dit = MiniMaxH3DiTModel(od_config)
    state = {}
    for name, tensor in dit.state_dict().items():
        if name == "rope.inv_freq":  # the checkpoint's RoPE frequencies (theta 10000), as the model computes them
            half = tensor.numel()
            state[name] = 1.0 / (10000.0 ** (torch.arange(0, 2 * half, 2, dtype=torch.float32) / (2 * half)))
        elif tensor.is_floating_point():
            state[name] = (torch.randn(tensor.shape, generator=g) * 0.1).to(tensor.dtype)
        else:
            state[name] = tensor.detach().clone()
    save_file(state, str(target))


def _h3_inputs(seed: int) -> dict[str, Any]:
    """One T2VA denoise step's DiT kwargs, built by vLLM-Omni's own packing (one request)."""
    from vllm_omni.diffusion.models.minimax_h3.denoise_loop import MiniMaxH3DenoiseBranch
    from vllm_omni.diffusion.models.minimax_h3.packed_sequence import minimax_h3_packed_sequence

    g = torch.Generator().manual_seed(seed)
    text_len, latent_t, latent_h, latent_w, audio_t = 4, 1, 4, 4, 2
    packed = minimax_h3_packed_sequence(text_len=text_len, latent_t=latent_t, latent_h=latent_h, latent_w=latent_w,
                                        audio_t=audio_t, include_keyframe_cond=False)
    branch = MiniMaxH3DenoiseBranch(packed=packed, text_embeddings=torch.randn(text_len, _H3_ARCH["text_dim"],
                                                                                generator=g).to(torch.bfloat16),
                                    token_tags=packed["token_tags"].clone(), device=torch.device("cpu"))
    return branch.forward_kwargs(
        video_rows=torch.randn(int(packed["img_pos"].numel()), 96, generator=g),
        audio_rows=torch.randn(int(packed["audio_pos"].numel()), 32, generator=g),
        t_video=0.75, t_audio=0.75, imgvid_cond_timestep=0.0, audio_ref_cond_timestep=0.0)


def _h3_forward(dit: torch.nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
    video, audio = dit(**inputs)
    return torch.cat([video.float().reshape(-1), audio.float().reshape(-1)])


PIPELINES["minimax-h3"] = PipelineSpec(
    "minimax-h3", "MiniMaxH3Pipeline", _write_minimax_h3, _h3_inputs, _h3_forward,
    extra_config=(("model_loaded", {"transformer": True, "vae": True, "text_encoder": False, "vae_encoder": True}),
                  ("trust_remote_code", True), ("task_type", "t2va")),
    complete_checkpoint=_complete_minimax_h3, model_subpath="FL2VA")


# --- Cosmos3 (direct checkpoint mmap; needs the CUDA-wheel environment: omni_cosmos3) -----------------
from omni_cosmos3 import complete_checkpoint as _c3_complete  # noqa: E402  (it imports PipelineSpec's module)
from omni_cosmos3 import dit_inputs as _c3_inputs  # noqa: E402
from omni_cosmos3 import run_dit as _c3_forward  # noqa: E402
from omni_cosmos3 import write_checkpoint as _c3_write  # noqa: E402

PIPELINES["cosmos3"] = PipelineSpec("cosmos3", "Cosmos3OmniDiffusersPipeline", _c3_write, _c3_inputs, _c3_forward,
                                    complete_checkpoint=_c3_complete)
