"""A shared ``file://`` remote that another local user can write to, against real hwrd nodes.

The remote is a world-writable directory (``artifacts/`` sticky, as a shared mount often is);
the attacker is a separate process running as ``nobody`` that plants FIFOs, symlinks and
symlinked key directories there. Node A publishes (and pushes) the legitimate artifacts; node B
pulls. Each attack must fail fast with a typed error for the attacked key only, while an
innocent acquire of a legitimate key on the same node still pulls, and hwrd still stops cleanly.
Every test runs with both nodes as root and as the unit's unprivileged user (``daemon_user``).
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon_proc import RunAs

from hwr.client import ArtifactIdentity, connect
from hwr.client.errors import HwrError, ManifestCorrupt, RemoteUnavailable

from .fleet_fixtures import artifact_dirs, node, staging_dirs
from .helpers import MIB, digests
from .test_fleet import publish_on, tensors_of

NOBODY = 65534
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the attacker runs as another uid (needs root)")


def as_nobody(action: Callable[[], None]) -> None:
    """Run ``action`` in a forked child that dropped to uid/gid ``nobody`` (the attacker)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.setgid(NOBODY)
            os.setgroups([])
            os.setuid(NOBODY)
            action()
            code = 0
        except BaseException:
            traceback.print_exc()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the attacker's step failed"


@pytest.fixture
def shared(short_tmp: Path, daemon_user: RunAs | None) -> Iterator[dict[str, Any]]:
    base = Path(tempfile.mkdtemp(prefix="hwr-remote-"))
    os.chmod(base, 0o755)
    remote = base / "shared"
    remote.mkdir(mode=0o777)
    os.chmod(remote, 0o777)
    (remote / "artifacts").mkdir()
    os.chmod(remote / "artifacts", 0o1777)
    (base / "elsewhere").mkdir()
    os.chown(base / "elsewhere", NOBODY, NOBODY)  # the attacker's own directory
    url = f"file://{remote}"
    nodes = {name: node(short_tmp, name, url, user=daemon_user) for name in ("a", "b")}
    yield {"base": base, "remote": remote, "url": url, **nodes}
    for proc in nodes.values():
        if proc.proc is not None and proc.proc.poll() is None:
            proc.kill()
    shutil.rmtree(base, ignore_errors=True)


def pushed(remote: Path, key: str, timeout: float = 60.0) -> Path:
    where = remote / "artifacts" / key
    deadline = time.monotonic() + timeout
    while not (where / "READY.json").exists():
        assert time.monotonic() < deadline, f"{key[:16]} was never pushed"
        time.sleep(0.05)
    return where


def seed(env: dict[str, Any], *models: str) -> dict[str, tuple[str, dict[str, Any]]]:
    """Node A publishes each model (pushed to the shared remote), then stops."""
    a = env["a"].start()
    out = {}
    for i, model in enumerate(models):
        tensors = tensors_of(100 + i, 2 * MIB)
        key = publish_on(a, f"hostile/{model}", tensors)
        pushed(env["remote"], key)
        out[model] = (key, digests(tensors))
    a.stop()
    return out


def fake_key() -> str:
    return secrets.token_hex(32)


@pytest.mark.timeout(120)
def test_fifos_in_the_remote_fail_fast_and_hwrd_still_stops(shared: dict[str, Any]) -> None:
    seeded = seed(shared, "innocent", "victim")
    remote = shared["remote"]
    victim, _ = seeded["victim"]
    fifo_keys = [fake_key() for _ in range(5)]

    def plant() -> None:
        for key in fifo_keys:  # five keys whose READY.json is a FIFO nobody ever writes
            (remote / "artifacts" / key).mkdir()
            os.mkfifo(remote / "artifacts" / key / "READY.json")

    as_nobody(plant)
    payload = remote / "artifacts" / victim / "model-00001.safetensors"
    payload.unlink()
    os.mkfifo(payload)  # and the victim's payload (its documents are valid)
    b = shared["b"].start()
    results: dict[str, Any] = {}

    def acquire(key: str) -> None:
        started = time.monotonic()
        try:
            with connect(b.socket) as client, client.acquire(key, timeout=30):
                results[key] = "leased"
        except HwrError as exc:
            results[key] = (type(exc), exc.details.get("remote"), time.monotonic() - started)

    threads = [threading.Thread(target=acquire, args=(k,)) for k in (*fifo_keys, victim)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "an acquire hung on a FIFO"
    for key in (*fifo_keys, victim):
        kind, where, took = results[key]
        assert issubclass(kind, ManifestCorrupt) and where == shared["url"], (key[:16], results[key])
        assert took < 20, took
    innocent, expected = seeded["innocent"]
    with connect(b.socket) as client:
        with client.acquire(innocent, timeout=30) as lease:  # the pull threads are all free
            assert digests(lease.tensors) == expected
        with pytest.raises(ManifestCorrupt):
            client.pull(fifo_keys[0])  # hwrctl pull: an error, not a hang
    assert artifact_dirs(b.root) == [innocent] and staging_dirs(b.root) == []
    started = time.monotonic()
    assert b.stop(timeout=30) == 0  # SIGTERM: no thread is stuck in an open() of a FIFO
    assert time.monotonic() - started < 30


@pytest.mark.timeout(120)
def test_one_symlinked_object_does_not_make_the_remote_unavailable(shared: dict[str, Any]) -> None:
    seeded = seed(shared, "innocent", "linked-ready", "linked-payload")
    remote = shared["remote"]
    innocent, expected = seeded["innocent"]
    bad_ready, _ = seeded["linked-ready"]
    bad_payload, _ = seeded["linked-payload"]
    for key, name in ((bad_ready, "READY.json"), (bad_payload, "model-00001.safetensors")):
        target = remote / "artifacts" / key / name
        os.rename(target, target.with_name(name + ".real"))
        os.symlink(target.with_name(name + ".real"), target)  # the same bytes, through a symlink
    b = shared["b"].start()
    with connect(b.socket) as client:
        for key in (bad_ready, bad_payload):
            with pytest.raises(ManifestCorrupt) as info:
                client.acquire(key, timeout=30)
            assert not isinstance(info.value, RemoteUnavailable)  # the key is refused, not the remote
            assert info.value.details.get("remote") == shared["url"]
        # At once (well within the 2 s a down remote is remembered): the remote still serves.
        with client.acquire(innocent, timeout=30) as lease:
            assert digests(lease.tensors) == expected
        assert client.status()["remote"]["reachable"] is True
    assert artifact_dirs(b.root) == [innocent]


@pytest.mark.timeout(120)
def test_a_symlinked_key_directory_is_not_followed_out_of_the_remote(shared: dict[str, Any]) -> None:
    seeded = seed(shared, "copied")
    remote, base = shared["remote"], shared["base"]
    key, _ = seeded["copied"]
    elsewhere = base / "elsewhere"
    source = remote / "artifacts" / key
    copies = {name: (source / name).read_bytes() for name in os.listdir(source) if not name.startswith(".")}
    shutil.rmtree(source)  # the remote no longer has it ...
    mine = ArtifactIdentity.simple("hostile/pushed")  # ... and node B's next publication is pre-empted

    def plant() -> None:
        (elsewhere / key).mkdir()
        for name, data in copies.items():  # ... but a valid copy sits outside the remote
            (elsewhere / key / name).write_bytes(data)
        (elsewhere / mine.key).mkdir()
        os.symlink(elsewhere / key, remote / "artifacts" / key)
        os.symlink(elsewhere / mine.key, remote / "artifacts" / mine.key)

    as_nobody(plant)
    b = shared["b"].start()
    with connect(b.socket) as client:
        with pytest.raises(ManifestCorrupt) as info:
            client.acquire(key, timeout=30)
        assert info.value.details.get("remote") == shared["url"]
        assert {x["key"]: x["state"] for x in client.remote_list()} == {key: "incomplete", mine.key: "incomplete"}
    assert artifact_dirs(b.root) == [] and staging_dirs(b.root) == []
    # Writes are not redirected either: the upload into a symlinked key directory fails.
    with connect(b.socket) as client:
        assert client.publish(mine, tensors_of(7, MIB)) == mine.key
        with pytest.raises(ManifestCorrupt):
            client.push(mine.key)
    assert os.listdir(elsewhere / mine.key) == []  # nothing written outside the remote
