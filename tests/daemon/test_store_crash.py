"""A publisher killed with SIGKILL at every publication step leaves nothing or a complete artifact."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hwr.client.errors import ArtifactNotFound
from hwr.client.identity import ArtifactIdentity
from hwr.daemon.store.root import PUBLICATION_STEPS, Store

_CHILD = r"""
import os, signal, sys, torch
from pathlib import Path
from hwr.client.identity import ArtifactIdentity
from hwr.daemon.store import root as store_module
root, step = Path(sys.argv[1]), sys.argv[2]
def hook(name):
    if name == step:
        os.kill(os.getpid(), signal.SIGKILL)
store_module.FAULT_HOOK = hook
s = store_module.Store.open(root)
tensors = {"w": torch.arange(4096, dtype=torch.float32).reshape(64, 64), "b": torch.ones(3, dtype=torch.bfloat16)}
s.installer.publish(ArtifactIdentity.simple("crash/model"), tensors, max_file_bytes=8192)
"""
IDENTITY = ArtifactIdentity.simple("crash/model")
_COMMITTED = {"renamed", "dir_fsynced"}


@pytest.mark.parametrize("step", PUBLICATION_STEPS)
def test_crash_at_each_step_recovers(tmp_path: Path, step: str) -> None:
    root = tmp_path / "store"
    child = subprocess.run([sys.executable, "-c", _CHILD, str(root), step], capture_output=True, timeout=60)
    assert child.returncode == -signal.SIGKILL, child.stderr.decode()[-2000:]
    with Store.open(root) as store:  # the dead child's daemon lock was released by the kernel
        assert not list((root / "tmp").iterdir())
        assert not store.start_report and not store.is_denied(IDENTITY.key)
        if step in _COMMITTED:
            record = store.verify(IDENTITY.key)
            assert {t.name for t in record.manifest.tensors} == {"w", "b"}
        else:
            with pytest.raises(ArtifactNotFound):
                store.records.lookup(IDENTITY.key)
            assert not list((root / "artifacts").iterdir())
            store.installer.publish(IDENTITY, {"w": torch.zeros(2)})  # the next publisher succeeds
