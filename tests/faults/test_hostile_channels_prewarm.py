"""Hostile local users against the prewarm producer, channels and the trust rules: each attack
runs as its own uid (``nobody``, ``STRANGER``) against a real hwrd (root without capabilities,
and the unit's unprivileged user where it matters) while an innocent client keeps working.

Counted in the hostile suite's tally (``test_hostile_clients``: ``hwr hostile clients: ...`` at
the end of the run, one line per attack and a total), with that module's fixtures.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch
from daemon_proc import NOBODY as NOBODY_USER
from daemon_proc import RunAs, as_user
from safetensors.torch import save_file

from hwr.client import connect
from hwr.daemon.app.launcher import DaemonProcess

from . import test_hostile_clients as hostile
from .test_hostile_clients import Attack, Innocent, crashes

# The hostile suite's fixtures and tally, shared so that these attacks are counted with its own.
pytestmark = hostile.pytestmark
_summary = hostile._summary
attack = hostile.attack
open_dir = hostile.open_dir
start = hostile.start
artifact = hostile.artifact

NOBODY = NOBODY_USER.uid


def hwrctl(daemon: DaemonProcess, *args: str, user: RunAs | None = None,
           timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """The real ``hwrctl`` against ``daemon``, as ``user`` (None: root)."""
    command = ["python", "-m", "hwr.daemon.ctl.cli", "--socket", str(daemon.socket), *args]
    argv: Sequence[str] = as_user(user, command) if user is not None else [sys.executable, *command[1:]]
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=False)


# ------------------------------------------------------------------------------ the producer's config
#: Configs an operator could hand the vllm-omni producer to make it load or run what it chooses,
#: with hwrd's rights; each must be refused by name before any producer process starts.
HOSTILE_OMNI_CONFIGS = [
    ({"model": "/root/secret-model", "trust_remote_code": True}, "model"),
    ({"model_class_name": "Flux2KleinPipeline", "trust_remote_code": True}, "trust_remote_code"),
    ({"tokenizer": "/root/secret-tokenizer"}, "tokenizer"),
    ({"revision": "attacker-branch"}, "revision"),
    ({"download_dir": "/root/.cache"}, "download_dir"),
    ({"engine_backend": "os.system"}, "engine_backend"),
    ({"custom_pipeline_args": {"pipeline_class": "attacker.Pipeline"}}, "custom_pipeline_args"),
    ({"diffusers_load_kwargs": {"cache_dir": "/root"}}, "diffusers_load_kwargs"),
    ({"model_config": {"_name_or_path": "/root/secret-model"}}, "model_config"),
    ({"model_class_name": "attacker.module.Pipeline"}, "model_class_name"),
    ({"host_weight_runtime_root": "/root"}, "host_weight_runtime_root"),
]


@pytest.mark.usefixtures("daemon_user")  # root without capabilities, and the unit's user
@pytest.mark.timeout(300)
def test_operator_config_cannot_choose_what_the_producer_loads(
        artifact: Callable[..., tuple[DaemonProcess, str, str]], open_dir: Path, attack: Attack) -> None:
    """An operator uid (``nobody``) runs ``hwrctl prewarm DIR --producer vllm-omni --omni-config``
    with configs that name another model, remote code, a tokenizer, a revision, an import path:
    each is ``INVALID_ARGUMENT`` naming the key, no producer runs, the store is unchanged."""
    daemon, key, _digest = artifact("--operator-uids", str(NOBODY))
    checkpoint = open_dir / "model"
    checkpoint.mkdir(mode=0o755)
    save_file({"w": torch.ones(16)}, checkpoint / "model.safetensors")
    (checkpoint / "model.safetensors").chmod(0o644)
    added = hwrctl(daemon, "checkpoints", "add", str(checkpoint))  # registered by root
    assert added.returncode == 0, added.stderr
    with connect(daemon.socket) as client:
        before = sorted(a["key"] for a in client.list_artifacts())
    innocent = Innocent(daemon, key, 7.0)
    innocent.start()
    outcomes = {}
    try:
        for config, named in HOSTILE_OMNI_CONFIGS:
            done = hwrctl(daemon, "prewarm", str(checkpoint), "--producer", "vllm-omni", "--omni-config",
                          json.dumps(config), user=NOBODY_USER)
            outcomes[named] = (done.returncode, done.stderr.strip())
            attack.tried += 1
    finally:
        ops, failures = innocent.finish()
    attack.crashes = crashes(daemon)
    attack.others_failed = len(failures)
    attack.complete = True
    print(f"\nproducer config: {len(outcomes)} refused configs; innocent: {ops} operations, failures {failures[:3]}")
    for named, (code, stderr) in outcomes.items():
        assert code != 0 and stderr.startswith("hwrctl: INVALID_ARGUMENT:") and named in stderr, (named, stderr)
    with connect(daemon.socket) as client:
        assert sorted(a["key"] for a in client.list_artifacts()) == before
    assert ops > 5 and not failures
    assert attack.crashes == 0
