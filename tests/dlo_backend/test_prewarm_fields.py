"""The ``vllm-omni`` producer's engine fields: the registered checkpoint always wins over the job's
config (defence in depth behind the daemon's allow-list); no vLLM-Omni needed."""

from __future__ import annotations

from pathlib import Path

import pytest

from hwr.client.errors import InvalidRequest
from hwr.dlo_backend.vllm_plugin.prewarm import engine_fields


def test_the_registered_root_and_the_producers_own_fields_win(tmp_path: Path) -> None:
    fields = engine_fields(tmp_path, {"model_class_name": "FluxPipeline", "dtype": "bf16",
                                      "trust_remote_code": False}, port=1234, runtime_root="/tmp/rt")
    assert fields["model"] == str(tmp_path)
    assert fields["trust_remote_code"] is False
    assert fields["model_class_name"] == "FluxPipeline" and fields["dtype"] == "bf16"
    assert fields["host_weight_runtime_mode"] == "preferred" and fields["host_weight_runtime_root"] == "/tmp/rt"
    assert fields["master_port"] == 1234 and fields["num_gpus"] == 1


@pytest.mark.parametrize("config", [
    {"model": "/root/secret-model"},
    {"trust_remote_code": True},
    {"host_weight_runtime_root": "/root"},
    {"tokenizer": "/root/tok"},
])
def test_a_job_whose_config_chooses_what_is_loaded_never_reaches_the_loader(tmp_path: Path,
                                                                           config: dict[str, object]) -> None:
    with pytest.raises(InvalidRequest) as refused:
        engine_fields(tmp_path, config, port=1, runtime_root="/tmp/rt")
    assert refused.value.details["key"] == next(iter(config))
