"""hwrd never loads torch: every operation the daemon serves, on one real hwrd, then a look from outside.

Producers run in processes of their own and import torch there; the daemon itself has no use for
it, and loading it costs hwrd about 200 MiB of resident memory with the CPU wheel (more with a CUDA
wheel) and seconds of a blocked event loop, during which no client is answered. This test starts
hwrd under ``import_recorder.py`` (an audit hook that writes every module the process loads to a
file, which nothing in the process can take back) and drives every operation that exists against it:

- adoption of a vLLM-Omni root at start (``--adopt true``) and the fleet tier on a ``file://``
  remote (push after each publication, ``push``, ``pull``, a pull on a miss, ``remote ls``,
  ``peers``);
- every hwrctl subcommand (discovered from ``hwr.daemon.ctl.cli``: a new one fails this test until
  it is driven here), checkpoint registration, prewarm with every producer (``PRODUCERS``), a
  lease of a checkpoint's files;
- every gRPC method of ``hwr.v1.HostWeightRuntime`` (read from the service descriptor: a new RPC
  fails this test until it is called here; each call is recorded by a client interceptor),
  gRPC health and reflection, and every peer-channel operation, both publication paths
  (peer socket and gRPC) with a commit and an abort each;
- a metrics scrape and a SIGHUP reload.

Then, while the daemon still runs: its record holds no module ``torch`` (or ``torch.*``) loaded by
the daemon's pid, and ``/proc/PID/maps`` maps no library of a torch installation. Either alone
could miss something (a library mapped without an import; an import whose library was unmapped),
so both are read.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from safetensors.torch import save_file

from hwr.client import ArtifactIdentity, connect
from hwr.client.connection import Connection
from hwr.client.publisher import PEER_MAX_TENSORS, TensorSpec
from hwr.daemon.app.launcher import DaemonProcess
from hwr.daemon.ctl import cli as ctl
from hwr.daemon.producers import PRODUCERS
from hwr.protos.hwr.v1 import hwr_pb2 as pb

from .test_hwrctl_commands import registered
from .test_store_adoption import _lay_out_upstream_root

RECORDER = Path(__file__).resolve().parent / "import_recorder.py"
SERVICE = pb.DESCRIPTOR.services_by_name["HostWeightRuntime"]
#: The peer socket's operations (``hwr.daemon.peer.server``).
PEER_OPS = {"hello", "ping", "acquire", "release", "fds", "staging_fds", "publish_begin", "publish_commit",
            "publish_abort"}


class RecordedDaemon(DaemonProcess):
    """hwrd run by ``import_recorder.py``: ``record`` gets a line per module the process loads."""

    def __init__(self, root: Path, sock: Path, record: Path, *extra: str) -> None:
        super().__init__(root, sock, *extra)
        self.record = record

    def command(self) -> list[str]:
        return [sys.executable, str(RECORDER), str(self.record), "hwr.daemon.app.main", "--root", str(self.root),
                "--socket", str(self.socket), *self.extra]


def torch_modules(record: Path, pid: int) -> list[str]:
    """The torch modules (``torch``, ``torch.*``, ``torchvision``...) that ``pid`` ever loaded."""
    found = []
    for line in record.read_text().splitlines():
        owner, event, name = line.split(" ", 2)
        if int(owner) == pid and event in ("preloaded", "import") and name.split(".")[0].startswith("torch"):
            found.append(name)
    return found


def loaded_modules(record: Path, pid: int) -> set[str]:
    return {line.split(" ", 2)[2] for line in record.read_text().splitlines() if int(line.split(" ", 1)[0]) == pid}


def torch_mappings(pid: int) -> list[str]:
    """Lines of ``/proc/PID/maps`` naming a file of a torch installation (``libtorch*``, ``torch/``)."""
    with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as fh:
        return [line.strip() for line in fh if "libtorch" in line or "/torch/" in line]


class MethodRecorder(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """The gRPC methods this process calls (names without the service prefix)."""

    def __init__(self) -> None:
        self.methods: set[str] = set()

    def _record(self, details: grpc.ClientCallDetails) -> None:
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        self.methods.add(method.rsplit("/", 1)[-1])

    def intercept_unary_unary(self, continuation: Callable[..., Any], details: grpc.ClientCallDetails,
                              request: Any) -> Any:
        self._record(details)
        return continuation(details, request)

    def intercept_unary_stream(self, continuation: Callable[..., Any], details: grpc.ClientCallDetails,
                               request: Any) -> Any:
        self._record(details)
        return continuation(details, request)


@pytest.fixture
def recorded_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[MethodRecorder, set[str]]]:
    """Every gRPC method and peer operation the clients of this process use (they are unchanged:
    the channel is wrapped in a recording interceptor, the exchange notes the op and goes on)."""
    methods = MethodRecorder()
    peer_ops: set[str] = {"hello"}  # opening a session says hello (client.connection.open_session)
    real_channel = grpc.insecure_channel
    real_exchange = Connection.exchange

    def channel(target: str, *args: Any, **kwargs: Any) -> grpc.Channel:
        return grpc.intercept_channel(real_channel(target, *args, **kwargs), methods)

    def exchange(self: Connection, request: dict[str, Any], **kwargs: Any) -> Any:
        peer_ops.add(str(request.get("op")))
        return real_exchange(self, request, **kwargs)

    monkeypatch.setattr(grpc, "insecure_channel", channel)
    monkeypatch.setattr(Connection, "exchange", exchange)
    yield methods, peer_ops


def make_checkpoint(path: Path) -> None:
    path.mkdir()
    g = torch.Generator().manual_seed(3)
    save_file({"blocks.0.attn.to_q.weight": torch.randn(32, 32, generator=g),
               "blocks.0.attn.to_out.weight": torch.randn(32, 64, generator=g),
               "blocks.0.norm.weight": torch.rand(32, generator=g) + 0.5}, path / "model.safetensors")


def wait_for(predicate: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def scrape(path: Path) -> str:
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect(str(path))
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: hwrd\r\n\r\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head[:200]
    return body.decode()


@pytest.mark.timeout(600)
def test_no_operation_of_hwrd_loads_torch(short_tmp: Path, spawn_daemon: Callable[..., DaemonProcess],
                                          recorded_calls: tuple[MethodRecorder, set[str]],
                                          capsys: pytest.CaptureFixture[str]) -> None:
    methods, peer_ops = recorded_calls
    root, shared, metrics = short_tmp / "store", short_tmp / "shared", short_tmp / "metrics.sock"
    laid = _lay_out_upstream_root(root)
    adopted_key = laid["valid"][0]  # type: ignore[index]
    shared.mkdir()
    config = short_tmp / "hwrd.toml"
    settings = f'remote = "file://{shared}"\nmetrics_listen = "unix:{metrics}"\n'
    config.write_text(settings)
    daemon = spawn_daemon(daemon=RecordedDaemon(root, short_tmp / "hwrd.sock", short_tmp / "imports.txt",
                                                "--config", str(config), "--adopt", "true"))
    ran: set[str] = set()

    def hwrctl(name: str, *argv: str, expect: int = 0) -> Any:
        ran.add(name)
        code = ctl.main(["--socket", str(daemon.socket), name, *argv, "--json"])
        out, err = capsys.readouterr()
        assert code == expect, (name, argv, code, err)
        return json.loads(out) if code == 0 and name != "completion" else out

    with connect(daemon.socket) as client:
        # Adoption: the vLLM-Omni root's valid artifact is served.
        with client.acquire(adopted_key) as lease:
            assert lease.tensors["blocks.0.weight"].shape == (8, 8)
        assert client.keepalive()["lease_count"] == 0

        # Publications on the peer socket (small) and through gRPC (more tensors than the peer takes).
        small = {"w": torch.arange(256, dtype=torch.float32)}
        key_small = client.publish(ArtifactIdentity.simple("no-torch/small"), small)
        assert client.publish(ArtifactIdentity.simple("no-torch/small"), small) == key_small
        many = {f"t{i}": torch.full((2,), float(i)) for i in range(PEER_MAX_TENSORS + 1)}
        key_many = client.publish(ArtifactIdentity.simple("no-torch/many"), many)
        for name, count in (("no-torch/abort-peer", 1), ("no-torch/abort-rpc", PEER_MAX_TENSORS + 1)):
            pub = client.publisher(ArtifactIdentity.simple(name),
                                   [TensorSpec(f"t{i}", torch.float32, (2,)) for i in range(count)])
            assert pub.staged
            pub.abort()
        with client.acquire(key_many) as lease:
            assert float(lease.tensors[f"t{PEER_MAX_TENSORS}"][1]) == PEER_MAX_TENSORS

        # The RPCs no client call makes on its own: OpenSession, Acquire of an artifact, Release.
        stub, metadata = client._connection.stub, client._connection.metadata
        stub.OpenSession(pb.OpenSessionRequest(client_name="no-torch", client_version="0"), metadata=metadata,
                         timeout=30)
        acquired = stub.Acquire(pb.AcquireRequest(artifact=pb.ArtifactRef(key=key_small)), metadata=metadata,
                                timeout=30)
        _reply, fds, _tail = client._connection.exchange(
            {"op": "fds", "lease_id": acquired.lease_id, "lease_token": acquired.lease_token}, want_fds=True)
        for fd in fds:
            os.close(fd)
        assert stub.Release(pb.ReleaseRequest(lease_id=acquired.lease_id), metadata=metadata, timeout=30).released
        assert client._connection.exchange({"op": "ping"}, want_fds=False)[0]["ok"]

        # Checkpoints: registration, a lease of the files, a prewarm with each producer.
        make_checkpoint(short_tmp / "ckpt")
        ckpt = hwrctl("checkpoints", "add", str(short_tmp / "ckpt"))["checkpoint_id"]
        assert [c["checkpoint_id"] for c in hwrctl("checkpoints")] == [ckpt]
        with client.acquire_checkpoint(ckpt) as ckpt_lease:
            assert ckpt_lease.tensors["blocks.0.norm.weight"].shape == (32,)
        plan = short_tmp / "plan.toml"
        plan.write_text('default = "replicate"\n[[rules]]\npattern = "*.to_q.weight"\nsplit = "column"\n')
        producer_args = {"cast": ["--dtype", "bf16"], "fp8-per-tensor": [],
                         "tp-slice": ["--tp-size", "2", "--tp-plan", str(plan)]}
        assert set(producer_args) == set(PRODUCERS), "a producer without a prewarm here"
        built = [a["key"] for name, args in producer_args.items()
                 for a in hwrctl("prewarm", ckpt, "--producer", name, *args)["artifacts"]]
        assert len(built) == 4

        # The operator's commands, on artifacts of each origin.
        hwrctl("status")
        assert {key_small, key_many, adopted_key, *built} <= {a["key"] for a in hwrctl("ls")}
        hwrctl("show", key_small[:12])
        with client.acquire(key_small):
            assert [lease["key"] for lease in hwrctl("leases")] == [key_small]
        hwrctl("usage")
        hwrctl("verify", key_many)
        hwrctl("verify", "--all")
        hwrctl("pin", built[0])
        hwrctl("unpin", built[0])
        hwrctl("deny", built[1], "--reason", "no-torch test")
        hwrctl("allow", built[1])
        hwrctl("completion", "bash")

        # Channels: revisions committed to one (durable, then not), a watch, an acquire through it.
        rev1 = client.publish(ArtifactIdentity.simple("no-torch/rev1"), small, channel="no-torch")
        with client.watch_channel("no-torch") as watch:
            first = watch.wait(timeout=30)
            assert first is not None and first.key == rev1
            rev2 = client.publish(ArtifactIdentity.simple("no-torch/rev2"), {"w": small["w"] + 1},
                                  channel="no-torch", durable=False)
            second = watch.wait(timeout=30)
            assert second is not None and second.key == rev2
        with client.acquire_channel("no-torch") as lease:
            assert lease.key == rev2
        hwrctl("channel", "set", "no-torch", rev1[:12])
        assert hwrctl("channel", "show", "no-torch")["key"] == rev1
        assert [c["name"] for c in hwrctl("channel", "ls")] == ["no-torch"]
        hwrctl("channel", "rm", "no-torch")

        # The fleet tier: every publication is pushed; pull back an evicted one, and pull on a miss.
        for key in (key_small, key_many):
            wait_for(lambda key=key: (shared / "artifacts" / key / "READY.json").exists(), f"the push of {key}")
        hwrctl("push", built[2])
        assert {key_small, key_many} <= {a["key"] for a in hwrctl("remote", "ls")}
        assert hwrctl("peers")["holders"] == []  # the peer tier's records (none: it is off here)
        hwrctl("evict", key_many)
        hwrctl("pull", key_many)
        hwrctl("evict", key_small)
        with client.acquire(key_small) as lease:  # a local miss, pulled from the remote
            assert torch.equal(lease.tensors["w"], small["w"])
        hwrctl("evict", built[3])
        hwrctl("gc", "--target-bytes", "0")

        # Metrics, gRPC health and reflection.
        assert "hwr_leases_granted_total" in scrape(metrics)
        from grpc_health.v1 import health_pb2, health_pb2_grpc
        from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

        with grpc.insecure_channel(f"unix:{daemon.socket}") as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=30)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            [listed] = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=30)
            assert SERVICE.full_name in {s.name for s in listed.list_services_response.service}

    # SIGHUP: a reloadable key changes.
    config.write_text(settings + "allow_uids = [65534]\n")
    daemon.proc.send_signal(signal.SIGHUP)  # type: ignore[union-attr]
    wait_for(lambda: "configuration reloaded" in daemon.log.read_text(errors="replace"), "the reload")
    with connect(daemon.socket) as client:
        client.status()

    missing_commands = set(registered()) - ran
    assert not missing_commands, f"hwrctl subcommands not driven here: {sorted(missing_commands)}"
    missing_rpcs = {m.name for m in SERVICE.methods} - methods.methods
    assert not missing_rpcs, f"RPCs not called here: {sorted(missing_rpcs)}"
    assert peer_ops >= PEER_OPS, f"peer operations not used here: {sorted(PEER_OPS - peer_ops)}"

    loaded = loaded_modules(daemon.record, daemon.pid)
    # The record is the daemon's: it holds what those operations ran.
    assert {"hwr.daemon.app.server", "hwr.daemon.producers.build", "hwr.daemon.checkpoints.registry",
            "hwr.daemon.fleet.remote_file", "hwr.daemon.store.adoption"} <= loaded
    assert (torch_modules(daemon.record, daemon.pid), torch_mappings(daemon.pid)) == ([], [])


@pytest.mark.timeout(120)
def test_the_record_and_the_maps_show_torch_when_a_process_loads_it(short_tmp: Path) -> None:
    """The two checks above can fail: run on a module that imports torch (the producers' block
    readers), the record names torch and the process maps libtorch."""
    import subprocess

    record = short_tmp / "imports.txt"
    probe = ("import os, sys, hwr.daemon.producers.blocks; sys.stdout.write('loaded\\n'); sys.stdout.flush(); "
             "sys.stdin.read()")
    (short_tmp / "torch_probe.py").write_text(probe)
    proc = subprocess.Popen([sys.executable, str(RECORDER), str(record), "torch_probe"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=short_tmp)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "loaded\n"
        assert "torch" in torch_modules(record, proc.pid)
        assert torch_mappings(proc.pid)
    finally:
        proc.kill()
        proc.wait(30)
