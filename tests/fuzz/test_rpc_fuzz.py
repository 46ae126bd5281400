"""Fuzzing the wire: random and malformed field values for every RPC of ``hwr.v1``, sent through
the raw generated stub to a live hwrd with a valid session token (and sometimes a missing or
forged one). The daemon must answer each with OK or a typed error: a status other than INTERNAL
or UNKNOWN carrying ``hwr-error-code`` metadata. It must stay up and leak nothing: after the run
the session closes and no lease, publication or staging file is left.

Messages are generated from the proto descriptors, so an RPC added later is fuzzed too; string
fields draw from random text plus hostile values (paths, NULs, 64-hex keys, a real key, 10 kB).

Quick size (CI): 50 examples per RPC. Long size::

    HWR_FUZZ_EXAMPLES=15000 .venv/bin/python -m pytest tests/fuzz/test_rpc_fuzz.py -q   # 5,000 per RPC
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from daemon_proc import finish_daemon
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message_factory import GetMessageClass
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hwr.client import ArtifactIdentity, connect
from hwr.client.wire import ERROR_CODE_KEY, SESSION_KEY
from hwr.daemon.app.launcher import DaemonProcess
from hwr.protos.hwr.v1 import hwr_pb2 as pb
from hwr.protos.hwr.v1 import hwr_pb2_grpc

from .fuzzkit import checked

EXAMPLES = max(1, int(os.environ.get("HWR_FUZZ_EXAMPLES", "150")) // 3)
SERVICE = pb.DESCRIPTOR.services_by_name["HostWeightRuntime"]
F = FieldDescriptor


@pytest.fixture(scope="module")
def fuzz_daemon() -> Iterator[tuple[DaemonProcess, Any, str]]:
    with tempfile.TemporaryDirectory(prefix="hwrz-") as d:
        os.chmod(d, 0o700)
        daemon = DaemonProcess(Path(d) / "store", Path(d) / "hwrd.sock").start(timeout=60)
        try:
            client = connect(daemon.socket)
            key = client.publish(ArtifactIdentity.simple("fuzz-target"), {"w": torch.arange(16.0)})
            yield daemon, client, key
            client.close()
        finally:
            finish_daemon(daemon)


def _strings(real_key: str) -> st.SearchStrategy[str]:
    hostile = ["", "\x00", "../../etc/passwd", "/", "/proc/self/fd/0", "a" * 10_000, "0" * 64, "f" * 64,
               real_key, real_key[:8], real_key.upper(), "torch.float32", "BF16", "F32", "weight", "parameter",
               "{}", "null", "-1", "💥", "cast", "\ud7ff"]
    return st.one_of(st.text(max_size=70), st.sampled_from(hostile))


def _scalar(field: Any, real_key: str) -> st.SearchStrategy[Any]:
    t = field.type
    if t == F.TYPE_STRING:
        return _strings(real_key)
    if t == F.TYPE_BYTES:
        return st.binary(max_size=300) | st.sampled_from([b"{}", b"null", b'{"schema_version":1}', b"\xff" * 40])
    if t == F.TYPE_BOOL:
        return st.booleans()
    if t in (F.TYPE_FLOAT, F.TYPE_DOUBLE):
        return st.floats(width=32 if t == F.TYPE_FLOAT else 64)
    if t == F.TYPE_ENUM:
        return st.sampled_from([v.number for v in field.enum_type.values]) | st.integers(-5, 100)
    if t in (F.TYPE_INT32, F.TYPE_SINT32, F.TYPE_SFIXED32):
        return st.integers(-(2**31), 2**31 - 1) | st.sampled_from([0, 1, -1, 4096])
    if t in (F.TYPE_UINT32, F.TYPE_FIXED32):
        return st.integers(0, 2**32 - 1) | st.sampled_from([0, 1, 4096])
    if t in (F.TYPE_INT64, F.TYPE_SINT64, F.TYPE_SFIXED64):
        return st.integers(-(2**63), 2**63 - 1) | st.sampled_from([0, 1, -1, 1 << 40])
    if t in (F.TYPE_UINT64, F.TYPE_FIXED64):
        return st.integers(0, 2**64 - 1) | st.sampled_from([0, 1, 1 << 40])
    raise AssertionError(f"unhandled field type {t}")


def message(desc: Any, real_key: str, depth: int = 0) -> st.SearchStrategy[Any]:
    cls = GetMessageClass(desc)
    parts: dict[str, st.SearchStrategy[Any]] = {}
    for field in desc.fields:
        if field.type == F.TYPE_MESSAGE:
            if field.message_type.GetOptions().map_entry:
                k, v = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
                inner: st.SearchStrategy[Any] = st.dictionaries(_scalar(k, real_key), _scalar(v, real_key), max_size=3)
            elif depth >= 3:
                continue
            else:
                inner = message(field.message_type, real_key, depth + 1)
        else:
            inner = _scalar(field, real_key)
        if field.is_repeated and not (field.type == F.TYPE_MESSAGE
                                                    and field.message_type.GetOptions().map_entry):
            inner = st.lists(inner, max_size=3)
        parts[field.name] = st.none() | inner

    def build(values: dict[str, Any]) -> Any:
        msg = cls()
        for name, value in values.items():
            if value is None:
                continue
            field = desc.fields_by_name[name]
            target = getattr(msg, name) if field.is_repeated or field.type == F.TYPE_MESSAGE else None
            if field.type == F.TYPE_MESSAGE and field.message_type.GetOptions().map_entry:
                target.update(value)
            elif field.is_repeated and field.type == F.TYPE_MESSAGE:
                for item in value:
                    target.add().CopyFrom(item)
            elif field.is_repeated:
                target.extend(value)
            elif field.type == F.TYPE_MESSAGE:
                target.CopyFrom(value)
            else:
                setattr(msg, name, value)
        return msg

    return st.fixed_dictionaries(parts).map(build)


def _check(exc: grpc.RpcError, method: str, request: Any) -> str:
    code = exc.code()
    metadata = dict(exc.trailing_metadata() or ())
    assert code not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), (method, request, exc.details())
    assert ERROR_CODE_KEY in metadata, (method, code, exc.details(), request)
    return str(metadata[ERROR_CODE_KEY])


#: Server streams that are subscriptions: they answer the state at once, then stay open until the
#: client leaves (a watch that ended by itself would be the bug), so the fuzzer reads one answer.
SUBSCRIPTIONS = {"WatchChannel"}


def _call(stub: Any, method: Any, request: Any, metadata: Any) -> Any:
    fn = getattr(stub, method.name)
    if method.name in SUBSCRIPTIONS:
        stream = fn(request, metadata=metadata, timeout=20)
        try:
            return next(stream)
        finally:
            stream.cancel()
    if method.server_streaming:
        return list(fn(request, metadata=metadata, timeout=20))
    return fn(request, metadata=metadata, timeout=20)


def _tidy(client: Any, name: str, response: Any) -> None:
    """Undo what an accepted request created, so the next example starts from the same state."""
    if name == "Acquire" and response.lease_id:
        client._connection.stub.Release(pb.ReleaseRequest(lease_id=response.lease_id),
                                        metadata=client._connection.metadata)
    if name == "BeginPublication" and response.publication_id:
        client._connection.stub.AbortPublication(pb.AbortPublicationRequest(publication_id=response.publication_id),
                                                 metadata=client._connection.metadata)


@pytest.mark.parametrize("method", list(SERVICE.methods), ids=lambda m: m.name)
def test_every_rpc_answers_malformed_input_with_a_typed_error(fuzz_daemon, method: Any) -> None:
    daemon, client, key = fuzz_daemon
    stub = hwr_pb2_grpc.HostWeightRuntimeStub(grpc.insecure_channel(f"unix:{daemon.socket}"))
    tokens = st.sampled_from(["valid"] * 6 + ["none", "forged"])
    codes: set[str] = set()

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
    @given(message(method.input_type, key), tokens)
    def run(request: Any, token: str) -> None:
        with checked(f"rpc {method.name}"):
            metadata = {"valid": client._connection.metadata, "none": (), "forged": ((SESSION_KEY, "f" * 48),)}[token]
            try:
                response = _call(stub, method, request, metadata)
            except grpc.RpcError as exc:
                codes.add(_check(exc, method.name, request))
                return
            codes.add("OK")
            if token == "valid" and not method.server_streaming:
                _tidy(client, method.name, response)

    run()
    # The daemon is still serving and the client's session still works.
    status = client.status()  # raises if the daemon stopped serving or ended the client's session
    assert status["sessions"] >= 1, status  # this client's own session is still counted
    assert codes, method.name


def test_after_the_fuzzing_nothing_leaked(fuzz_daemon) -> None:
    daemon, client, _key = fuzz_daemon  # the fuzzing may have evicted or denied that one
    with connect(daemon.socket) as other:
        fresh = other.publish(ArtifactIdentity.simple("after-fuzz"), {"w": torch.arange(8.0)})
        with other.acquire(fresh) as lease:
            assert float(lease.tensors["w"][3]) == 3.0
    assert client.leases() == []
    assert client.status()["publications"] == 0
    assert os.listdir(Path(daemon.root) / "tmp") == []
