"""Acceptance: acquire and release on the peer socket (the client's hot path).

The peer socket's ``acquire``/``release`` share one daemon-side implementation with the gRPC
``Acquire``/``Release`` RPCs (``hwr.daemon.service.leasing``): same lease table, same typed errors (code,
message, details), same deny checks. A client that only leases never opens a gRPC channel; the
journal holds a lease's record before its descriptors arrive; the manifest crosses the socket
once per process and artifact; and a payload changed behind the daemon's back is refused even
though warm lookups no longer ``lstat`` every file.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator

import grpc
import pytest
import torch

from hwr.client import ArtifactIdentity, Client, connect
from hwr.client.errors import ArtifactDenied, HwrError, ManifestCorrupt
from hwr.client.wire import encode_frame, recv_frame, send_frame
from hwr.daemon.app.launcher import DaemonProcess
from hwr.protos.hwr.v1 import hwr_pb2 as pb
from hwr.protos.hwr.v1 import hwr_pb2_grpc

from .helpers import peer_error, rpc_error, wait_until

TENSORS = {
    "w": torch.arange(4096, dtype=torch.float32).reshape(64, 64),
    "h": torch.arange(300, dtype=torch.float16).reshape(3, 100),
    "b": torch.arange(77, dtype=torch.bfloat16),
    "i": torch.arange(-5, 6, dtype=torch.int8),
    "m": torch.tensor([True, False, True]),
    "z": torch.empty(0, 3),
    "d": torch.arange(7, dtype=torch.float64),
}


@pytest.fixture(scope="module")
def leased(shared_hwrd: DaemonProcess) -> Iterator[tuple[DaemonProcess, Client, str]]:
    with connect(shared_hwrd.socket, client_name="peer-lease-tests") as client:
        key = client.publish(ArtifactIdentity.simple("e2e/peer-leases"), TENSORS)
        yield shared_hwrd, client, key


def _assert_same(peer: HwrError, rpc: HwrError) -> None:
    assert (type(peer), peer.code, peer.message, peer.details) == (type(rpc), rpc.code, rpc.message, rpc.details)


@pytest.mark.timeout(60)
def test_a_leasing_client_never_opens_grpc_and_its_leases_are_the_rpc_leases(leased) -> None:
    daemon, publisher, key = leased
    with connect(daemon.socket, client_name="only-leases") as client:
        lease = client.acquire(key)
        by_identity = client.acquire(ArtifactIdentity.simple("e2e/peer-leases"))
        assert client._connection.channel is None, "acquire must not open a gRPC channel"
        for name, tensor in TENSORS.items():  # every dtype, shape and the empty tensor
            assert torch.equal(lease.tensors[name], tensor), name
            assert torch.equal(by_identity.tensors[name], tensor), name
        mine = [x for x in publisher.leases() if x["session_id"] == client.session_id]
        assert sorted(x["lease_id"] for x in mine) == sorted([lease.lease_id, by_identity.lease_id])
        assert {x["client_name"] for x in mine} == {"only-leases"}  # the peer hello named the session
        lease.close()
        assert client._connection.channel is None
        remaining = [x["lease_id"] for x in publisher.leases() if x["session_id"] == client.session_id]
        assert remaining == [by_identity.lease_id]  # the release took effect before close() returned
        # A peer-acquired lease is released by the gRPC Release RPC too (one lease table).
        with grpc.insecure_channel(f"unix:{daemon.socket}") as channel:
            released = hwr_pb2_grpc.HostWeightRuntimeStub(channel).Release(
                pb.ReleaseRequest(lease_id=by_identity.lease_id), metadata=client._connection.metadata, timeout=20)
        assert released.released is True
        assert client._connection.exchange({"op": "release", "lease_id": by_identity.lease_id},
                                           want_fds=False)[0] == {"ok": True, "released": False}
        by_identity.close()
        assert client.status()["version"]  # a control call opens the channel lazily
        assert client._connection.channel is not None


@pytest.mark.timeout(60)
def test_typed_errors_on_the_peer_channel_equal_the_rpc_errors(leased) -> None:
    daemon, publisher, key = leased
    with connect(daemon.socket) as client:
        token = client._connection.token
        cases = [
            ({"op": "acquire", "key": "0" * 64}, pb.AcquireRequest(artifact=pb.ArtifactRef(key="0" * 64))),
            ({"op": "acquire", "key": "XYZ"}, pb.AcquireRequest(artifact=pb.ArtifactRef(key="XYZ"))),
            ({"op": "acquire"}, pb.AcquireRequest()),
            ({"op": "acquire", "identity": '{"not":"an identity"}'},
             pb.AcquireRequest(artifact=pb.ArtifactRef(identity_json=b'{"not":"an identity"}'))),
        ]
        for peer_request, rpc_request in cases:
            _assert_same(peer_error(client, peer_request), rpc_error(daemon, token, "Acquire", rpc_request))
        # Releasing another session's lease: PERMISSION_DENIED on both paths.
        with publisher.acquire(key) as theirs:
            _assert_same(peer_error(client, {"op": "release", "lease_id": theirs.lease_id}),
                         rpc_error(daemon, token, "Release", pb.ReleaseRequest(lease_id=theirs.lease_id)))
        # A denied artifact: ARTIFACT_DENIED with the reason, on both paths, and from acquire().
        denied_key = publisher.publish(ArtifactIdentity.simple("e2e/peer-denied"), {"x": torch.ones(4)})
        with client.acquire(denied_key):
            pass  # cached as valid first: the deny must still win
        publisher.deny(denied_key, "peer test")
        try:
            peer = peer_error(client, {"op": "acquire", "key": denied_key})
            assert isinstance(peer, ArtifactDenied)
            _assert_same(peer, rpc_error(daemon, token, "Acquire",
                                           pb.AcquireRequest(artifact=pb.ArtifactRef(key=denied_key))))
            with pytest.raises(ArtifactDenied):
                client.acquire(denied_key)
        finally:
            publisher.allow(denied_key)
        with client.acquire(denied_key) as lease:
            assert float(lease.tensors["x"].sum()) == 4.0
        assert [x for x in publisher.leases() if x["session_id"] == client.session_id] == []


@pytest.mark.timeout(60)
def test_malformed_lease_requests_get_typed_errors_and_the_connection_stays_usable(leased) -> None:
    daemon, publisher, key = leased
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(10)
        conn.connect(f"{daemon.socket}.peer")
        hello = recv_frame(conn)[0]
        assert hello["ok"] is True
        for request in ({"op": "acquire", "key": 7}, {"op": "acquire", "key": None, "identity": 3},
                        {"op": "acquire", "identity": "{"}, {"op": "acquire", "key": ["a"]},
                        {"op": "acquire", "key": key.upper()}, {"op": "release"},
                        {"op": "release", "lease_id": 5}, {"op": "release", "lease_id": "x" * 500},
                        {"op": "hello", "client_name": 3}, {"op": "hello", "client_version": "v" * 200}):
            send_frame(conn, request)
            reply, fds = recv_frame(conn, want_fds=True)
            assert (reply["ok"], fds) == (False, []), request
            assert reply["code"] in ("INVALID_ARGUMENT", "INVALID_IDENTITY"), (request, reply)
            assert reply["message"] and isinstance(reply["details"], dict)
        # Still usable: a real acquire over the same raw connection, then its release.
        send_frame(conn, {"op": "acquire", "key": key})
        reply, fds = recv_frame(conn, want_fds=True)
        try:
            assert reply["ok"] is True and len(fds) == reply["count"] >= 1
            assert conn.recv(reply["manifest_bytes"], socket.MSG_WAITALL).startswith(b"{")
        finally:
            for fd in fds:
                os.close(fd)
        assert any(x["lease_id"] == reply["lease_id"] for x in publisher.leases())
        send_frame(conn, {"op": "release", "lease_id": reply["lease_id"]})
        assert recv_frame(conn)[0] == {"ok": True, "released": True}
        send_frame(conn, {"op": "acquire", "key": key})
        held = recv_frame(conn, want_fds=True)
        for fd in held[1]:
            os.close(fd)
    # Closing the raw connection ended its session and the lease it still held.
    wait_until(lambda: all(x["lease_id"] != held[0]["lease_id"] for x in publisher.leases()), timeout=2.0)


@pytest.mark.timeout(60)
def test_the_manifest_crosses_once_and_the_journal_precedes_the_descriptors(leased) -> None:
    daemon, _publisher, key = leased
    journal = daemon.root / "leases.journal"
    with connect(daemon.socket) as client:
        first, fds, tail = client._connection.exchange({"op": "acquire", "key": key}, want_fds=True)
        # The acquire record is in the file before the descriptors reach us (flush-before-send).
        assert f'"lease":"{first["lease_id"]}"'.encode() in journal.read_bytes()
        for fd in fds:
            os.close(fd)
        assert first["manifest_bytes"] == len(tail) > 0
        again, fds, tail2 = client._connection.exchange({"op": "acquire", "key": key, "have": first["manifest_sha256"]},
                                                   want_fds=True)
        for fd in fds:
            os.close(fd)
        assert (again["manifest_bytes"], tail2, again["manifest_sha256"]) == (0, b"", first["manifest_sha256"])
        stale, fds, tail3 = client._connection.exchange({"op": "acquire", "key": key, "have": "0" * 64}, want_fds=True)
        for fd in fds:
            os.close(fd)
        assert tail3 == tail
        for reply in (first, again, stale):
            client._acquirer.release(reply["lease_id"])
        # Release records are coalesced into the next tick's write: they land without another request.
        wait_until(lambda: f'"op":"release","lease":"{stale["lease_id"]}"'.encode() in journal.read_bytes(),
                   timeout=2.0)


@pytest.mark.timeout(60)
def test_a_payload_changed_behind_the_daemon_is_refused_on_the_warm_path(shared_hwrd: DaemonProcess) -> None:
    with connect(shared_hwrd.socket) as client:
        key = client.publish(ArtifactIdentity.simple("e2e/peer-tamper"), {"x": torch.ones(1024)})
        for _ in range(3):  # warm: the record is cached, lookups skip the per-file lstat
            with client.acquire(key):
                pass
        payload = next(p for p in (shared_hwrd.root / "artifacts" / key).iterdir()
                       if p.name not in ("manifest.json", "READY.json"))
        os.chmod(payload, 0o644)  # changes ctime: open_payloads' fstat re-check must see it
        with pytest.raises(ManifestCorrupt):
            client.acquire(key)
        with pytest.raises(ArtifactDenied):
            client.acquire(key)
        assert [x for x in client.leases() if x["key"] == key] == []


@pytest.mark.timeout(60)
def test_lease_operations_after_fork_are_refused_in_the_child(leased) -> None:
    daemon, publisher, key = leased
    with connect(daemon.socket) as client:
        lease = client.acquire(key)
        pid = os.fork()
        if pid == 0:  # the child: its copy of the client is closed, its close() tells nobody
            code = 0
            try:
                lease.close()
                try:
                    client.acquire(key)
                    code = 3
                except HwrError:
                    pass
            except BaseException:
                code = 4
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert any(x["lease_id"] == lease.lease_id for x in publisher.leases())
        assert float(lease.tensors["w"][1, 1]) == 65.0
        lease.close()
        assert not any(x["lease_id"] == lease.lease_id for x in publisher.leases())



def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


@pytest.mark.timeout(120)
def test_a_client_that_never_reads_its_replies_cannot_grow_the_daemon(shared_hwrd: DaemonProcess) -> None:
    """Requests sent without reading the replies: the daemon stops reading from that connection
    once its unsent replies pass the transport's high-water mark (the client's sends then block),
    instead of buffering every reply; other sessions are served meanwhile, and once the client
    reads, every request it sent is answered, in order. Before the fix 19 million pings in 30 s
    grew the daemon by 270 MiB."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(shared_hwrd.socket) + ".peer")
    with sock:
        sock.settimeout(10)
        assert recv_frame(sock)[0]["ok"]
        send_frame(sock, {"op": "hello", "client_name": "no-reader", "client_version": "0"})
        assert recv_frame(sock)[0]["ok"]
        pings = b"".join(encode_frame({"op": "ping"}) for _ in range(4096))
        before = _rss_kib(shared_hwrd.pid)
        sock.setblocking(False)
        sent, stalled_since = 0, None
        while sent < 400 * len(pings):  # 1.6 million pings if nothing pushes back
            try:
                sent += sock.send(memoryview(pings)[sent % len(pings):])
                stalled_since = None
            except BlockingIOError:
                stalled_since = stalled_since or time.monotonic()
                if time.monotonic() - stalled_since > 2.0:
                    break  # the daemon stopped reading: what this test wants
                time.sleep(0.005)
        grown_mib = (_rss_kib(shared_hwrd.pid) - before) / 1024
        with connect(shared_hwrd.socket, timeout=10) as other:
            assert other.status()["sessions"] >= 2
        assert stalled_since is not None, f"{sent} bytes of requests were taken without a reply being read"
        assert grown_mib < 16, f"the daemon grew by {grown_mib:.0f} MiB"
        complete = sent // len(encode_frame({"op": "ping"}))
        sock.settimeout(10)
        for _ in range(complete):  # every complete request is answered, in order
            assert recv_frame(sock)[0] == {"ok": True}
