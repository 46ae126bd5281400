"""Acceptance: malformed and out-of-range requests are refused with a typed status and details,
garbage on the peer socket closes only that connection, and hwrd keeps serving throughout."""

from __future__ import annotations

import json
import socket
import struct
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import torch

from hwr.client import ArtifactIdentity, Client, connect
from hwr.client.identity import canonical_json
from hwr.client.wire import ERROR_CODE_KEY, ERROR_DETAILS_KEY, SESSION_KEY, recv_frame, send_frame
from hwr.daemon.app.launcher import DaemonProcess
from hwr.protos.hwr.v1 import hwr_pb2 as pb
from hwr.protos.hwr.v1 import hwr_pb2_grpc

from .helpers import digests

IDENTITY = ArtifactIdentity.simple("e2e/validation")
TENSORS = {"w": torch.arange(256, dtype=torch.float32).reshape(16, 16)}
INVALID = grpc.StatusCode.INVALID_ARGUMENT


def _with(**changes: Any) -> bytes:
    """Canonical identity JSON with some fields changed (``section__field=value``)."""
    doc = IDENTITY.to_dict()
    for path, value in changes.items():
        *parents, leaf = path.split("__")
        node = doc
        for name in parents:
            node = node[name]
        node[leaf] = value
    return canonical_json(doc)


def _ref(**kw: Any) -> pb.AcquireRequest:
    return pb.AcquireRequest(artifact=pb.ArtifactRef(**kw))


def _spec(name: str = "w", dtype: str = "F32", shape: tuple[int, ...] = (4,), **kw: Any) -> pb.TensorSpec:
    return pb.TensorSpec(name=name, dtype=dtype, shape=list(shape), **kw)


def _begin(*specs: pb.TensorSpec, wait_ms: int = 0, identity: bytes | None = None) -> pb.BeginPublicationRequest:
    return pb.BeginPublicationRequest(identity_json=identity or _with(source__model_id="e2e/never"),
                                      tensors=list(specs), wait_timeout_ms=wait_ms)


# (rpc, request, expected hwr-error-code, a details key that must be present or None)
MALFORMED: list[tuple[str, str, Any, str, str | None]] = [
    ("empty artifact ref", "Acquire", pb.AcquireRequest(), "INVALID_ARGUMENT", "field"),
    ("short key", "Acquire", _ref(key="abc123"), "INVALID_ARGUMENT", "field"),
    ("upper-case key", "Acquire", _ref(key=IDENTITY.key.upper()), "INVALID_ARGUMENT", "field"),
    ("path-like key", "Acquire", _ref(key="../" * 21 + "a"), "INVALID_ARGUMENT", "field"),
    ("non-canonical identity", "Acquire",
     _ref(identity_json=json.dumps(IDENTITY.to_dict(), indent=1).encode()), "INVALID_IDENTITY", None),
    ("identity not JSON", "Acquire", _ref(identity_json=b"\xff\x00{"), "INVALID_IDENTITY", None),
    ("identity nested too deep", "Acquire", _ref(identity_json=b"[" * 100_000), "INVALID_IDENTITY", None),
    ("identity with unknown field", "Acquire", _ref(identity_json=_with(extra=1)), "INVALID_IDENTITY",
     "unexpected"),
    ("identity missing a field", "Acquire",
     _ref(identity_json=canonical_json({k: v for k, v in IDENTITY.to_dict().items() if k != "producer"})),
     "INVALID_IDENTITY", "missing"),
    ("TP rank >= TP size", "Acquire",
     _ref(identity_json=_with(layout__tensor_parallel_size=2, layout__tensor_parallel_rank=2)),
     "INVALID_IDENTITY", None),
    ("bool where an int belongs", "Acquire", _ref(identity_json=_with(schema_version=True)),
     "INVALID_IDENTITY", None),
    ("no tensors", "BeginPublication", _begin(), "INVALID_ARGUMENT", "field"),
    ("duplicate tensor names", "BeginPublication", _begin(_spec("a"), _spec("a")), "INVALID_ARGUMENT", "tensor"),
    ("empty tensor name", "BeginPublication", _begin(_spec("")), "INVALID_ARGUMENT", "field"),
    ("bad dtype", "BeginPublication", _begin(_spec(dtype="F99")), "INVALID_ARGUMENT", "tensor"),
    ("dimension too large", "BeginPublication", _begin(_spec(shape=(1 << 41,))), "INVALID_ARGUMENT", "tensor"),
    ("element count overflows", "BeginPublication", _begin(_spec(shape=(1 << 40, 1 << 40, 1 << 40))),
     "INVALID_ARGUMENT", "tensor"),
    ("too many dimensions", "BeginPublication", _begin(_spec(shape=(1,) * 17)), "INVALID_ARGUMENT", "tensor"),
    ("unknown tensor kind", "BeginPublication", _begin(_spec(kind=7)), "INVALID_ARGUMENT", "tensor"),
    ("huge wait", "BeginPublication", _begin(_spec(), wait_ms=(1 << 32) - 1), "INVALID_ARGUMENT", "field"),
    ("bad identity in a publication", "BeginPublication", _begin(_spec(), identity=b"{}"), "INVALID_IDENTITY",
     None),
    ("empty lease id", "Release", pb.ReleaseRequest(lease_id=""), "INVALID_ARGUMENT", None),
    ("oversized client name", "OpenSession", pb.OpenSessionRequest(client_name="x" * 129),
     "INVALID_ARGUMENT", None),
    ("key prefix not hex", "InspectArtifact", pb.InspectArtifactRequest(key="zzzz"), "INVALID_ARGUMENT", "key"),
    ("key prefix too short", "InspectArtifact", pb.InspectArtifactRequest(key="ab"), "INVALID_ARGUMENT", "key"),
    ("expected digest not hex", "CommitPublication", None, "INVALID_ARGUMENT", "tensor"),
]


@pytest.fixture(scope="module")
def served(shared_hwrd: DaemonProcess) -> Iterator[tuple[DaemonProcess, Client, str]]:
    """The shared daemon, a client and a published artifact: every test below also proves the
    daemon survived the ones before."""
    with connect(shared_hwrd.socket) as client:
        yield shared_hwrd, client, client.publish(IDENTITY, TENSORS)


@pytest.fixture(scope="module")
def log_start(served: tuple[DaemonProcess, Client, str]) -> int:
    return len(served[0].log.read_bytes())


def _new_log(daemon: DaemonProcess, start: int) -> str:
    return daemon.log.read_bytes()[start:].decode(errors="replace")


def _metadata(client: Client) -> tuple[tuple[str, str], ...]:
    return ((SESSION_KEY, client._connection.token),)


def _trailers(err: grpc.RpcError) -> dict[str, str]:
    return {k: v for k, v in err.trailing_metadata() or ()}


@pytest.mark.timeout(120)
def test_malformed_requests_get_invalid_argument_with_details(
    served: tuple[DaemonProcess, Client, str], log_start: int
) -> None:
    daemon, client, key = served
    with grpc.insecure_channel(f"unix:{daemon.socket}") as channel:
        stub = hwr_pb2_grpc.HostWeightRuntimeStub(channel)
        staged = stub.BeginPublication(_begin(_spec(), identity=_with(source__model_id="e2e/staged")),
                                       metadata=_metadata(client), timeout=10)
        artifacts = client.list_artifacts()
        assert key in {a["key"] for a in artifacts}
        failures = []
        for label, rpc, request, code, detail in MALFORMED:
            if request is None:  # needs a live publication of the client's session
                request = pb.CommitPublicationRequest(publication_id=staged.publication_id,
                                                      expected_sha256={"w": "not-a-digest"})
            try:
                getattr(stub, rpc)(request, metadata=_metadata(client), timeout=10)
            except grpc.RpcError as caught:
                err = caught
            else:
                failures.append(f"{label}: accepted")
                continue
            trailers = _trailers(err)
            details = json.loads(trailers.get(ERROR_DETAILS_KEY, "null"))
            got = (err.code(), trailers.get(ERROR_CODE_KEY))
            if got != (INVALID, code) or not isinstance(details, dict) or (detail and detail not in details):
                failures.append(f"{label}: {got} {err.details()!r} {details}")
            if not err.details():  # a human message always comes along
                failures.append(f"{label}: no message")
        assert not failures, "\n".join(failures)

        # Nothing changed: no artifact appeared or went, the staged publication is still intact.
        assert client.list_artifacts() == artifacts
        assert stub.AbortPublication(pb.AbortPublicationRequest(publication_id=staged.publication_id),
                                     metadata=_metadata(client), timeout=10).aborted
    assert client.status()["publications"] == 0
    _still_serving(client, key)
    log = _new_log(daemon, log_start)
    assert "Traceback" not in log, log[-3000:]


@pytest.mark.timeout(60)
def test_calls_without_a_valid_session_are_unauthenticated(served: tuple[DaemonProcess, Client, str]) -> None:
    daemon, client, key = served
    with grpc.insecure_channel(f"unix:{daemon.socket}") as channel:
        stub = hwr_pb2_grpc.HostWeightRuntimeStub(channel)
        for metadata in ((), ((SESSION_KEY, ""),), ((SESSION_KEY, "0" * 48),),
                         ((SESSION_KEY, client._connection.token[:-1]),)):
            for rpc, request in (("Acquire", pb.AcquireRequest(artifact=pb.ArtifactRef(key=key))),
                                 ("GetStatus", pb.GetStatusRequest()), ("ListLeases", pb.ListLeasesRequest())):
                with pytest.raises(grpc.RpcError) as caught:
                    getattr(stub, rpc)(request, metadata=metadata, timeout=10)
                assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED, (rpc, metadata)
                assert _trailers(caught.value)[ERROR_CODE_KEY] == "SESSION_INVALID"
        # Health answers without a session (it is the one exempt service).
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert client.status()["leases"] == 0
    _still_serving(client, key)


GARBAGE = {
    "length over the limit": b"\xff\xff\xff\xff" + b"x" * 64,
    "body not JSON": struct.pack(">I", 5) + b"hello",
    "body not UTF-8": struct.pack(">I", 4) + b"\xff\xfe\xfd\xfc",
    "JSON array": struct.pack(">I", 2) + b"[]",
    "JSON nested too deep": struct.pack(">I", 200_000) + b"[" * 200_000,
    "truncated frame then EOF": struct.pack(">I", 100) + b'{"op":',
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("label", list(GARBAGE))
def test_garbage_on_the_peer_channel_closes_only_that_connection(
    served: tuple[DaemonProcess, Client, str], log_start: int, label: str
) -> None:
    daemon, client, key = served
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(10)
    conn.connect(f"{daemon.socket}.peer")
    hello, _ = recv_frame(conn)
    assert hello["ok"] is True
    conn.sendall(GARBAGE[label])
    if label.startswith("truncated"):
        conn.shutdown(socket.SHUT_WR)
    try:
        tail = conn.recv(4096)
    except ConnectionResetError:  # closed with our unread garbage still queued: a reset
        tail = b""
    assert tail == b"", "the daemon must close a connection that sent garbage"
    conn.close()
    # That session ended with its connection; every other session is untouched.
    with grpc.insecure_channel(f"unix:{daemon.socket}") as channel, pytest.raises(grpc.RpcError) as caught:
        hwr_pb2_grpc.HostWeightRuntimeStub(channel).GetStatus(
            pb.GetStatusRequest(), metadata=((SESSION_KEY, hello["token"]),), timeout=10)
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    _still_serving(client, key)
    log = _new_log(daemon, log_start)
    assert "Traceback" not in log and "exception was never retrieved" not in log, log[-3000:]


@pytest.mark.timeout(60)
def test_unknown_peer_operation_is_answered_and_the_connection_stays_usable(
    served: tuple[DaemonProcess, Client, str]
) -> None:
    daemon, client, key = served
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(10)
        conn.connect(f"{daemon.socket}.peer")
        assert recv_frame(conn)[0]["ok"] is True
        for request in ({"op": "format-disk"}, {}, {"op": "fds", "lease_id": 7, "lease_token": None},
                        {"op": "fds", "lease_id": "x" * 300, "lease_token": "y"}):
            send_frame(conn, request)
            reply, fds = recv_frame(conn, want_fds=True)
            assert (reply["ok"], fds) == (False, []), request
            assert reply["code"] and reply["message"]
        send_frame(conn, {"op": "ping"})
        assert recv_frame(conn)[0] == {"ok": True}
    _still_serving(client, key)


def _still_serving(client: Client, key: str) -> None:
    with connect(client.socket_path) as fresh, fresh.acquire(key) as lease:
        assert digests(lease.tensors) == digests(TENSORS)
    with client.acquire(IDENTITY) as lease:
        assert lease.key == key
