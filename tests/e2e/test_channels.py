"""Channels end to end: hwrctl's channel commands, roles, acquiring through a channel, watches
(coalesced, bound to the session, resumed after a restart), non-durable revisions and their
fallback, and what channels protect from eviction. Real hwrd, real client processes."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from hwr.client import ArtifactIdentity, ChannelUpdate, connect
from hwr.client.errors import (
    ActiveLease,
    ArtifactNotFound,
    ChannelNotFound,
    DaemonUnavailable,
    InvalidRequest,
    SessionInvalid,
)
from hwr.daemon.app.launcher import DaemonProcess
from hwr.daemon.ctl import cli as ctl
from hwr.protos.hwr.v1 import hwr_pb2 as pb

from .helpers import wait_until

WORKER = Path(__file__).with_name("channel_worker.py")
NOBODY = 65534


def publish(client: Any, name: str, value: float, **kwargs: Any) -> str:
    return client.publish(ArtifactIdentity.simple(name), {"w": torch.full((512,), value)}, **kwargs)


def hwrctl(daemon: DaemonProcess, capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, Any, str]:
    code = ctl.main(["--socket", str(daemon.socket), *argv])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if code == 0 and "--json" in argv else out), err


class Watcher:
    """``channel_worker.py watch``: a watching client process driven line by line."""

    def __init__(self, daemon: DaemonProcess, name: str) -> None:
        self.proc = subprocess.Popen([sys.executable, str(WORKER), "watch", str(daemon.socket), name],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, bufsize=1)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        assert self.line(60) == "subscribed", self.proc.stderr.read() if self.proc.poll() is not None else ""

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.strip())

    def line(self, timeout: float = 60.0) -> str:
        return self.lines.get(timeout=timeout)

    def wait(self, seconds: float) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"wait {seconds}\n")
        self.proc.stdin.flush()
        return self.line(seconds + 60)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


@pytest.mark.timeout(180)
def test_hwrctl_channel_set_show_ls_rm(shared_hwrd: DaemonProcess, capsys: pytest.CaptureFixture[str]) -> None:
    with connect(shared_hwrd.socket) as client:
        a, b = publish(client, "channels/cli-a", 1.0), publish(client, "channels/cli-b", 2.0)
    code, info, _ = hwrctl(shared_hwrd, capsys, "channel", "set", "cli-ch", a[:10], "--json")
    assert code == 0 and info["changed"] and info["key"] == a and info["watchers"] == 0
    assert [e["key"] for e in info["history"]] == [a] and info["history"][0]["set_by"] == "operator"
    code, info, _ = hwrctl(shared_hwrd, capsys, "channel", "set", "cli-ch", a, "--json")
    assert code == 0 and not info["changed"] and len(info["history"]) == 1  # the same key: no change
    code, text, _ = hwrctl(shared_hwrd, capsys, "channel", "set", "cli-ch", b)
    assert code == 0 and text.startswith("set cli-ch -> " + b)
    code, info, _ = hwrctl(shared_hwrd, capsys, "channel", "show", "cli-ch", "--json")
    assert code == 0 and info["key"] == b and [e["key"] for e in info["history"]] == [a, b]
    assert info["generation"] == info["history"][-1]["generation"] > info["history"][0]["generation"]
    assert info["switches"] == 2 and info["durable"] and info["durable_key"] == b
    code, listed, _ = hwrctl(shared_hwrd, capsys, "channel", "ls", "--json")
    assert code == 0 and {c["name"]: c["key"] for c in listed}["cli-ch"] == b
    assert {"name", "key", "history", "watchers"} <= set(listed[0])
    code, text, _ = hwrctl(shared_hwrd, capsys, "channel", "show", "cli-ch")
    assert code == 0 and "history (newest last)" in text and b[:16] in text
    code, status, _ = hwrctl(shared_hwrd, capsys, "status", "--json")
    assert {c["name"]: c["key"] for c in status["channels"]}["cli-ch"] == b
    code, shown, _ = hwrctl(shared_hwrd, capsys, "show", b, "--json")
    assert "cli-ch" in shown["channels"] and not shown["non_durable"]
    code, text, _ = hwrctl(shared_hwrd, capsys, "status")
    assert code == 0 and "channels:" in text and "cli-ch" in text
    code, info, _ = hwrctl(shared_hwrd, capsys, "channel", "rm", "cli-ch", "--json")
    assert code == 0 and info["key"] == b
    for argv, expected in ((("channel", "show", "cli-ch"), "CHANNEL_NOT_FOUND"),
                           (("channel", "rm", "cli-ch"), "CHANNEL_NOT_FOUND"),
                           (("channel", "set", "Bad/Name", a), "INVALID_ARGUMENT"),
                           (("channel", "set", "cli-ch", "0" * 64), "LOCAL_MISS")):
        code, _, err = hwrctl(shared_hwrd, capsys, *argv)
        assert code == 1 and err.startswith(f"hwrctl: {expected}: ") and err.count("\n") == 1, (argv, err)
    with pytest.raises(SystemExit) as usage:
        ctl.main(["--socket", str(shared_hwrd.socket), "channel", "set", "only-a-name"])
    assert usage.value.code == 2


@pytest.mark.timeout(120)
def test_acquire_through_a_channel_leases_the_key_it_points_to_then(shared_hwrd: DaemonProcess) -> None:
    with connect(shared_hwrd.socket) as client:
        a = publish(client, "channels/acq-a", 1.0, channel="acq")
        with pytest.raises(ChannelNotFound):
            client.acquire_channel("acq-missing")
        with pytest.raises(InvalidRequest):
            client.acquire_channel("NOT A NAME")
        first = client.acquire_channel("acq")
        assert first.key == a and float(first.tensors["w"][0]) == 1.0
        b = publish(client, "channels/acq-b", 2.0, channel="acq")
        second = client.acquire_channel("acq")
        assert second.key == b and float(second.tensors["w"][0]) == 2.0
        assert first.key == a and float(first.tensors["w"][0]) == 1.0  # a lease is on a key: untouched
        # The gRPC form resolves the same way.
        response: pb.AcquireResponse = client._connection.call("Acquire", pb.AcquireRequest(
            artifact=pb.ArtifactRef(channel="acq")))
        assert response.key == b
        client._acquirer.release(response.lease_id)
        assert {x["key"] for x in client.leases() if x["session_id"] == client.session_id} == {a, b}
        first.close()
        second.close()
        client.remove_channel("acq")


@pytest.mark.timeout(180)
def test_a_slow_watcher_sees_the_newest_state_never_a_queue(shared_hwrd: DaemonProcess) -> None:
    with connect(shared_hwrd.socket) as client:
        keys = [publish(client, f"channels/slow-{i}", float(i)) for i in range(8)]
        client.set_channel("slow", keys[0])
        watcher = Watcher(shared_hwrd, "slow")  # another process
        try:
            assert watcher.wait(30).startswith(f"update {keys[0]} ")  # the state at subscription
            wait_until(lambda: client.inspect_channel("slow")["watchers"] == 1, 30)
            for key in keys[1:]:  # seven changes while the watcher does not read
                client.set_channel("slow", key)
            newest = client.inspect_channel("slow")
            # The watcher holds the newest state it has received, never a queue of the seven: its
            # first read is the newest, or (when the last change was still on its way) one state
            # before it and then the newest; generations only grow.
            seen = [watcher.wait(30)]
            if seen[0] != f"update {keys[-1]} {newest['generation']}":
                seen.append(watcher.wait(30))
            assert seen[-1] == f"update {keys[-1]} {newest['generation']}", seen
            generations = [int(line.rsplit(" ", 1)[1]) for line in seen]
            assert generations == sorted(set(generations)), seen
            assert watcher.wait(0.5) == "none"  # nothing queued behind it
            client.set_channel("slow", keys[3])
            assert watcher.wait(30).startswith(f"update {keys[3]} ")
        finally:
            watcher.close()
        # The watcher's process died (SIGKILL): its session ended, and so did its watch.
        wait_until(lambda: client.inspect_channel("slow")["watchers"] == 0, 30)


@pytest.mark.timeout(120)
def test_session_death_ends_the_watch(shared_hwrd: DaemonProcess) -> None:
    with connect(shared_hwrd.socket) as client:
        key = publish(client, "channels/death", 1.0, channel="death")
        client.auto_reconnect = False
        watch = client.watch_channel("death")
        assert watch.wait(10) == ChannelUpdate("death", key, client.inspect_channel("death")["generation"])
        peer = client._connection.peer
        assert peer is not None
        peer.shutdown(2)  # the session's connection breaks: hwrd ends the session
        with pytest.raises((SessionInvalid, DaemonUnavailable)):
            watch.wait(30)
        assert not watch.connected
        watch.close()
        with pytest.raises(DaemonUnavailable):
            watch.wait(0)
    with connect(shared_hwrd.socket) as other:
        wait_until(lambda: other.inspect_channel("death")["watchers"] == 0, 30)


@pytest.mark.timeout(120)
def test_watching_a_channel_before_it_exists(shared_hwrd: DaemonProcess) -> None:
    with connect(shared_hwrd.socket) as client, client.watch_channel("later") as watch:
        assert watch.wait(0.3) is None
        key = publish(client, "channels/later", 5.0, channel="later")
        update = watch.wait(30)
        assert update is not None and update.key == key and update.name == "later"


@pytest.mark.timeout(240)
def test_non_durable_revision_falls_back_at_restart_and_the_watch_resumes(
        spawn_daemon: Callable[..., DaemonProcess], capsys: pytest.CaptureFixture[str]) -> None:
    daemon = spawn_daemon()
    with connect(daemon.socket) as client:
        durable = publish(client, "channels/fb-durable", 1.0, channel="fb")
        watch = client.watch_channel("fb")
        first = watch.wait(10)
        assert first is not None and first.key == durable
        volatile = publish(client, "channels/fb-volatile", 2.0, channel="fb", durable=False)
        update = watch.wait(30)
        assert update is not None and update.key == volatile and update.generation > first.generation
        info = client.inspect_channel("fb")
        assert not info["durable"] and info["durable_key"] == durable
        assert client.inspect(volatile)["non_durable"]
        held = client.acquire_channel("fb")  # a worker keeps its mapping across the restart
        assert held.key == volatile
        daemon.kill()  # SIGKILL: no clean stop
        daemon.start()
        # The watch resumes on a new session and reports the fallback, a new generation.
        fallback = watch.wait(60)
        assert fallback is not None and fallback.key == durable and fallback.generation > update.generation
        assert watch.resubscriptions >= 1 and watch.connected
        assert float(held.tensors["w"][0]) == 2.0  # the gone revision's mapping still reads
        with pytest.raises(ArtifactNotFound):
            client.acquire(volatile)
        info = client.inspect_channel("fb")
        assert info["key"] == durable and info["history"][-1]["set_by"] == "fallback"
        # The history survives the restart whole: the gone revision's entry says it was not durable.
        assert [(e["key"], e["durable"]) for e in info["history"]] == [(durable, True), (volatile, False),
                                                                       (durable, True)]
        held.close()
        watch.close()
    daemon.stop()
    daemon.start()  # a clean restart changes nothing more
    code, info, _ = hwrctl(daemon, capsys, "channel", "show", "fb", "--json")
    assert code == 0 and info["key"] == durable and info["generation"] == fallback.generation


@pytest.mark.timeout(240)
def test_a_channel_only_ever_non_durable_is_gone_after_a_restart(spawn_daemon: Callable[..., DaemonProcess]) -> None:
    daemon = spawn_daemon()
    with connect(daemon.socket) as client:
        publish(client, "channels/only-volatile", 1.0, channel="gone", durable=False)
        assert client.inspect_channel("gone")["durable_key"] == ""
    daemon.stop()
    daemon.start()
    with connect(daemon.socket) as client, pytest.raises(ChannelNotFound):
        client.inspect_channel("gone")


@pytest.mark.timeout(180)
def test_channel_keys_are_never_evicted_superseded_ones_once_unleased(shared_hwrd: DaemonProcess) -> None:
    with connect(shared_hwrd.socket) as client:
        a = publish(client, "channels/ev-a", 1.0, channel="ev")
        b = publish(client, "channels/ev-b", 2.0, channel="ev", durable=False)
        for key in (a, b):  # b is current, a what a restart falls back to
            with pytest.raises(ActiveLease) as refused:
                client.evict(key)
            assert refused.value.details["reason"] == "channel"
        gc = client.gc(target_bytes=0)
        assert {a, b} <= {x["key"] for x in gc["skipped"] if x["reason"] == "channel"}
        assert {a, b} <= {x["key"] for x in client.list_artifacts()}
        held = client.acquire(b)
        c = publish(client, "channels/ev-c", 3.0, channel="ev")  # durable: a and b are superseded
        assert client.evict(a)["key"] == a
        with pytest.raises(ActiveLease) as refused:
            client.evict(b)
        assert refused.value.details["reason"] == "leased"
        held.close()
        assert client.evict(b)["key"] == b
        with pytest.raises(ActiveLease):
            client.evict(c)
        client.remove_channel("ev")
        assert client.evict(c)["key"] == c


@pytest.mark.timeout(240)
@pytest.mark.skipif(os.geteuid() != 0, reason="dropping to another uid needs root")
def test_setting_a_channel_needs_the_operator_role_publishing_to_one_the_publish_role(
        spawn_daemon: Callable[..., DaemonProcess], short_tmp: Path) -> None:
    short_tmp.chmod(0o755)
    daemon = spawn_daemon("--socket-mode", "666", "--allow-uid", str(NOBODY))
    with connect(daemon.socket) as client:
        key = publish(client, "channels/roles", 1.0, channel="roles")
    done = subprocess.run([sys.executable, str(WORKER), "roles", str(NOBODY), str(daemon.socket)],
                          input=json.dumps({"key": key, "channel": "roles"}), capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["uid"] == NOBODY
    assert report["acquire_channel"] == {"ok": True} and report["watch_channel"] == {"ok": True}
    for action in ("set_channel", "remove_channel"):
        assert (report[action]["code"], report[action]["role"]) == ("PERMISSION_DENIED", "operator"), report
    # The publish role (everyone admitted, by default) creates channels of its own; root's channel
    # is an operator's, which a publisher may not repoint.
    assert (report["publish_to_channel"]["code"], report["publish_to_channel"]["role"]) == (
        "PERMISSION_DENIED", "operator"), report
    assert report["publish_to_own_channel"] == {"ok": True}
    with connect(daemon.socket) as client:
        assert client.inspect_channel("roles")["key"] == key
        info = client.inspect_channel("roles-own")
        assert info["owner_uid"] == NOBODY
        assert info["history"][-1]["set_by"] == "publication" and info["history"][-1]["uid"] == NOBODY


@pytest.mark.timeout(120)
def test_stopping_hwrd_with_a_watch_open_does_not_wait_out_the_grace(
        spawn_daemon: Callable[..., DaemonProcess]) -> None:
    daemon = spawn_daemon("--shutdown-grace-s", "60")
    with connect(daemon.socket) as client:
        publish(client, "channels/stop", 1.0, channel="stop")
        client.auto_reconnect = False
        watch = client.watch_channel("stop")
        assert watch.wait(10) is not None
        started = time.monotonic()
        daemon.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
        assert daemon.proc.wait(50) == 0  # type: ignore[union-attr]
        assert time.monotonic() - started < 30  # far less than the 60 s grace
        with pytest.raises(DaemonUnavailable):
            watch.wait(30)
