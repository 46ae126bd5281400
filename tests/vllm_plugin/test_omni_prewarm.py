"""``hwrctl prewarm --producer vllm-omni``: hwrd builds the artifact vLLM-Omni looks up, then a
``required`` start in a fresh process is a LOCAL_HIT with no canonical materialization of the DiT.

The checkpoint is a tiny FLUX.2-klein in the diffusers layout (``omni_pipelines``), registered with
``hwrctl checkpoints add``. The prewarm runs in the daemon's isolated producer process (vLLM-Omni's
own loader on the CPU, publishing through the plugin into the same daemon); the start is the
harness's (``omni_harness``: vLLM-Omni's loader and DLO, fakes only at the accelerator boundary).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm_omni")

from omni_harness import Start, run
from omni_pipelines import PIPELINES

import hwr.client

pytestmark = pytest.mark.timeout(1500)


def _hwrctl(socket: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hwr.daemon.ctl.cli", "--socket", socket, *args],
                          capture_output=True, text=True, timeout=900, check=False)


def test_prewarm_for_vllm_omni_then_a_required_start_is_a_local_hit(vo_hwrd, omni_zygote,
                                                                   tmp_path: Path) -> None:
    spec = PIPELINES["flux2-klein"]
    checkpoint = tmp_path / "checkpoint"
    spec.write_checkpoint(checkpoint, 11)
    socket = str(vo_hwrd.socket)
    assert _hwrctl(socket, "checkpoints", "add", str(checkpoint)).returncode == 0
    config = json.dumps({"model_class_name": spec.model_class_name, **dict(spec.extra_config)})

    built = _hwrctl(socket, "prewarm", str(checkpoint), "--producer", "vllm-omni", "--omni-config", config, "--json")
    assert built.returncode == 0, built.stderr
    (artifact,) = json.loads(built.stdout)["artifacts"]
    assert artifact["outcome"] == "built" and artifact["size_bytes"] > 0, artifact
    again = _hwrctl(socket, "prewarm", str(checkpoint), "--producer", "vllm-omni", "--omni-config", config, "--json")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["artifacts"][0] | {"build_seconds": 0, "producer_peak_rss_bytes": 0} == (
        artifact | {"outcome": "already_present", "build_seconds": 0, "producer_peak_rss_bytes": 0})

    (root := tmp_path / "runtime").mkdir()
    (worker,) = run("flux2-klein", checkpoint=checkpoint, runtime_root=root, out=tmp_path / "serve",
                    starts=[Start("required", mode="required", socket=socket)], zygote=omni_zygote)
    start = worker["required"].expect_ok()
    assert start.outcome == "local_hit" and start.plan == "host_weight_runtime", start.raw
    assert any("skipping ordinary materialization" in line for line in start.logs), start.logs
    assert {lease["key"] for lease in start.raw["leases_during"]} == {artifact["key"]}
    assert not start.raw["dit_homes"]["not_file_backed"], start.raw["dit_homes"]
    assert start.offloaded == [start.straight, start.straight]


def test_prewarm_for_vllm_omni_refuses_what_it_cannot_build(vo_hwrd, tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    folder.mkdir()
    import torch
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, folder / "model.safetensors")
    socket = str(vo_hwrd.socket)
    assert _hwrctl(socket, "checkpoints", "add", str(folder)).returncode == 0
    with hwr.client.connect(socket) as client:
        before = [a["key"] for a in client.list_artifacts()]
    sp = _hwrctl(socket, "prewarm", str(folder), "--producer", "vllm-omni", "--omni-config",
                 '{"parallel_config": {"ulysses_degree": 2}}')
    assert sp.returncode != 0 and "ulysses_degree" in sp.stderr, sp.stderr
    bad = _hwrctl(socket, "prewarm", str(folder), "--producer", "vllm-omni", "--omni-config", "[1]")
    assert bad.returncode != 0 and "JSON object" in bad.stderr, bad.stderr
    for key, value in (("model", "/root/secret-model"), ("trust_remote_code", True), ("tokenizer", "/root/t")):
        other = _hwrctl(socket, "prewarm", str(folder), "--producer", "vllm-omni", "--omni-config",
                        json.dumps({key: value}))
        assert other.returncode != 0 and "INVALID_ARGUMENT" in other.stderr and key in other.stderr, other.stderr
    with hwr.client.connect(socket) as client:
        assert [a["key"] for a in client.list_artifacts()] == before  # refused before any producer ran
