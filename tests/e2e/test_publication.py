"""Acceptance: one publisher per identity on the node; the others join its artifact.

Through a real hwrd: two publisher processes, the gRPC status of a zero-wait refusal, a client
that waits beyond its own per-call timeout. The service's side of it (zero wait, a waiting
publisher joining, a publication that can never fit) runs in-process in
tests/service/test_publication_admission.py.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch

from hwr.client import ArtifactIdentity, connect
from hwr.client.publisher import specs_for
from hwr.client.wire import ERROR_CODE_KEY, SESSION_KEY
from hwr.daemon.app.launcher import DaemonProcess
from hwr.protos.hwr.v1 import hwr_pb2 as pb
from hwr.protos.hwr.v1 import hwr_pb2_grpc

from .helpers import MIB, digests, publication_tensors, staging_entries, workers

PUBLICATION_BYTES = 64 * MIB


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_concurrent_publishers_in_two_processes_make_one_artifact(shared_hwrd: DaemonProcess) -> None:
    model = "e2e/concurrent"
    with connect(shared_hwrd.socket) as client:
        before = {a["key"] for a in client.list_artifacts()}
    with workers(*[("publish", str(shared_hwrd.socket), model, str(PUBLICATION_BYTES), "60")] * 2) as procs:
        for w in procs:
            w.expect("ready", timeout=90)
        for w in procs:  # both start their publication at (nearly) the same moment
            w.send("go")
        reports = [w.result(timeout=90) for w in procs]
        for w in procs:
            assert w.wait() == 0, w.stderr
    print(f"\npublishers: {[r.get('outcome') for r in reports]}")

    expected_key = ArtifactIdentity.simple(model).key
    assert all("error" not in r for r in reports), reports
    assert [r["key"] for r in reports] == [expected_key, expected_key]
    outcomes = sorted(r["outcome"] for r in reports)
    assert outcomes[1] == "staged" and outcomes[0] in ("already_present", "joined"), outcomes
    with connect(shared_hwrd.socket) as client:
        after = {a["key"] for a in client.list_artifacts()}
        assert after - before == {expected_key}  # exactly one new artifact
        assert client.status()["publications"] == 0
        with client.acquire(expected_key) as lease:
            assert digests(lease.tensors) == digests(publication_tensors(PUBLICATION_BYTES))
    assert staging_entries(shared_hwrd.root) == []


@pytest.mark.timeout(60)
def test_waiting_publisher_joins_beyond_the_clients_call_timeout(shared_hwrd: DaemonProcess) -> None:
    """A second publisher waits for the first as long as its ``wait_timeout`` says, even when
    that is longer than the client's per-call timeout, and is answered JOINED."""
    identity = ArtifactIdentity.simple("e2e/slow-first")
    tensors = {"w": torch.arange(1024, dtype=torch.float32)}
    hold_s = 3.0
    with connect(shared_hwrd.socket) as first, connect(shared_hwrd.socket, timeout=1.5) as second:
        outcome: dict[str, object] = {}

        def wait_for_first() -> None:
            try:
                with second.publisher(identity, specs_for(tensors), wait_timeout=30.0) as pub:
                    outcome["outcome"], outcome["key"] = pub.outcome, pub.commit()
            except Exception as exc:  # reported to the main thread
                outcome["error"] = exc

        with first.publisher(identity, specs_for(tensors)) as pub:
            assert pub.staged
            waiter = threading.Thread(target=wait_for_first)
            started = time.monotonic()
            waiter.start()
            pub.write("w", tensors["w"])
            time.sleep(hold_s)  # a slow writer: longer than the second client's 1.5 s call timeout
            key = pub.commit()
        waiter.join(30)
        assert outcome == {"outcome": "joined", "key": key}, outcome
        assert time.monotonic() - started >= hold_s
        assert key in {a["key"] for a in first.list_artifacts()}


@pytest.mark.timeout(60)
def test_second_publisher_with_zero_wait_is_told_to_come_back(shared_hwrd: DaemonProcess) -> None:
    identity = ArtifactIdentity.simple("e2e/busy")
    tensors = {"w": torch.ones(16)}
    with connect(shared_hwrd.socket) as first, connect(shared_hwrd.socket) as second, \
            grpc.insecure_channel(f"unix:{shared_hwrd.socket}") as channel:
        with first.publisher(identity, specs_for(tensors)) as pub:
            stub = hwr_pb2_grpc.HostWeightRuntimeStub(channel)
            with pytest.raises(grpc.RpcError) as caught:
                stub.BeginPublication(
                    pb.BeginPublicationRequest(identity_json=identity.canonical_bytes,
                                               tensors=[s.to_proto() for s in specs_for(tensors)],
                                               wait_timeout_ms=0),
                    metadata=((SESSION_KEY, second._connection.token),), timeout=10)
            assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert dict(caught.value.trailing_metadata())[ERROR_CODE_KEY] == "ACTIVE_BUILD_TIMEOUT"
            pub.write("w", tensors["w"])
            key = pub.commit()
        # Once the first committed, the identity is simply present.
        assert second.publish(identity, tensors) == key
