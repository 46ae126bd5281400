"""Lone surrogates (``"\\ud800"``: valid JSON, not Unicode text) from a client, on the peer
channel and over gRPC: each is refused with a typed error where it enters, and nothing the
daemon stores or lists afterwards holds one, so every other client's listings keep working.
A real daemon per test; its log must hold no traceback (``daemon_proc.finish_daemon``)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable

import grpc
import pytest
import torch

from hwr.client import ArtifactIdentity, connect
from hwr.client.errors import HwrError, IdentityError
from hwr.client.identity import canonical_json
from hwr.client.wire import SESSION_KEY, error_from_rpc
from hwr.daemon.app.launcher import DaemonProcess
from hwr.protos.hwr.v1 import hwr_pb2 as pb
from hwr.protos.hwr.v1 import hwr_pb2_grpc

LONE = "\ud800"


def _escaped(value: object) -> bytes:
    """JSON text with the lone surrogate escaped, the way a hostile client writes it."""
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def _ctl(daemon: DaemonProcess, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hwr.daemon.ctl.cli", "--socket", str(daemon.socket), *args, "--json"],
                          capture_output=True, text=True, timeout=60)


def _rpc(daemon: DaemonProcess, token: str, method: str, request: object) -> HwrError | None:
    with grpc.insecure_channel(f"unix:{daemon.socket}") as channel:
        try:
            getattr(hwr_pb2_grpc.HostWeightRuntimeStub(channel), method)(
                request, metadata=((SESSION_KEY, token),), timeout=30)
        except grpc.RpcError as exc:
            return error_from_rpc(exc)
    return None


@pytest.mark.timeout(180)
def test_lone_surrogates_are_refused_where_they_enter(spawn_daemon: Callable[..., DaemonProcess]) -> None:
    daemon = spawn_daemon()
    identity = ArtifactIdentity.simple("surrogates/ok")
    source = identity.to_dict()["source"]
    evil_identity = _escaped({**identity.to_dict(), "source": {**source, "model_id": f"m{LONE}"}})
    with connect(daemon.socket) as client:
        key = client.publish(identity, {"w": torch.ones(4)})
        with client.acquire(key):
            refusals = {}
            for name, request in {
                "client name": {"op": "hello", "client_name": f"evil{LONE}", "client_version": "1"},
                "client version": {"op": "hello", "client_name": "x", "client_version": LONE},
                "tensor name": {"op": "publish_begin", "identity": identity.canonical_bytes.decode(),
                                "tensors": [[f"w{LONE}", "F32", [4], "parameter", ""]]},
                # The identity is JSON text inside the frame: its escaped surrogate is the identity's.
                "identity": {"op": "publish_begin", "identity": evil_identity.decode(),
                             "tensors": [["w", "F32", [4], "parameter", ""]]},
                "key of a request": {"op": "acquire", "key": key, f"x{LONE}": 1},
            }.items():
                with pytest.raises(HwrError) as refused:
                    client._connection.exchange(request, want_fds=True)
                refusals[name] = refused.value.code
            assert refusals == {"client name": "INVALID_ARGUMENT", "client version": "INVALID_ARGUMENT",
                                "tensor name": "INVALID_ARGUMENT", "identity": "INVALID_IDENTITY",
                                "key of a request": "INVALID_ARGUMENT"}, refusals
            # The channel stayed in step: the same connection still serves.
            assert client.keepalive()["lease_count"] == 1
            token = client._connection.token
            grpc_refusals = {
                "identity to acquire": _rpc(daemon, token, "Acquire",
                                            pb.AcquireRequest(artifact=pb.ArtifactRef(identity_json=evil_identity))),
                "identity to publish": _rpc(daemon, token, "BeginPublication", pb.BeginPublicationRequest(
                    identity_json=evil_identity, tensors=[pb.TensorSpec(name="w", dtype="F32", shape=[4])])),
                "format metadata": _rpc(daemon, token, "BeginPublication", pb.BeginPublicationRequest(
                    identity_json=ArtifactIdentity.simple("surrogates/meta").canonical_bytes,
                    tensors=[pb.TensorSpec(name="w", dtype="F32", shape=[4])],
                    format_metadata_json=_escaped({"k": LONE}))),
            }
            codes = {name: getattr(err, "code", None) for name, err in grpc_refusals.items()}
            assert codes == {"identity to acquire": "INVALID_IDENTITY", "identity to publish": "INVALID_IDENTITY",
                             "format metadata": "INVALID_ARGUMENT"}, codes
        # Every listing still works for everyone, and nothing stored holds the surrogate.
        for args in (["leases"], ["ls"], ["show", key[:12]], ["status"]):
            out = _ctl(daemon, *args)
            assert out.returncode == 0, (args, out.stderr)
        assert [a["key"] for a in client.list_artifacts()] == [key]


def test_a_client_cannot_build_an_identity_with_a_lone_surrogate() -> None:
    with pytest.raises(IdentityError, match="lone surrogate"):
        ArtifactIdentity.simple(f"model{LONE}").key  # noqa: B018 - the key is what computes the JSON
    with pytest.raises(IdentityError, match="lone surrogate"):
        canonical_json({f"k{LONE}": 1})
