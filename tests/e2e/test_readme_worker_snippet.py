"""The README's "Python API" worker snippet, run as written against a real hwrd.

The snippet is taken from README.md (the code block after "A DLO worker that follows a
channel") and executed with a ``client``, a ``model`` whose own weights are none of the
channel's revisions, and a ``key``; only the device is swapped for the CPU when there is no
CUDA. From its first pass the model's output must equal a fresh model loaded with the
channel's revision (the non-block layers come from the lease too), and after
``handle.update(client.acquire(key))`` the next pass runs ``key``'s revision.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from hwr.client import ArtifactIdentity, connect
from hwr.daemon.app.launcher import DaemonProcess
from hwr.demo_model import DemoConfig, build_skeleton

from .live_worker import digest, inputs
from .test_live_updates import CONFIG, expected_digests, revision_tensors

README = Path(__file__).resolve().parents[2] / "README.md"
SEED = 61


def worker_snippet() -> str:
    text = README.read_text()
    match = re.search(r"A DLO worker that follows a channel[^\n]*\n\n```python\n(.*?)```", text, re.DOTALL)
    assert match is not None, "README: the worker snippet is gone"
    return match.group(1)


@pytest.mark.timeout(180)
def test_the_readme_worker_snippet_runs_the_channels_revision_from_its_first_pass(hwrd: DaemonProcess) -> None:
    code = worker_snippet()
    if not torch.cuda.is_available():
        code = code.replace('device="cuda"', 'device="cpu"')
    first, second = revision_tensors(1), revision_tensors(2)
    with connect(hwrd.socket) as client:
        client.publish(ArtifactIdentity.simple("readme/worker", revision="r1"), first, channel="flux-rl")
        key = client.publish(ArtifactIdentity.simple("readme/worker", revision="r2"), second)
        config = DemoConfig(**CONFIG)
        model = build_skeleton(config, device="cpu")
        model.load_state_dict(revision_tensors(99))  # its own weights: none of the revisions
        namespace = {"client": client, "model": model, "key": key}
        # The snippet's last line only shows what ``handle.revision`` is: run everything but it
        # before the first pass, so the explicit update is taken at the second one.
        setup, _, last = code.rstrip().rpartition("\n")
        update_line = next(line for line in setup.splitlines() if line.startswith("handle.update("))
        before_update = setup.replace(update_line, "")
        exec(compile(before_update, "README.md (worker snippet)", "exec"), namespace)
        handle = namespace["handle"]
        try:
            x, t = inputs(config, SEED)
            with torch.no_grad():
                assert digest(model(x, t)) == expected_digests(first, [SEED])[SEED]
            exec(compile(update_line + "\n" + last, "README.md (worker snippet)", "exec"), namespace)
            with torch.no_grad():
                assert digest(model(x, t)) == expected_digests(second, [SEED])[SEED]
            assert handle.revision.key == key and handle.revision.switches == 1
        finally:
            handle.close()
