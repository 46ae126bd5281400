"""The fleet tier end to end: two hwrd nodes with separate stores sharing one real S3 server.

Node A publishes (a client publication, pushed in the background); node B, whose store is empty,
acquires the same identity in ``required`` mode and gets the same bytes, pulled and verified.
The remote is a cache, not a root of trust: tampered objects are refused with a typed error and
nothing is committed. SIGKILL during a pull or a push leaves nothing partial visible anywhere.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hwr.client import ArtifactIdentity, connect
from hwr.client.errors import ArtifactNotFound, ChecksumMismatch, ManifestCorrupt, RemoteUnavailable
from hwr.client.resolver import Outcome, resolve
from hwr.daemon.app.launcher import DaemonProcess

from . import fleet_fixtures
from .fleet_fixtures import S3Server, artifact_dirs, node, staging_dirs
from .helpers import MIB, digests, patterned

s3_server = fleet_fixtures.s3_server  # the session's S3 server process (a fixture)

PREFIX = "fleet/v1"


def tensors_of(seed: int, nbytes: int = 2 * MIB) -> dict[str, torch.Tensor]:
    half = nbytes // 2
    return {"blocks.0.weight": patterned(half, seed, torch.bfloat16).reshape(-1, 64),
            "blocks.0.bias": patterned(half, seed + 1, torch.float32)}


@pytest.fixture
def fleet(s3_server: S3Server, short_tmp: Path) -> Iterator[dict[str, Any]]:
    """A fresh bucket and two unstarted nodes on it; every started node is stopped at teardown."""
    bucket = s3_server.new_bucket()
    remote = f"s3://{bucket}/{PREFIX}"
    nodes = {name: node(short_tmp, name, remote, endpoint=s3_server.endpoint) for name in ("a", "b")}
    yield {"bucket": bucket, "remote": remote, "s3": s3_server.client(), **nodes}
    for proc in nodes.values():
        if proc.proc is not None and proc.proc.poll() is None:
            proc.stop()
        else:
            proc.kill()


def object_name(key: str, file: str) -> str:
    return f"{PREFIX}/artifacts/{key}/{file}"


def wait_ready(s3: Any, bucket: str, key: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        names = {o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix=f"{PREFIX}/").get("Contents", [])}
        if object_name(key, "READY.json") in names:
            return
        time.sleep(0.1)
    raise AssertionError(f"{key[:16]} never became complete in the remote")


def publish_on(daemon: DaemonProcess, model: str, tensors: dict[str, torch.Tensor]) -> str:
    with connect(daemon.socket) as client:
        return client.publish(ArtifactIdentity.simple(model), tensors)


@pytest.mark.timeout(180)
def test_node_b_gets_node_a_publication_in_required_mode(fleet: dict[str, Any]) -> None:
    a, b, s3, bucket = fleet["a"].start(), fleet["b"].start(), fleet["s3"], fleet["bucket"]
    tensors = tensors_of(7)
    key = publish_on(a, "fleet/shared", tensors)
    wait_ready(s3, bucket, key)
    names = sorted(o["Key"].rsplit("/", 1)[1] for o in s3.list_objects_v2(
        Bucket=bucket, Prefix=f"{PREFIX}/artifacts/{key}/")["Contents"])
    assert names == ["READY.json", "manifest.json", "model-00001.safetensors"]
    assert artifact_dirs(b.root) == []
    resolution = resolve(ArtifactIdentity.simple("fleet/shared"), "required", socket=b.socket)
    try:
        assert resolution.outcome is Outcome.LOCAL_HIT, resolution.report.to_dict()
        assert digests(resolution.lease.tensors) == digests(tensors)
    finally:
        resolution.lease.close()
        resolution.client.close()
    assert artifact_dirs(b.root) == [key]
    with connect(b.socket) as client:
        status = client.status()["remote"]
        assert status["url"] == fleet["remote"] and status["reachable"] and status["bytes_pulled"] > 0
        assert "fleet-test-secret" not in repr(status)
        listed = client.remote_list()
        assert [(x["key"], x["state"], x["local"]) for x in listed] == [(key, "complete", True)]
        assert client.inspect(key)["remote_state"] == "present"
    assert "fleet-test-secret" not in b.log.read_text()  # no secret in node B's log


@pytest.mark.timeout(180)
def test_two_concurrent_acquirers_cause_one_fetch(fleet: dict[str, Any], short_tmp: Path) -> None:
    from .fleet_fixtures import free_port

    port = free_port()
    a, s3, bucket = fleet["a"].start(), fleet["s3"], fleet["bucket"]
    b = node(short_tmp, "b2", fleet["remote"], "--metrics-listen", f"127.0.0.1:{port}",
             endpoint=s3_endpoint(fleet)).start()
    try:
        tensors = tensors_of(11, 16 * MIB)
        key = publish_on(a, "fleet/concurrent", tensors)
        wait_ready(s3, bucket, key)
        results: list[Any] = []
        barrier = threading.Barrier(2)

        def acquire() -> None:
            with connect(b.socket) as client:
                barrier.wait(30)
                with client.acquire(key, timeout=60) as lease:
                    results.append(digests(lease.tensors))

        threads = [threading.Thread(target=acquire) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        assert results == [digests(tensors)] * 2
        metrics = scrape(port)
        size = s3.head_object(Bucket=bucket, Key=object_name(key, "model-00001.safetensors"))["ContentLength"]
        assert metrics['hwr_remote_pulls_total{outcome="pulled"}'] == 1.0
        assert metrics["hwr_remote_pulled_bytes_total"] == float(size)  # one fetch of every byte
        pushes = {k: v for k, v in metrics.items() if k.startswith("hwr_remote_pushes_total")}
        assert pushes and sum(pushes.values()) == 0.0, pushes  # a pull is not pushed back (not even tried)
    finally:
        b.stop()


def s3_endpoint(fleet: dict[str, Any]) -> str:
    return str(fleet["s3"].meta.endpoint_url)


def scrape(port: int) -> dict[str, float]:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def _tamper_cases() -> list[str]:
    # One case through real clients (the typed refusal on the peer socket, the resolver's required
    # mode failing, a daemon's staging after a refused commit); every case, the remembered refusal
    # included, is tested in-process in tests/service/test_pull_wait.py.
    return ["flipped_byte"]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", _tamper_cases())
def test_tampered_remote_artifact_is_refused_and_leaves_nothing(fleet: dict[str, Any], case: str) -> None:
    a, b, s3, bucket = fleet["a"].start(), fleet["b"].start(), fleet["s3"], fleet["bucket"]
    key = publish_on(a, f"fleet/tamper-{case}", tensors_of(21))
    other = publish_on(a, f"fleet/tamper-{case}-other", tensors_of(22))
    wait_ready(s3, bucket, key)
    wait_ready(s3, bucket, other)
    payload = object_name(key, "model-00001.safetensors")
    data = s3.get_object(Bucket=bucket, Key=payload)["Body"].read()
    expected: type[Exception] = ManifestCorrupt
    if case == "flipped_byte":
        flipped = bytearray(data)
        flipped[len(flipped) // 2] ^= 0x01
        s3.put_object(Bucket=bucket, Key=payload, Body=bytes(flipped))
        expected = ChecksumMismatch
    elif case == "truncated":
        s3.put_object(Bucket=bucket, Key=payload, Body=data[: len(data) - 4096])
    elif case == "swapped_manifest":  # another artifact's manifest under this key's READY.json
        body = s3.get_object(Bucket=bucket, Key=object_name(other, "manifest.json"))["Body"].read()
        s3.put_object(Bucket=bucket, Key=object_name(key, "manifest.json"), Body=body)
    else:  # another artifact's complete set of documents under this key: names another identity
        for file in ("manifest.json", "READY.json"):
            body = s3.get_object(Bucket=bucket, Key=object_name(other, file))["Body"].read()
            s3.put_object(Bucket=bucket, Key=object_name(key, file), Body=body)
    with connect(b.socket) as client:
        with pytest.raises(expected) as info:
            client.acquire(key, timeout=60)
        assert info.value.details.get("remote") == fleet["remote"]
        assert fleet["remote"] in str(info.value)
        # required mode fails and names the remote; nothing was committed or left in staging
        resolution = resolve(ArtifactIdentity.simple(f"fleet/tamper-{case}"), "required", socket=b.socket)
        assert resolution.outcome is Outcome.FAILED
        assert artifact_dirs(b.root) == [] and staging_dirs(b.root) == []
        assert client.list_artifacts() == []


@pytest.mark.timeout(180)
def test_remote_down_preferred_falls_back_required_names_the_remote(fleet: dict[str, Any], short_tmp: Path) -> None:
    from .fleet_fixtures import free_port

    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    b = node(short_tmp, "down", fleet["remote"], endpoint=dead).start()
    try:
        identity = ArtifactIdentity.simple("fleet/down")
        preferred = resolve(identity, "preferred", socket=b.socket)
        assert preferred.outcome is Outcome.CANONICAL_FALLBACK, preferred.report.to_dict()
        preferred.client.close()
        required = resolve(identity, "required", socket=b.socket)
        assert required.outcome is Outcome.FAILED
        failure = required.report.failure
        assert failure is not None and failure.code == RemoteUnavailable.code
        assert fleet["remote"] in failure.message
        with connect(b.socket) as client, pytest.raises(RemoteUnavailable) as info:
            client.acquire(identity.key, timeout=30)
        assert isinstance(info.value, ArtifactNotFound)  # a miss that names the remote
        with connect(b.socket) as client:
            assert client.status()["remote"]["reachable"] is False
    finally:
        b.stop()
