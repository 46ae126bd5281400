"""The ``vllm-omni`` producer's config allow-list: what an operator's ``--omni-config`` may say
to a process that runs with hwrd's rights (``hwr.client.omni_config``)."""

from __future__ import annotations

import json

import pytest

from hwr.client.errors import InvalidRequest
from hwr.client.omni_config import ALLOWED_KEYS, check_omni_config
from hwr.daemon.producers.vllm_omni import parse_config

SERVING = {"model_class_name": "Flux2KleinPipeline", "task_type": "t2va", "dtype": "bfloat16",
           "model_loaded": {"transformer": True, "vae": True, "text_encoder": False},
           "quantization": "fp8", "trust_remote_code": False,
           "parallel_config": {"data_parallel_size": 4, "ulysses_degree": 1, "tensor_parallel_size": 1}}


def test_a_serving_workers_layout_fields_pass() -> None:
    assert check_omni_config(SERVING) == SERVING
    assert parse_config(json.dumps(SERVING).encode()) == SERVING
    assert parse_config(b"", dtype="fp16") == {"dtype": "fp16"}


@pytest.mark.parametrize("key, value", [
    ("model", "/root/secret-model"),
    ("trust_remote_code", True),
    ("tokenizer", "/root/tok"),
    ("revision", "main"),
    ("download_dir", "/tmp/x"),
    ("hf_overrides", {"a": 1}),
    ("engine_backend", "os.system"),
    ("custom_pipeline_args", {"pipeline_class": "evil.Pipeline"}),
    ("diffusers_load_kwargs", {"cache_dir": "/root"}),
    ("model_config", {"path": "/etc"}),
    ("host_weight_runtime_root", "/tmp/r"),
    ("lora_path", "/root/lora"),
])
def test_a_key_that_could_choose_what_is_loaded_or_run_is_refused_by_name(key: str, value: object) -> None:
    with pytest.raises(InvalidRequest) as refused:
        parse_config(json.dumps({"model_class_name": "FluxPipeline", key: value}).encode())
    assert refused.value.code == "INVALID_ARGUMENT"
    assert refused.value.details["key"] == key and key in str(refused.value)


@pytest.mark.parametrize("key, value", [
    ("model_class_name", "os.path.Pipeline"),
    ("model_class_name", "../x"),
    ("model_class_name", "Flux\n"),
    ("task_type", "t2v/../../x"),
    ("task_type", "t2v\n"),
    ("dtype", "int4"),
    ("model_loaded", {"transformer": "yes"}),
    ("model_loaded", ["transformer"]),
    ("quantization", "/root/q.json"),
    ("quantization", {"quant_method": "fp8"}),
])
def test_an_allowed_key_with_a_value_that_is_not_a_name_is_refused(key: str, value: object) -> None:
    with pytest.raises(InvalidRequest) as refused:
        check_omni_config({key: value})
    assert refused.value.details["key"] == key


@pytest.mark.parametrize("parallel, key", [
    ({"ulysses_degree": 2}, "parallel_config.ulysses_degree"),
    ({"tensor_parallel_size": 2}, "parallel_config.tensor_parallel_size"),
    ({"hsdp_shard_size": 2}, "parallel_config.hsdp_shard_size"),
    ({"data_parallel_size": "2"}, "parallel_config.data_parallel_size"),
    ("not an object", "parallel_config"),
])
def test_parallel_config_is_an_allow_list_too(parallel: object, key: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        check_omni_config({"parallel_config": parallel})
    assert refused.value.details["key"] == key


@pytest.mark.parametrize("raw, why", [
    (b"[1]", "JSON object"),
    (b"{", "not JSON"),
    (b"[" * 60000, "not JSON"),  # deeper than the decoder's recursion: a typed error, not a crash
    (b"{" + b" " * (64 * 1024) + b"}", "64 KiB"),
])
def test_what_is_not_a_small_json_object_is_refused(raw: bytes, why: str) -> None:
    with pytest.raises(InvalidRequest, match=why):
        parse_config(raw)


def test_the_allow_list_names_no_path_field() -> None:
    assert not {"model", "tokenizer", "revision", "download_dir", "trust_remote_code_path"} & ALLOWED_KEYS
