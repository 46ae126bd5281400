"""hwrctl names checkpoints the way a user types them: relative paths and single files.

A real hwrd on a temp socket, ``hwrctl.main`` in-process from a working directory of its own:

- ``prewarm demo-store/checkpoint`` (a relative registered path) builds, because hwrctl makes the
  path absolute as ``checkpoints add`` does; an unregistered one fails in one line naming the
  absolute path tried and what was given;
- ``checkpoints add model.safetensors`` registers that one file (not its siblings), it survives
  a daemon restart, and a file that is not ``.safetensors`` is answered with what to pass.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from hwr.client.paths import checkpoint_ref
from hwr.daemon.app.launcher import DaemonProcess
from hwr.daemon.ctl import cli as ctl

pytestmark = pytest.mark.timeout(180)


def hwrctl(daemon: DaemonProcess, capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = ctl.main(["--socket", str(daemon.socket), *argv])
    out, err = capsys.readouterr()
    return code, out, err


def write(path: Path, seed: int, names: tuple[str, ...] = ("a.weight", "b.weight")) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    save_file({n: torch.randn(16, 16, generator=g) for n in names}, path)


@pytest.fixture
def workdir(short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    work = short_tmp / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return work


def test_checkpoint_ref_keeps_ids_and_makes_paths_absolute(workdir: Path) -> None:
    assert checkpoint_ref("0123abcd") == "0123abcd"
    assert checkpoint_ref("f" * 64) == "f" * 64
    assert checkpoint_ref("demo-store/checkpoint") == str(workdir / "demo-store" / "checkpoint")
    assert checkpoint_ref("./abcd") == str(workdir / "abcd")  # a hex-named directory
    assert checkpoint_ref("abc") == str(workdir / "abc")  # too short for an id prefix
    assert checkpoint_ref(Path("beef")) == str(workdir / "beef")
    assert checkpoint_ref("/abs/path/") == "/abs/path"


def test_prewarm_takes_a_relative_registered_path(spawn_daemon: Callable[..., DaemonProcess], workdir: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    daemon = spawn_daemon()
    write(workdir / "demo-store" / "checkpoint" / "model.safetensors", seed=1)
    code, out, err = hwrctl(daemon, capsys, "checkpoints", "add", "demo-store/checkpoint", "--json")
    assert code == 0, err
    added = json.loads(out)
    for ref in ("demo-store/checkpoint", "./demo-store/checkpoint/", added["checkpoint_id"][:8]):
        code, out, err = hwrctl(daemon, capsys, "prewarm", ref, "--producer", "cast", "--json")
        assert code == 0, (ref, err)
        document = json.loads(out)
        assert document["checkpoint"] == ref
        assert len(document["keys"]) == 1 and len(document["keys"][0]) == 64
    # The same directory through a symlink resolves to the registered checkpoint too.
    os.symlink(workdir / "demo-store", workdir / "alias")
    code, out, err = hwrctl(daemon, capsys, "prewarm", "alias/checkpoint", "--producer", "cast", "--json")
    assert code == 0, err
    assert json.loads(out)["artifacts"][0]["outcome"] == "already_present"


def test_prewarm_of_an_unregistered_path_says_what_was_tried(
    spawn_daemon: Callable[..., DaemonProcess], workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    daemon = spawn_daemon()
    code, out, err = hwrctl(daemon, capsys, "prewarm", "demo-store/missing", "--producer", "cast")
    assert code == 1 and not out
    assert err.count("\n") == 1 and err.startswith("hwrctl: CHECKPOINT_NOT_FOUND: "), err
    assert str(workdir / "demo-store" / "missing") in err and "'demo-store/missing'" in err
    assert "hex digits" not in err
    code, out, err = hwrctl(daemon, capsys, "prewarm", "zz", "--producer", "cast")
    assert code == 1 and str(workdir / "zz") in err


def test_checkpoints_add_takes_one_safetensors_file(spawn_daemon: Callable[..., DaemonProcess], workdir: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    daemon = spawn_daemon()
    write(workdir / "model.safetensors", seed=2)
    write(workdir / "other.safetensors", seed=3, names=("c.weight",))  # a sibling: not part of it
    code, out, err = hwrctl(daemon, capsys, "checkpoints", "add", "model.safetensors", "--json")
    assert code == 0, err
    info = json.loads(out)
    assert (info["added"], info["files"], info["tensors"]) == (True, 1, 2)
    assert info["path"] == str(workdir / "model.safetensors") and info["model_id"] == "model"
    code, out, err = hwrctl(daemon, capsys, "prewarm", "model.safetensors", "--producer", "cast", "--json")
    assert code == 0, err
    assert json.loads(out)["artifacts"][0]["outcome"] == "built"
    # Remembered like a directory: a restarted daemon registers it again under the same id.
    daemon.stop()
    spawn_daemon(daemon=daemon)
    code, out, err = hwrctl(daemon, capsys, "checkpoints", "--json")
    assert code == 0, err
    assert [(c["checkpoint_id"], c["files"]) for c in json.loads(out)] == [(info["checkpoint_id"], 1)]


def test_checkpoints_add_of_another_file_says_what_to_pass(
    spawn_daemon: Callable[..., DaemonProcess], workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    daemon = spawn_daemon()
    (workdir / "notes.txt").write_text("not a checkpoint\n")
    code, out, err = hwrctl(daemon, capsys, "checkpoints", "add", "notes.txt")
    assert code == 1 and not out
    assert err.count("\n") == 1 and "pass a checkpoint directory or one .safetensors file" in err, err
    assert str(workdir / "notes.txt") in err
