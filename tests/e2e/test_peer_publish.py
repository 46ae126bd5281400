"""Acceptance: publication on the peer socket (``hwr.daemon.peer.publication_frames``).

Small publications stage and commit in two peer round trips (the staging descriptors arrive in
the ``publish_begin`` reply); larger ones, and waits longer than ``PEER_MAX_WAIT_S``, go through
the gRPC RPCs. Both paths reach one domain implementation, so the artifact, the one-publisher-
per-identity rule and the typed errors (code, message, details) are the same.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest
import torch

from hwr.client import ArtifactIdentity, connect
from hwr.client import publisher as publisher_mod
from hwr.client.errors import ActiveBuildTimeout, HwrError, InvalidRequest, PermissionDeniedError
from hwr.client.publisher import TensorSpec
from hwr.protos.hwr.v1 import hwr_pb2 as pb

from .helpers import peer_error, rpc_error, wait_until

TENSORS = {"w": torch.arange(1024, dtype=torch.float32).reshape(32, 32), "b": torch.arange(9, dtype=torch.bfloat16)}


def _identity(name: str) -> ArtifactIdentity:
    return ArtifactIdentity.simple(f"e2e/peer-publish/{name}")


@pytest.mark.timeout(60)
def test_a_small_publication_goes_over_the_peer_channel_and_equals_the_rpc_one(shared_hwrd, monkeypatch) -> None:
    with connect(shared_hwrd.socket) as client:
        key = client.publish(_identity("small"), TENSORS)
        assert client._connection.channel is None, "a small publication must not open a gRPC channel"
        assert key == _identity("small").key
        with client.acquire(key) as lease:
            for name, tensor in TENSORS.items():
                assert torch.equal(lease.tensors[name], tensor), name
        # The same tensors under another identity through the RPCs give the same content digest.
        monkeypatch.setattr(publisher_mod, "PEER_MAX_BYTES", 0)
        rpc_key = client.publish(_identity("small-rpc"), TENSORS)
        assert client._connection.channel is not None
        shown = {a["key"]: a for a in client.list_artifacts()}
        assert shown[key]["size_bytes"] == shown[rpc_key]["size_bytes"]
        assert shown[key]["content_sha256"] == shown[rpc_key]["content_sha256"]
        assert client.inspect(key)["tensors"] == client.inspect(rpc_key)["tensors"]
        # Publishing the same identity again answers already_present on the peer path.
        monkeypatch.setattr(publisher_mod, "PEER_MAX_BYTES", 64 << 20)
        again = client.publisher(_identity("small"), publisher_mod.specs_for(TENSORS))
        assert (again.outcome, again.key) == ("already_present", key)


@pytest.mark.timeout(60)
def test_peer_publication_errors_equal_the_rpc_errors_and_the_connection_stays_usable(shared_hwrd) -> None:
    ident = _identity("errors").canonical_bytes
    good = [["w", "F32", [4], "parameter", "weight"]]
    cases = [
        ({"tensors": []}, pb.BeginPublicationRequest(identity_json=ident)),
        ({"tensors": [["a", "F99", [1], "parameter", "weight"]]},
         pb.BeginPublicationRequest(identity_json=ident, tensors=[pb.TensorSpec(name="a", dtype="F99", shape=[1])])),
        ({"tensors": [["", "F32", [1], "parameter", "weight"]]},
         pb.BeginPublicationRequest(identity_json=ident, tensors=[pb.TensorSpec(name="", dtype="F32", shape=[1])])),
        ({"tensors": good, "wait_timeout_ms": (1 << 32) - 1},
         pb.BeginPublicationRequest(identity_json=ident, wait_timeout_ms=(1 << 32) - 1,
                                    tensors=[pb.TensorSpec(name="w", dtype="F32", shape=[4])])),
        ({"tensors": good, "identity": "{}"},
         pb.BeginPublicationRequest(identity_json=b"{}", tensors=[pb.TensorSpec(name="w", dtype="F32", shape=[4])])),
    ]
    with connect(shared_hwrd.socket) as client:
        token = client._connection.token
        for fields, rpc_request in cases:
            request = {"op": "publish_begin", "identity": ident.decode(), **fields}
            peer = peer_error(client, request)
            rpc = rpc_error(shared_hwrd, token, "BeginPublication", rpc_request)
            assert (type(peer), peer.code, peer.message, peer.details) == \
                (type(rpc), rpc.code, rpc.message, rpc.details), fields
        # Shapes JSON can carry but a proto cannot: typed errors, not a crash.
        for bad in ("not a list", [["w"]], [["w", "F32", [-1], "parameter", "weight"]],
                    [["w", "F32", [True], "parameter", "weight"]], [["w", "F32", [1], "weird", "weight"]],
                    [[7, "F32", [1], "parameter", "weight"]]):
            assert isinstance(peer_error(client, {"op": "publish_begin", "identity": ident.decode(),
                                                   "tensors": bad}), InvalidRequest), bad
        # Commit or abort of a publication the client's session does not own: PERMISSION_DENIED on both.
        peer = peer_error(client, {"op": "publish_commit", "publication_id": "nope"})
        rpc = rpc_error(shared_hwrd, token, "CommitPublication", pb.CommitPublicationRequest(publication_id="nope"))
        assert isinstance(peer, PermissionDeniedError) and (peer.code, peer.message) == (rpc.code, rpc.message)
        assert isinstance(peer_error(client, {"op": "publish_commit"}), InvalidRequest)
        assert isinstance(peer_error(client, {"op": "publish_commit", "publication_id": "x",
                                               "expected_sha256": ["a"]}), InvalidRequest)
        # ... and the connection still serves.
        assert client._connection.exchange({"op": "ping"}, want_fds=False)[0] == {"ok": True}
        key = client.publish(_identity("after-errors"), {"x": torch.ones(3)})
        with client.acquire(key) as lease:
            assert float(lease.tensors["x"].sum()) == 3.0


@pytest.mark.timeout(60)
def test_a_second_publisher_waits_past_the_peer_cap_through_the_rpc_and_joins(shared_hwrd) -> None:
    specs = [TensorSpec("w", torch.float32, (8,))]
    with connect(shared_hwrd.socket) as first, connect(shared_hwrd.socket) as second:
        staged = first.publisher(_identity("join"), specs)
        assert staged.staged and first._connection.channel is None
        with pytest.raises(ActiveBuildTimeout):  # no wait asked: refused at once
            second.publisher(_identity("join"), specs, wait_timeout=0)
        result: dict[str, Any] = {}

        def wait_and_join() -> None:
            started = time.monotonic()
            pub = second.publisher(_identity("join"), specs, wait_timeout=30)
            result.update(outcome=pub.outcome, key=pub.key, waited=time.monotonic() - started)

        waiter = threading.Thread(target=wait_and_join)
        waiter.start()
        time.sleep(publisher_mod.PEER_MAX_WAIT_S + 1.0)  # past the peer wait: now in the RPC
        assert waiter.is_alive()
        staged.write("w", torch.full((8,), 2.0))
        key = staged.commit()
        waiter.join(20)
        assert result["outcome"] == "joined" and result["key"] == key
        assert result["waited"] > publisher_mod.PEER_MAX_WAIT_S
        assert second._connection.channel is not None  # the rest of the wait went through BeginPublication


def test_one_client_publishing_an_identity_from_two_threads_does_not_stall(shared_hwrd) -> None:
    """Thread A of a client has staged an identity; thread B of the same client publishes it
    too. B's begin used to wait on the peer socket (up to PEER_MAX_WAIT_S) while holding the
    client's connection, which A's commit needed: A could not finish the build B waited for
    until B's peer wait ran out. B now waits through the RPC, A commits at once, B joins."""
    specs = [TensorSpec("w", torch.float32, (8,))]
    with connect(shared_hwrd.socket) as client:
        staged = client.publisher(_identity("self-join"), specs)
        assert staged.staged
        result: dict[str, Any] = {}

        def second() -> None:
            pub = client.publisher(_identity("self-join"), specs, wait_timeout=30)
            result.update(outcome=pub.outcome, key=pub.key)

        waiter = threading.Thread(target=second)
        waiter.start()
        time.sleep(0.3)  # B is waiting for A's build now
        staged.write("w", torch.full((8,), 3.0))
        started = time.monotonic()
        key = staged.commit()
        took = time.monotonic() - started
        waiter.join(20)
        assert took < publisher_mod.PEER_MAX_WAIT_S / 2, f"A's commit waited {took:.2f} s behind B's wait"
        assert result == {"outcome": "joined", "key": key}
        with client.acquire(key) as lease:
            assert float(lease.tensors["w"][0]) == 3.0


@pytest.mark.timeout(60)
def test_a_peer_staged_publication_is_aborted_with_its_session(shared_hwrd) -> None:
    root = shared_hwrd.root
    before = set(os.listdir(root / "tmp"))
    client = connect(shared_hwrd.socket)
    pub = client.publisher(_identity("abandoned"), [TensorSpec("w", torch.float32, (1024,))])
    assert pub.staged and set(os.listdir(root / "tmp")) - before
    with connect(shared_hwrd.socket) as observer:
        client.close()  # the session ends with the publication still staged
        wait_until(lambda: not (set(os.listdir(root / "tmp")) - before), timeout=5)
        with pytest.raises(HwrError):
            observer.acquire(_identity("abandoned"))
        # The identity is free again: a new publisher stages it.
        key = observer.publish(_identity("abandoned"), {"w": torch.zeros(1024)})
        assert key == _identity("abandoned").key
