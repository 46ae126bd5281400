"""A tiny Cosmos3 checkpoint for the harness, in the layout vLLM-Omni's ``Cosmos3OmniDiffusersPipeline`` reads.

Cosmos3 is the DiT vLLM-Omni 0.30 loads by *direct checkpoint mmap*: its pipeline declares
``_remap_ckpt_key`` (checkpoint keys in the prefixless diffusers namespace of the source
checkpoint, one decoder layer per index holding both the understanding (UND) and generation
(GEN) weights, mapped onto ``transformer.language_model.layers.*`` and
``transformer.gen_layers.*``), the loader's ``build_checkpoint_mmap_plan`` binds every runtime
tensor to a ``(checkpoint key, file)`` through its Cosmos3 adapter, and DLO streams two rings
(UND ``language_model.layers``, GEN ``gen_layers``).

What is written (everything generated at test time, random, tiny):

- ``model_index.json`` naming ``Cosmos3OmniDiffusersPipeline``;
- ``scheduler/``: vLLM-Omni's own ``FlowUniPCMultistepScheduler`` config;
- ``text_tokenizer/``: a 32-token byte-level BPE saved as ``Qwen2TokenizerFast`` (local files);
- ``vae/``: diffusers' ``AutoencoderKLWan`` at a tiny width (``scale_factor_temporal`` set, which
  Cosmos3 requires; vLLM-Omni loads it as its ``DistributedAutoencoderKLWan``);
- ``transformer/config.json``: a Qwen3-VL text config (transformers' ``Qwen3VLTextConfig``,
  M-RoPE sections summing to half the head width) plus Cosmos3's own keys (latent patching,
  two-way joint attention, unified 3D M-RoPE), read by vLLM-Omni as ``tf_model_config``;
- ``transformer/*.safetensors`` (two shards and an index, as real checkpoints are split):
  written in the worker after its distributed setup (``complete``), from vLLM-Omni's own
  ``Cosmos3VFMTransformer`` built from that config: each runtime tensor saved under the
  source-checkpoint key that Cosmos3's real ``_remap_ckpt_key`` maps back to it (checked key by
  key with that function), plus an ``lm_head.weight`` the remap skips, as in the real checkpoint.

The DiT forward is one GEN denoise step on a 1x4x4 latent with a 4-token prompt; the UND K/V
cache is reset before each forward so both rings run every time.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

__all__ = ["ARCH", "complete_checkpoint", "dit_inputs", "run_dit", "write_checkpoint"]

# Head width 16: M-RoPE sections (T, H, W) must sum to 8.
ARCH = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 16, "vocab_size": 64, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "max_position_embeddings": 256,
        "rope_scaling": {"rope_type": "default", "mrope_section": [4, 2, 2], "mrope_interleaved": True}}
_COSMOS3 = {"latent_channel": 4, "latent_patch_size": 2, "qk_norm_for_diffusion": True, "qk_norm_for_text": True,
            "position_embedding_type": "unified_3d_mrope", "unified_3d_mrope_reset_spatial_ids": True,
            "joint_attn_implementation": "two_way", "timestep_scale": 0.001, "base_fps": 24.0,
            "enable_fps_modulation": True, "temporal_compression_factor": 4}
_LATENT = (1, 4, 4)  # (t, h, w)
_TEXT_TOKENS = 4

# Runtime name prefix -> source-checkpoint key prefix: the inverse of Cosmos3's _LAYER_MAP.
_UND = {"self_attn.to_q.": "self_attn.to_q.", "self_attn.to_k.": "self_attn.to_k.",
        "self_attn.to_v.": "self_attn.to_v.", "self_attn.to_out.": "self_attn.to_out.",
        "self_attn.norm_q.": "self_attn.norm_q.", "self_attn.norm_k.": "self_attn.norm_k.",
        "self_attn.k_norm_und_for_gen.": "self_attn.k_norm_und_for_gen.",
        "input_layernorm.": "input_layernorm.", "post_attention_layernorm.": "post_attention_layernorm.",
        "mlp.gate_proj.": "mlp.gate_proj.", "mlp.up_proj.": "mlp.up_proj.", "mlp.down_proj.": "mlp.down_proj."}
_GEN = {"cross_attention.to_q.": "self_attn.add_q_proj.", "cross_attention.to_k.": "self_attn.add_k_proj.",
        "cross_attention.to_v.": "self_attn.add_v_proj.", "cross_attention.to_out.": "self_attn.to_add_out.",
        "cross_attention.norm_q.": "self_attn.norm_added_q.", "cross_attention.norm_k.": "self_attn.norm_added_k.",
        "input_layernorm.": "input_layernorm_moe_gen.",
        "post_attention_layernorm.": "post_attention_layernorm_moe_gen.",
        "mlp.gate_proj.": "mlp_moe_gen.gate_proj.", "mlp.up_proj.": "mlp_moe_gen.up_proj.",
        "mlp.down_proj.": "mlp_moe_gen.down_proj."}


def _source_key(runtime: str) -> str:
    """The source-checkpoint key of a runtime tensor name (relative to the transformer)."""
    for prefix, table in (("language_model.layers.", _UND), ("gen_layers.", _GEN)):
        if runtime.startswith(prefix):
            index, _, rest = runtime[len(prefix):].partition(".")
            for leaf, source in table.items():
                if rest.startswith(leaf):
                    return f"layers.{index}.{source}{rest[len(leaf):]}"
            raise KeyError(f"no Cosmos3 checkpoint key maps to {runtime!r}")
    if runtime.startswith("language_model."):
        return runtime[len("language_model."):]  # embed_tokens.*, norm.*
    return runtime  # proj_in/proj_out/time_embedder/norm_moe_gen: top level in both


def write_checkpoint(root: Path, seed: int) -> None:
    """Everything but the DiT's weights (see the module docstring)."""
    from diffusers import AutoencoderKLWan
    from omni_pipelines import _write_qwen_tokenizer
    from transformers import Qwen3VLTextConfig
    from vllm_omni.diffusion.models.schedulers.scheduling_flow_unipc_multistep import FlowUniPCMultistepScheduler

    torch.manual_seed(seed)
    FlowUniPCMultistepScheduler().save_pretrained(root / "scheduler")
    _write_qwen_tokenizer(root / "text_tokenizer")
    AutoencoderKLWan(base_dim=8, z_dim=_COSMOS3["latent_channel"], dim_mult=[1, 1], num_res_blocks=1,
                     temperal_downsample=[False], latents_mean=[0.0] * 4, latents_std=[1.0] * 4,
                     scale_factor_temporal=4, scale_factor_spatial=16).save_pretrained(root / "vae")
    text = Qwen3VLTextConfig(**ARCH).to_dict()
    (root / "transformer").mkdir(parents=True, exist_ok=True)
    (root / "transformer" / "config.json").write_text(json.dumps(
        {"_class_name": "Cosmos3VFMTransformer", "_diffusers_version": "0.40.0", **text, **ARCH, **_COSMOS3},
        indent=1))
    (root / "model_index.json").write_text(json.dumps({
        "_class_name": "Cosmos3OmniDiffusersPipeline", "_diffusers_version": "0.40.0",
        "scheduler": ["diffusers", "FlowUniPCMultistepScheduler"],
        "text_tokenizer": ["transformers", "Qwen2TokenizerFast"],
        "transformer": ["diffusers", "Cosmos3VFMTransformer"], "vae": ["diffusers", "AutoencoderKLWan"]}, indent=1))


def complete_checkpoint(root: Path, seed: int, od_config: Any) -> None:
    """The DiT's source checkpoint, from vLLM-Omni's own ``Cosmos3VFMTransformer`` (random, bf16)."""
    from safetensors.torch import save_file
    from vllm_omni.diffusion.models.cosmos3.pipeline_cosmos3 import Cosmos3OmniDiffusersPipeline
    from vllm_omni.diffusion.models.cosmos3.transformer_cosmos3 import Cosmos3VFMTransformer

    folder = root / "transformer"
    if (folder / "diffusion_pytorch_model.safetensors.index.json").exists():
        return
    g = torch.Generator().manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(od_config.dtype)  # as the loader builds it (set_default_torch_dtype)
    try:
        with torch.device("cpu"):
            dit = Cosmos3VFMTransformer(od_config, temporal_compression_factor=4)
    finally:
        torch.set_default_dtype(default)
    state: dict[str, torch.Tensor] = {}
    for name, tensor in dit.state_dict().items():
        key = _source_key(name)
        remapped = Cosmos3OmniDiffusersPipeline._remap_ckpt_key(f"transformer.{key}")
        if remapped != f"transformer.{name}":  # the tiny checkpoint speaks Cosmos3's real key scheme
            raise AssertionError(f"Cosmos3's _remap_ckpt_key maps {key!r} to {remapped!r}, not {name!r}")
        if tensor.is_floating_point():
            value = torch.randn(tensor.shape, generator=g) * 0.2
            if name.endswith("norm.weight") or "layernorm" in name or "norm_q" in name or "norm_k" in name:
                value = 1.0 + value * 0.1  # RMSNorm scales near one, as trained ones are
            state[key] = value.to(tensor.dtype)
        else:
            state[key] = tensor.detach().clone()
    state["lm_head.weight"] = torch.randn(ARCH["vocab_size"], ARCH["hidden_size"], generator=g).to(torch.bfloat16)
    names = sorted(state)
    half = len(names) // 2
    index: dict[str, str] = {}
    for number, part in enumerate((names[:half], names[half:]), start=1):
        file = f"diffusion_pytorch_model-{number:05d}-of-00002.safetensors"
        save_file({n: state[n].contiguous() for n in part}, str(folder / file))
        index.update(dict.fromkeys(part, file))
    (folder / "diffusion_pytorch_model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": index}, indent=1))


def dit_inputs(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    t, h, w = _LATENT
    return {
        "hidden_states": torch.randn(1, _COSMOS3["latent_channel"], t, h, w, generator=g).to(torch.bfloat16),
        "timestep": torch.rand(1, generator=g) * 1000,
        "text_ids": torch.randint(3, ARCH["vocab_size"], (1, _TEXT_TOKENS), generator=g),
        "text_mask": torch.ones(1, _TEXT_TOKENS, dtype=torch.long),
        "video_shape": _LATENT,
        "fps": 24.0,
    }


def run_dit(dit: torch.nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
    dit.reset_cache()  # the UND K/V cache: each forward runs both rings
    out = dit(**inputs)
    return (out[0] if isinstance(out, tuple) else out).float()
