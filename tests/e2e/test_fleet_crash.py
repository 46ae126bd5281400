"""SIGKILL of hwrd in the middle of a pull or a push leaves no partial artifact anywhere.

The transfer runs through ``SlowLink`` (a throttled TCP relay to the real S3 server), so the
kill lands while bytes are moving, not by luck. After a kill during a push the remote has no
READY.json (readers see nothing) and the node's to-push record makes the restarted daemon
upload it again; after a kill during a pull the node's store holds no artifact, its staging
is wiped at the restart, and the acquire that waited for the pull gets ``DaemonUnavailable`` at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hwr.client import connect
from hwr.client.errors import DaemonUnavailable, HwrError

from . import fleet_fixtures
from .fleet_fixtures import S3Server, SlowLink, artifact_dirs, node, staging_dirs
from .helpers import MIB, digests
from .test_fleet import PREFIX, publish_on, tensors_of, wait_ready

s3_server = fleet_fixtures.s3_server  # the session's S3 server process (a fixture)
SIZE = 48 * MIB
RATE = 8 * MIB  # bytes/s through the slow link: a 48 MiB transfer takes ~6 s


@pytest.fixture
def crash_fleet(s3_server: S3Server, short_tmp: Path) -> Iterator[dict[str, Any]]:
    bucket = s3_server.new_bucket()
    link = SlowLink(s3_server.port, RATE)
    started: list[Any] = []
    env = {"bucket": bucket, "remote": f"s3://{bucket}/{PREFIX}", "s3": s3_server.client(), "link": link,
           "server": s3_server, "base": short_tmp, "started": started}
    yield env
    for proc in started:
        if proc.proc is not None and proc.proc.poll() is None:
            proc.stop()
    link.close()


def start(env: dict[str, Any], name: str, *, slow: bool) -> Any:
    endpoint = env["link"].endpoint if slow else env["server"].endpoint
    proc = node(env["base"], name, env["remote"], endpoint=endpoint)
    env["started"].append(proc)
    return proc.start()


def remote_names(env: dict[str, Any], key: str) -> list[str]:
    reply = env["s3"].list_objects_v2(Bucket=env["bucket"], Prefix=f"{PREFIX}/artifacts/{key}/")
    return sorted(o["Key"].rsplit("/", 1)[1] for o in reply.get("Contents", []))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sigkill_during_push_leaves_nothing_visible_and_the_restart_pushes(crash_fleet: dict[str, Any]) -> None:
    env = crash_fleet
    a = start(env, "a", slow=True)
    tensors = tensors_of(31, SIZE)
    key = publish_on(a, "fleet/crash-push", tensors)
    env["link"].wait_bytes("up", 8 * MIB)
    a.kill()  # SIGKILL mid-upload
    assert "READY.json" not in remote_names(env, key)  # readers of the remote see nothing
    record = a.root / "remote" / "push" / key
    assert record.exists()  # the durable to-push record survived
    a = start(env, "a", slow=False)  # the same node (root) restarted
    wait_ready(env["s3"], env["bucket"], key, timeout=120)
    assert remote_names(env, key) == ["READY.json", "manifest.json", "model-00001.safetensors"]
    b = start(env, "b", slow=False)
    with connect(b.socket) as client, client.acquire(key, timeout=120) as lease:
        assert digests(lease.tensors) == digests(tensors)
    with connect(a.socket) as client:
        assert client.status()["remote"]["pending_pushes"] == 0
    assert not record.exists()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sigkill_during_pull_leaves_no_partial_artifact(crash_fleet: dict[str, Any]) -> None:
    env = crash_fleet
    a = start(env, "a", slow=False)
    tensors = tensors_of(41, SIZE)
    key = publish_on(a, "fleet/crash-pull", tensors)
    wait_ready(env["s3"], env["bucket"], key)
    b = start(env, "b", slow=True)
    errors: list[tuple[BaseException, float]] = []

    def acquire() -> None:
        try:
            with connect(b.socket) as client:
                client.acquire(key, timeout=120).close()  # a waiter for the pull
        except HwrError as exc:  # the daemon dies under the call
            errors.append((exc, time.monotonic()))

    worker = threading.Thread(target=acquire)
    worker.start()
    env["link"].wait_bytes("down", 8 * MIB)
    assert staging_dirs(b.root), "the pull should be writing its staging now"
    b.kill()  # SIGKILL mid-download
    killed = time.monotonic()
    worker.join(60)
    assert errors, "the acquire cannot have succeeded"
    error, when = errors[0]
    assert isinstance(error, DaemonUnavailable), error  # a clear error: hwrd went away ...
    assert when - killed < 30, when - killed  # ... at once, not at the acquire's timeout
    assert artifact_dirs(b.root) == []  # nothing committed
    assert remote_names(env, key) == ["READY.json", "manifest.json", "model-00001.safetensors"]  # untouched
    b = start(env, "b", slow=False)
    assert staging_dirs(b.root) == [] and artifact_dirs(b.root) == []  # the restart wiped the staging
    with connect(b.socket) as client, client.acquire(key, timeout=120) as lease:
        assert digests(lease.tensors) == digests(tensors)
    assert artifact_dirs(b.root) == [key]
