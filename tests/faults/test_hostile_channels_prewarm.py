"""Hostile local users against the prewarm producer, channels and the trust rules: each attack
runs as its own uid (``nobody``, ``STRANGER``) against a real hwrd (root without capabilities,
and the unit's unprivileged user where it matters) while an innocent client keeps working.

Counted in the hostile suite's tally (``test_hostile_clients``: ``hwr hostile clients: ...`` at
the end of the run, one line per attack and a total), with that module's fixtures.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from daemon_proc import NOBODY as NOBODY_USER
from daemon_proc import STRANGER, RunAs, as_user
from e2e.test_daemon_trust import VICTIM_CODE  # the same victim client as the trust rules' own test
from safetensors.torch import save_file

from hwr.client import connect
from hwr.client.errors import HwrError
from hwr.daemon.app.launcher import DaemonProcess
from hwr.daemon.policy.channel_rights import MAX_OWNED_PER_UID
from hwr.protos.hwr.v1 import hwr_pb2 as pb

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
    # The operator uid registers it: a root hwrd without CAP_SETUID cannot take its identity to
    # open the files and refuses (typed, never with its own rights); the unit's user checks the
    # mode bits and registers it.
    by_operator = hwrctl(daemon, "checkpoints", "add", str(checkpoint), user=NOBODY_USER)
    assert by_operator.returncode == 0 or by_operator.stderr.startswith("hwrctl: PERMISSION_DENIED: hwrd cannot "
                                                                         "take uid"), by_operator.stderr
    added = hwrctl(daemon, "checkpoints", "add", str(checkpoint))  # root may register it either way
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


# ------------------------------------------------------------------------------ channels
CHANNEL_ATTACKER = Path(__file__).with_name("channel_attacker.py")


def publish_channels(daemon: DaemonProcess, user: RunAs, channels: list[str], *, name: str = "hostile",
                     value: int = 7, bypass_checks: bool = False) -> dict[str, Any]:
    """``channel_attacker.py`` as ``user``: one publication of ``name`` per channel."""
    plan = {"socket": str(daemon.socket), "name": name, "value": value, "channels": channels,
            "bypass_checks": bypass_checks}
    done = subprocess.run(as_user(user, ["python", str(CHANNEL_ATTACKER)]), input=json.dumps(plan),
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    line = done.stdout.strip().splitlines()[-1]
    assert line.startswith("result "), done.stdout[-2000:]
    return json.loads(line[len("result "):])


@pytest.mark.usefixtures("daemon_user")  # root without capabilities, and the unit's user
@pytest.mark.timeout(600)
def test_one_publisher_squats_channels_and_repoints_others(
        artifact: Callable[..., tuple[DaemonProcess, str, str]], attack: Attack) -> None:
    """A publish-only uid (``nobody``) publishes an artifact already present with 80 new channel
    names: it gets its quota (64), then ``CHANNELS_PER_UID``; meanwhile (three processes at
    once) the operator's ``hwrctl channel set team-x KEY`` and an innocent publisher's
    (``STRANGER``) own channel work, the attacker cannot repoint either, and each change is
    recorded under its uid."""
    daemon, key, _digest = artifact("--allow-uid", str(STRANGER.uid))
    innocent = Innocent(daemon, key, 7.0)
    innocent.start()
    watcher = connect(daemon.socket, timeout=10)  # a team's worker, watching before the attack
    watch = watcher.watch_channel("team-x")
    try:
        with ThreadPoolExecutor(3) as pool:
            squatting = pool.submit(publish_channels, daemon, NOBODY_USER,
                                    [f"squat-{i}" for i in range(MAX_OWNED_PER_UID + 16)])
            operating = pool.submit(hwrctl, daemon, "channel", "set", "team-x", key, "--json")
            publishing = pool.submit(publish_channels, daemon, STRANGER, ["team-y"], name="innocent", value=3)
            squat, operator, mine = squatting.result(), operating.result(), publishing.result()
        watched = None
        for _ in range(20):  # the first states may be the subscription's (no channel yet)
            update = watch.wait(1)
            if update is not None and update.key == key:
                watched = update
                break
        repoint = publish_channels(daemon, NOBODY_USER, ["team-x", "team-y"])
        rollback = hwrctl(daemon, "channel", "set", "team-y", key, "--json")  # an operator may
        again = publish_channels(daemon, STRANGER, ["team-y"], name="innocent", value=3)
        shown = hwrctl(daemon, "channel", "show", "team-y", "--json")
        watched_after = watch.wait(2)  # the attacker's refused repointing announced nothing
    finally:
        ops, failures = innocent.finish()
        watch.close()
        watcher.close()
    attack.tried = sum(squat["outcomes"].values()) + sum(repoint["outcomes"].values())
    attack.crashes = crashes(daemon)
    attack.others_failed = len(failures) + (operator.returncode != 0) + (mine["outcomes"] != {"ok": 1}) \
        + (again["outcomes"] != {"ok": 1}) + (watched is None)
    attack.complete = True
    print(f"\nchannel squatting: {squat['outcomes']}; repointing: {repoint['channels']}; operator set rc "
          f"{operator.returncode}; innocent publisher {mine['outcomes']}; innocent: {ops} operations, "
          f"failures {failures[:3]}")
    assert squat["outcomes"] == {"ok": MAX_OWNED_PER_UID, "INVALID_ARGUMENT:CHANNELS_PER_UID": 16}, squat
    assert operator.returncode == 0, operator.stderr
    assert json.loads(operator.stdout)["owner_uid"] is None
    assert watched is not None and watched_after is None, (watched, watched_after)
    assert mine["outcomes"] == {"ok": 1} and again["outcomes"] == {"ok": 1}, (mine, again)
    assert repoint["channels"] == {"team-x": "PERMISSION_DENIED:operator", "team-y": "PERMISSION_DENIED:operator"}
    assert rollback.returncode == 0, rollback.stderr
    info = json.loads(shown.stdout)
    assert info["owner_uid"] == STRANGER.uid  # an operator's rollback does not take the channel over
    assert [(e["set_by"], e["uid"]) for e in info["history"]] == [
        ("publication", STRANGER.uid), ("operator", 0), ("publication", STRANGER.uid)], info["history"]
    with connect(daemon.socket) as client:
        assert client.inspect_channel("team-x")["key"] == key
        assert client.inspect_channel("squat-0")["owner_uid"] == NOBODY
        assert client.inspect_channel("squat-0")["history"][-1]["uid"] == NOBODY
    assert ops > 5 and not failures
    assert attack.others_failed == 0 and attack.crashes == 0


@pytest.mark.timeout(300)
def test_channel_names_with_a_trailing_newline(artifact: Callable[..., tuple[DaemonProcess, str, str]],
                                              attack: Attack) -> None:
    """Names that ``re.match`` with ``$`` let through (``"flux\\n"``), sent past the client's own
    check by a publisher (``nobody``) and by the operator's ``SetChannel``: each is
    ``INVALID_ARGUMENT`` and no channel is made."""
    daemon, key, _digest = artifact()
    names = ["flux\n", "flux\r\n", "flux\n\n", "\nflux", "a" * 64 + "\n"]
    refused = publish_channels(daemon, NOBODY_USER, names, bypass_checks=True)
    operator = []
    with connect(daemon.socket) as client:
        for name in names:
            try:
                client._connection.call("SetChannel", pb.SetChannelRequest(name=name, key=key))
                operator.append("ok")
            except HwrError as exc:
                operator.append(exc.code)
        channels = client.list_channels()
    attack.tried = len(names) * 2
    attack.crashes = crashes(daemon)
    attack.complete = True
    print(f"\ntrailing newlines: publications {refused['outcomes']}, SetChannel {operator}")
    assert refused["outcomes"] == {"INVALID_ARGUMENT:": len(names)}, refused
    assert operator == ["INVALID_ARGUMENT"] * len(names)
    assert channels == []
    assert attack.crashes == 0


# ------------------------------------------------------------------------------ state files at start
#: hwrd's state files that a careless or hostile administrator might replace while it is stopped.
STATE_FILES = ("channels.json", "pins.json", "access.json", "leases.journal")


def _plant(root: Path, how: str, outside: Path, owner: RunAs | None) -> None:
    """Replace each state file: ``fifo``, ``nested`` (JSON deeper than the decoder's recursion),
    ``links`` (symlinks to /etc/shadow and to a FIFO outside the store, which would block),
    ``huge`` (600 MiB, sparse: past every bound, reading it whole would cost hwrd that much)."""
    for name in STATE_FILES:
        path = root / name
        for old in [path, *root.glob(f"{name}.corrupt-*")]:
            if old.is_symlink() or old.exists():
                old.unlink()
        if how == "fifo":
            os.mkfifo(path, 0o600)
        elif how == "nested":
            path.write_bytes(b"[" * 200_000 + b"]" * 200_000 + (b"\n" if name == "leases.journal" else b""))
        elif how == "huge":
            with open(path, "wb") as f:
                f.truncate(600 << 20)
        else:
            path.symlink_to("/etc/shadow" if name in ("channels.json", "access.json") else outside)
        if owner is not None:
            os.lchown(path, owner.uid, owner.gid)


@pytest.mark.usefixtures("daemon_user")  # root without capabilities, and the unit's user
@pytest.mark.timeout(400)
def test_hostile_state_files_at_start(artifact: Callable[..., tuple[DaemonProcess, str, str]], open_dir: Path,
                                      attack: Attack, request: pytest.FixtureRequest) -> None:
    """hwrd stopped; its state files replaced by FIFOs, by JSON nested 200,000 deep, by symlinks
    to /etc/shadow and to a FIFO, by 600 MiB files: each time hwrd starts within the start
    timeout, without a traceback, sets an unreadable channels.json aside, serves the published
    artifact, and a channel can be set again. (A FIFO ``domain.json`` stops the start at once
    with ``MANIFEST_CORRUPT``.)"""
    daemon, key, _digest = artifact()
    owner = request.getfixturevalue("daemon_user")
    outside = open_dir / "outside-fifo"
    os.mkfifo(outside, 0o666)
    shadow = Path("/etc/shadow").read_bytes() if Path("/etc/shadow").exists() else b""
    started: dict[str, float] = {}
    for how in ("fifo", "nested", "links", "huge"):
        assert daemon.stop() == 0
        _plant(daemon.root, how, outside, owner)
        began = time.monotonic()
        daemon.start(timeout=60)
        started[how] = round(time.monotonic() - began, 1)
        attack.tried += len(STATE_FILES)
        with connect(daemon.socket, timeout=10) as client:
            assert client.list_channels() == []
            with client.acquire(key) as lease:
                assert float(lease.tensors["w"][-1]) == 7.0
            assert client.set_channel(f"after-{how}", key)["key"] == key
        assert list(daemon.root.glob("channels.json.corrupt-*")), how
        assert not (daemon.root / "channels.json").is_symlink()
        with connect(daemon.socket, timeout=10) as client:  # the new file holds the new channel
            assert [c["name"] for c in client.list_channels()] == [f"after-{how}"]
    attack.crashes = crashes(daemon)
    assert daemon.stop() == 0
    domain = (daemon.root / "domain.json").read_bytes()
    (daemon.root / "domain.json").unlink()
    os.mkfifo(daemon.root / "domain.json", 0o600)
    began = time.monotonic()
    with pytest.raises(RuntimeError, match="exited with") as refused:
        daemon.start(timeout=60)
    attack.tried += 1
    started["domain.json fifo: refused"] = round(time.monotonic() - began, 1)
    assert "domain.json is unreadable" in str(refused.value)
    (daemon.root / "domain.json").unlink()  # the operator puts it back: hwrd starts and serves again
    (daemon.root / "domain.json").write_bytes(domain)
    if owner is not None:
        os.chown(daemon.root / "domain.json", owner.uid, owner.gid)
    daemon.start(timeout=60)
    with connect(daemon.socket, timeout=10) as client, client.acquire(key) as lease:
        assert float(lease.tensors["w"][-1]) == 7.0
    attack.complete = True
    print(f"\nhostile state files: hwrd started in {started} s")
    if shadow:
        assert Path("/etc/shadow").read_bytes() == shadow
    assert attack.crashes == 0


# ------------------------------------------------------------------------------ another user's daemon
#: The client's user in the trust test: a uid of its own (neither the daemon's nor an attacker's).
VICTIM = RunAs(64304, 64304, umask=0o022)


def run_client(user: RunAs, env: dict[str, str]) -> dict[str, Any]:
    clean = {k: v for k, v in os.environ.items() if k not in ("HWR_SOCKET", "XDG_RUNTIME_DIR", "HWR_TRUSTED_UIDS")}
    done = subprocess.run(as_user(user, ["python", "-c", VICTIM_CODE]), capture_output=True, text=True,
                          timeout=120, env={**clean, **env}, cwd="/", check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(300)
def test_a_third_users_daemon_in_its_own_directory(spawn: Callable[..., DaemonProcess], open_dir: Path,
                                                  attack: Attack) -> None:
    """A third, unprivileged uid (``STRANGER``) runs hwrd in its own ``/tmp/hwrd-<uid>`` and
    publishes "weights" under the identity a client asks for; the client's user (``VICTIM``)
    reaches it through ``HWR_SOCKET`` and through a symlink of its own: refused
    (``UNTRUSTED_DAEMON``) unless ``HWR_TRUSTED_UIDS`` names that uid."""
    from daemon_proc import make_daemon, own

    theirs = Path(f"/tmp/hwrd-{STRANGER.uid}")
    mine = Path(f"/tmp/hwr-victim-links-{VICTIM.uid}")
    for stale in (theirs, mine):
        subprocess.run(["rm", "-rf", str(stale)], check=True)
    try:
        own(theirs, STRANGER, 0o755)
        daemon = spawn(daemon=make_daemon(open_dir, "--allow-uid", str(VICTIM.uid), "--socket-mode", "666",
                                          user=STRANGER, sock=theirs / "hwrd.sock"))
        publish = ("import sys, torch\nfrom hwr.client import ArtifactIdentity, connect\n"
                   "with connect(sys.argv[1]) as c:\n"
                   "    c.publish(ArtifactIdentity.simple('victim/model'), {'w': torch.full((4,), 666.0)})\n")
        done = subprocess.run(as_user(STRANGER, ["python", "-c", publish, str(daemon.socket)]), capture_output=True,
                              text=True, timeout=120, cwd="/", check=False)
        assert done.returncode == 0, done.stderr[-3000:]
        own(mine, VICTIM, 0o755)
        for suffix in ("", ".peer"):
            link = mine / f"hwrd.sock{suffix}"
            link.symlink_to(f"{daemon.socket}{suffix}")
            os.lchown(link, VICTIM.uid, VICTIM.gid)
        seen = {"HWR_SOCKET": run_client(VICTIM, {"HWR_SOCKET": str(daemon.socket)}),
                "own symlink": run_client(VICTIM, {"HWR_SOCKET": str(mine / "hwrd.sock")})}
        opted_in = run_client(VICTIM, {"HWR_SOCKET": str(daemon.socket), "HWR_TRUSTED_UIDS": str(STRANGER.uid)})
        with pytest.MonkeyPatch.context() as env:  # this (root) process checks on it: it opts in too
            env.setenv("HWR_TRUSTED_UIDS", str(STRANGER.uid))
            attack.crashes = crashes(daemon)
    finally:
        for path in (mine, theirs):
            subprocess.run(["rm", "-rf", str(path)], check=False)
    attack.tried = len(seen)
    attack.complete = True
    print(f"\nanother user's daemon: {json.dumps(seen)}; opted in: {opted_in}")
    for how, result in seen.items():
        assert result["uid"] == VICTIM.uid and "weights" not in result and "daemon_pid" not in result, (how, result)
        assert result["error"] == "UNTRUSTED_DAEMON", (how, result)
        assert f"uid {STRANGER.uid}'s own" in result["details"]["reason"], (how, result)
    assert opted_in.get("daemon_pid") == daemon.pid and opted_in["weights"] == [666.0] * 4, opted_in
    assert attack.crashes == 0
