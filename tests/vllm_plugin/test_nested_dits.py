"""The CHECKPOINT path's planner fix: a DiT nested in another is covered by the enclosing DiT's source.

``gate.nested_dits`` is pure; the wrapper around vLLM-Omni's ``_planned_source_prefixes`` is
exercised with vLLM-Omni's own function: unchanged outside a CHECKPOINT load, widened inside one,
still refusing a DiT that no source covers. Cosmos3 end to end: ``test_omni_cosmos3``.
"""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest

from hwr.dlo_backend.vllm_plugin.gate import nested_dits


def test_a_dit_inside_a_sourced_dit_is_nested() -> None:
    assert nested_dits(["transformer.language_model", "transformer"], {"transformer."}) == {
        "transformer.language_model"}


def test_dits_with_own_sources_or_no_enclosing_source_are_not_nested() -> None:
    assert nested_dits(["transformer", "transformer_2"], {"transformer.", "transformer_2."}) == set()
    assert nested_dits(["transformer.language_model", "transformer"], {"text_encoder."}) == set()
    # "transformer_2" is not inside "transformer" (a dotted path, not a string prefix).
    assert nested_dits(["transformer_2", "transformer"], {"transformer."}) == set()


@pytest.mark.skipif(importlib.util.find_spec("vllm_omni") is None, reason="needs vLLM-Omni (scripts/setup-vllm.sh)")
def test_the_planner_wrapper_widens_vllm_omnis_check_only_on_a_checkpoint_load(plugin) -> None:
    import vllm_omni.diffusion.model_loader.host_weight_plan as planning

    from hwr.dlo_backend.vllm_plugin import gate

    sources = [SimpleNamespace(prefix="transformer.")]
    dits = [("transformer.language_model", object()), ("transformer", object())]
    wrapped = planning._planned_source_prefixes
    assert wrapped.__wrapped__ is not wrapped  # installed by the plugin fixture
    gate._checkpoint_load.active = False
    with pytest.raises(Exception, match=r"missing prefixes: \['transformer.language_model.'\]"):
        wrapped(sources, dits)  # vLLM-Omni's own refusal, unchanged
    gate._checkpoint_load.active = True
    try:
        assert wrapped(sources, dits) == {"transformer.", "transformer.language_model."}
        with pytest.raises(Exception, match=r"missing prefixes: \['text_encoder.'\]"):
            wrapped(sources, [*dits, ("text_encoder", object())])  # no source covers it: still refused
    finally:
        gate._checkpoint_load.active = False
