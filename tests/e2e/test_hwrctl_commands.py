"""Every hwrctl subcommand against a real hwrd, in both output modes.

The registered subcommands are discovered from ``hwr.daemon.ctl.cli`` (plus its ``EXTENSIONS``); a
subcommand without a case below fails the test, so a new one cannot ship unexercised. Each case
runs ``hwrctl.main`` in-process (the daemon is a real process on a real socket) once with the
table output and once with ``--json``: exit status as expected, a JSON document on stdout with
``--json``, non-empty text otherwise, and a failure is one ``hwrctl:`` line on stderr.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hwr.client import ArtifactIdentity, connect
from hwr.daemon.app.launcher import DaemonProcess
from hwr.daemon.ctl import cli as ctl

# name -> (argv after the subcommand, given the per-mode context; expected exit status)
Case = Callable[[dict[str, str]], tuple[list[str], int]]
CASES: dict[str, Case] = {
    "status": lambda c: ([], 0),
    "ls": lambda c: ([], 0),
    "show": lambda c: ([c["key"][:12]], 0),
    "leases": lambda c: ([], 0),
    "completion": lambda c: (["bash"], 0),
    "verify": lambda c: ([c["key"]], 0),
    "deny": lambda c: ([c["spare"], "--reason", "test"], 0),
    "allow": lambda c: ([c["spare"]], 0),
    "pin": lambda c: ([c["key"]], 0),
    "unpin": lambda c: ([c["key"]], 0),
    "evict": lambda c: ([c["spare"]], 0),
    "gc": lambda c: ([], 0),
    "usage": lambda c: ([], 0),
    "checkpoints": lambda c: ([], 0),
    # A registered checkpoint needs a real model directory (tests/e2e/test_prewarm.py covers building);
    # here the daemon answers a missing one with a typed error: exit 1, one stderr line.
    "prewarm": lambda c: (["no-such-checkpoint", "--producer", "cast"], 1),
    # This daemon has no remote tier: UNSUPPORTED, exit 1 (tests/e2e/test_fleet_ops.py runs them on one).
    "remote": lambda c: (["ls"], 1),
    "pull": lambda c: ([c["key"]], 1),
    "push": lambda c: ([c["key"]], 1),
    "peers": lambda c: ([], 1),  # tests/e2e/test_fleet_peer_holders.py runs it on a remote
    "channel": lambda c: (["ls"], 0),  # tests/e2e/test_channels.py runs every channel action
}
ORDER = ["status", "ls", "show", "leases", "completion", "verify", "pin", "unpin", "deny", "allow",
         "checkpoints", "prewarm", "usage", "gc", "evict", "remote", "pull", "push", "peers",
         "channel"]


def registered() -> list[str]:
    for module in ctl.EXTENSIONS:
        importlib.import_module(module)
    return sorted(ctl.COMMANDS)


def test_every_registered_subcommand_has_a_case() -> None:
    missing = [name for name in registered() if name not in CASES]
    assert not missing, f"hwrctl subcommands without an end-to-end case: {missing}"
    assert set(ORDER) == set(CASES)


@pytest.mark.timeout(300)
def test_each_subcommand_in_both_output_modes(
    spawn_daemon: Callable[..., DaemonProcess], capsys: pytest.CaptureFixture[str], short_tmp: Path
) -> None:
    daemon = spawn_daemon()
    names = registered()
    with connect(daemon.socket) as client:
        keys = [client.publish(ArtifactIdentity.simple(f"ctl/m{i}"), {"w": torch.full((256,), float(i))})
                for i in range(3)]
        held = client.acquire(keys[0])  # so `leases` has a row
        contexts = {"human": {"key": keys[0], "spare": keys[1]}, "json": {"key": keys[0], "spare": keys[2]}}
        for name in [n for n in ORDER if n in names]:
            for mode in ("human", "json"):
                argv, expected = CASES[name](contexts[mode])
                full = ["--socket", str(daemon.socket), name, *argv, *(["--json"] if mode == "json" else [])]
                code = ctl.main(full)
                out, err = capsys.readouterr()
                assert code == expected, (full, out, err)
                if expected == 0:
                    assert out.strip(), full
                    if mode == "json":
                        json.loads(out)
                else:
                    assert err.startswith("hwrctl: ") and err.count("\n") == 1, (full, err)
        held.close()
    assert names  # at least the built-in subcommands ran


def test_show_agrees_with_ls_and_carries_the_manifest(
    spawn_daemon: Callable[..., DaemonProcess], capsys: pytest.CaptureFixture[str]
) -> None:
    daemon = spawn_daemon()
    with connect(daemon.socket) as client:
        keys = [client.publish(ArtifactIdentity.simple(f"ctl/show{i}"), {"w": torch.full((64,), float(i))})
                for i in range(3)]
        with client.acquire(keys[1]), client.acquire(keys[1]):
            assert ctl.main(["--socket", str(daemon.socket), "ls", "--json"]) == 0
            listed = {a["key"]: a for a in json.loads(capsys.readouterr().out)}
            assert ctl.main(["--socket", str(daemon.socket), "show", keys[1][:12], "--json"]) == 0
            shown = json.loads(capsys.readouterr().out)
    entry = listed[keys[1]]
    assert entry["leases"] == 2 and entry["state"] == "ready"
    assert {k: shown[k] for k in entry if k != "tensors"} == {k: v for k, v in entry.items() if k != "tensors"}
    assert len(shown["tensors"]) == entry["tensors"] == 1
    assert shown["identity"]["source"]["model_id"] == "ctl/show1"
    assert [f["size"] for f in shown["files"]] == [entry["size_bytes"]]


def test_unreachable_daemon_exits_3(short_tmp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert ctl.main(["--socket", str(short_tmp / "none.sock"), "status", "--json"]) == 3
    _out, err = capsys.readouterr()
    assert err.startswith("hwrctl: ") and err.count("\n") == 1
    with pytest.raises(SystemExit) as info:
        ctl.main(["no-such-subcommand"])
    assert info.value.code == 2
