"""Acceptance: release is at most once, a forked child never releases its parent's lease, and
closing the client ends its leases."""

from __future__ import annotations

import grpc
import pytest
import torch

from hwr.client import ArtifactIdentity, connect
from hwr.client.wire import SESSION_KEY
from hwr.daemon.app.launcher import DaemonProcess
from hwr.protos.hwr.v1 import hwr_pb2 as pb
from hwr.protos.hwr.v1 import hwr_pb2_grpc

from .helpers import Worker, patterned, tensor_bytes, wait_until

TENSORS = {
    "w": patterned(64 * 1024, 9, torch.float16).reshape(128, 256),
    "b": torch.arange(128, dtype=torch.float32),
}


@pytest.mark.timeout(60)
def test_explicit_release_takes_effect_at_most_once(shared_hwrd: DaemonProcess) -> None:
    with connect(shared_hwrd.socket) as client, grpc.insecure_channel(f"unix:{shared_hwrd.socket}") as channel:
        key = client.publish(ArtifactIdentity.simple("e2e/release"), TENSORS)
        stub = hwr_pb2_grpc.HostWeightRuntimeStub(channel)
        metadata = ((SESSION_KEY, client._connection.token),)
        lease = client.acquire(key)
        assert [x["lease_id"] for x in client.leases()] == [lease.lease_id]

        first = stub.Release(pb.ReleaseRequest(lease_id=lease.lease_id), metadata=metadata, timeout=10)
        second = stub.Release(pb.ReleaseRequest(lease_id=lease.lease_id), metadata=metadata, timeout=10)
        assert (first.released, second.released) == (True, False)
        assert client.leases() == []

        lease.close()  # a third release through the lease: no error, nothing else released
        lease.close()
        assert lease.closed

        other = client.acquire(key)
        lease.close()
        assert [x["lease_id"] for x in client.leases()] == [other.lease_id]
        other.close()
        assert client.status()["leases"] == 0


@pytest.mark.timeout(90)
def test_forked_child_closing_inherited_lease_keeps_parents_lease(shared_hwrd: DaemonProcess) -> None:
    with connect(shared_hwrd.socket) as client:
        key = client.publish(ArtifactIdentity.simple("e2e/fork"), TENSORS)
        worker = Worker("fork-close", str(shared_hwrd.socket), key)
        try:
            child_exit, lease_id = worker.expect("forked").split()
            assert child_exit == "0", worker.stderr  # the child closed lease and client without error
            held = [x for x in client.leases() if x["lease_id"] == lease_id]
            assert [(x["key"], x["pid"]) for x in held] == [(key, worker.pid)]
            worker.send("check")
            report = worker.result()
            assert report == {"same_bytes": True, "session_leases": 1}
            worker.send("release")
            worker.expect("done")
            assert worker.wait() == 0, worker.stderr
        finally:
            worker.close()
        assert not any(x["lease_id"] == lease_id for x in client.leases())


@pytest.mark.timeout(60)
def test_closing_the_client_ends_its_leases(shared_hwrd: DaemonProcess) -> None:
    with connect(shared_hwrd.socket) as observer:
        key = observer.publish(ArtifactIdentity.simple("e2e/close"), TENSORS)
        holder = connect(shared_hwrd.socket)
        first, second = holder.acquire(key), holder.acquire(key)
        view = first.tensors["w"]
        mine = {x["lease_id"] for x in observer.leases() if x["session_id"] == holder.session_id}
        assert mine == {first.lease_id, second.lease_id}

        holder.close()
        holder.close()  # idempotent
        wait_until(lambda: not any(x["session_id"] == holder.session_id for x in observer.leases()),
                   timeout=2.0)
        # The mapping outlives the session: views taken before close stay valid.
        assert tensor_bytes(view) == tensor_bytes(TENSORS["w"])
        first.close()  # releasing after the session ended is quiet
        second.close()
        assert observer.status()["leases"] == 0
