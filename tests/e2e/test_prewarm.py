"""Prewarm end to end: a real hwrd, real producer processes, real files, hwrctl as a subprocess."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import hwr.client as hc
from hwr.client.errors import CheckpointModified, ManifestCorrupt, ProducerFailed, ProducerTimeout
from hwr.client.identity import SourceIdentity
from hwr.client.publisher import TensorSpec
from hwr.daemon.producers.cast import CastProducer
from hwr.daemon.producers.fp8 import E4M3_MAX

pytestmark = pytest.mark.timeout(180)
# The console script's entry point (``python -m hwr.daemon.ctl.cli`` would run a second copy of the
# module, without the subcommands that extensions register on the imported one).
HWRCTL = [sys.executable, "-c", "import sys; from hwr.daemon.ctl.cli import main; sys.exit(main())"]


def make_checkpoint(path: Path, n_blocks: int = 2, width: int = 64) -> dict[str, torch.Tensor]:
    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(7)
    first, second = {}, {}
    for i in range(n_blocks):
        target = first if i % 2 == 0 else second
        target[f"blocks.{i}.attn.to_q.weight"] = torch.randn(width, width, generator=g)
        target[f"blocks.{i}.attn.to_out.weight"] = torch.randn(width, width * 2, generator=g)
        target[f"blocks.{i}.norm.weight"] = torch.rand(width, generator=g) + 0.5
    first["steps"] = torch.arange(7)
    save_file(first, path / "model-00001-of-00002.safetensors")
    save_file(second, path / "model-00002-of-00002.safetensors")
    return {**first, **second}


def staging_entries(root: Path) -> list[str]:
    return sorted(os.listdir(root / "tmp"))


def producer_children(pid: int) -> list[int]:
    # -ww: whole command lines. Without it ps may cut them at 80 columns (it does under pytest),
    # which drops "producers.worker" once the interpreter's path is long (a venv in a deep folder).
    out = subprocess.run(["ps", "-ww", "-o", "pid=,args=", "--ppid", str(pid)], capture_output=True,
                         text=True).stdout
    return [int(line.split()[0]) for line in out.splitlines() if "producers.worker" in line]


def wait_until(predicate, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


@pytest.fixture
def slow_daemon(short_tmp: Path, spawn_daemon):
    config = short_tmp / "hwrd.toml"
    config.write_text("producer_throttle_s = 0.3\n")
    return spawn_daemon("--config", str(config))


def test_cast_prewarm_matches_torch_is_deterministic_and_leases_share_the_checkpoint(
        short_tmp: Path, spawn_daemon) -> None:
    source = make_checkpoint(short_tmp / "ckpt")
    daemon = spawn_daemon()
    with hc.connect(daemon.socket) as client:
        info = client.add_checkpoint(short_tmp / "ckpt")
        assert info["added"] and info["source_kind"] == "content-sha256" and info["tensors"] == len(source)
        assert client.add_checkpoint(short_tmp / "ckpt")["added"] is False
        progress: list[dict] = []
        [built] = client.prewarm(info["checkpoint_id"][:10], "cast", dtype="bf16", keep_fp32=["*norm*"],
                                 on_progress=progress.append)
        assert built["outcome"] == "built" and progress and progress[-1]["done_bytes"] == progress[-1]["total_bytes"]
        with client.acquire(built["key"]) as lease:
            assert set(lease.tensors) == set(source)
            for name, tensor in source.items():
                if not tensor.is_floating_point():
                    expected = tensor
                elif "norm" in name:
                    expected = tensor.float()
                else:
                    expected = tensor.to(torch.bfloat16)
                got = lease.tensors[name]
                assert got.dtype == expected.dtype and torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
        [again] = client.prewarm(info["checkpoint_id"], "cast", dtype="bf16", keep_fp32=["*norm*"])
        assert again["outcome"] == "already_present" and again["key"] == built["key"]
        # Checkpoint lease: zero-copy views of the original files, counted in hwrctl leases.
        with client.acquire_checkpoint(info["checkpoint_id"]) as ck:
            assert all(torch.equal(ck.tensors[n], t) for n, t in source.items())
            assert any(x["key"] == "checkpoint:" + info["checkpoint_id"] for x in client.leases())
            assert client.list_checkpoints()[0]["leases"] == 1
    # A second daemon on another root builds the same bytes: same key and content digest.
    other = spawn_daemon(root=short_tmp / "store2", sock=short_tmp / "b.sock")
    with hc.connect(other.socket) as client:
        info2 = client.add_checkpoint(short_tmp / "ckpt")
        assert info2["checkpoint_id"] == info["checkpoint_id"]
        [rebuilt] = client.prewarm(info2["checkpoint_id"], "cast", dtype="bf16", keep_fp32=["*norm*"])
    assert (rebuilt["key"], rebuilt["content_sha256"]) == (built["key"], built["content_sha256"])


def test_tp_slices_concatenate_back_and_fp8_is_within_its_error_bound(short_tmp: Path, spawn_daemon) -> None:
    source = make_checkpoint(short_tmp / "ckpt")
    plan = short_tmp / "plan.toml"
    plan.write_text('default = "replicate"\n[[rules]]\npattern = "*.to_q.weight"\nsplit = "column"\n'
                    '[[rules]]\npattern = "*.to_out.weight"\nsplit = "row"\n')
    daemon = spawn_daemon()
    with hc.connect(daemon.socket) as client:
        ckpt = client.add_checkpoint(short_tmp / "ckpt")["checkpoint_id"]
        out = subprocess.run([*HWRCTL, "--socket", str(daemon.socket), "prewarm",
                              ckpt, "--producer", "tp-slice", "--tp-size", "2", "--tp-plan", str(plan), "--json"],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        document = json.loads(out.stdout)
        assert len(document["keys"]) == 2 and [a["tp_rank"] for a in document["artifacts"]] == [0, 1]
        leases = [client.acquire(k) for k in document["keys"]]
        for name, tensor in source.items():
            parts = [lease.tensors[name] for lease in leases]
            if name.endswith("to_q.weight"):
                assert torch.equal(torch.cat(parts, 0), tensor) and parts[0].shape[0] == tensor.shape[0] // 2
            elif name.endswith("to_out.weight"):
                assert torch.equal(torch.cat(parts, 1), tensor) and parts[0].shape[1] == tensor.shape[1] // 2
            else:
                assert all(torch.equal(p, tensor) for p in parts)
        for lease in leases:
            lease.close()
        [fp8] = client.prewarm(ckpt, "fp8-per-tensor")
        with client.acquire(fp8["key"]) as lease:
            for name, w in source.items():
                got = lease.tensors[name]
                if w.dim() == 2 and name.endswith(".weight"):
                    scale = lease.tensors[name + "_scale"]
                    assert got.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
                    assert torch.equal(scale, w.abs().max() / E4M3_MAX)
                    error = (got.float() * scale - w).abs()
                    bound = torch.maximum(w.abs() * 2**-4, scale * 2**-10) * (1 + 1e-6)
                    assert bool((error <= bound).all())
                    # In-process reference with torch: identical bytes.
                    ref = (w / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
                    assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8))
                elif w.is_floating_point():
                    assert torch.equal(got, w.to(torch.bfloat16))


def test_modified_checkpoint_refuses_leases_and_prewarm_and_hostile_headers_are_typed(
        short_tmp: Path, spawn_daemon) -> None:
    make_checkpoint(short_tmp / "ckpt")
    hostile = short_tmp / "hostile"
    hostile.mkdir()
    header = b'{"x":{"dtype":"F32","shape":[4],"data_offsets":[0,999999]}}'
    (hostile / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 16)
    daemon = spawn_daemon()
    with hc.connect(daemon.socket) as client:
        with pytest.raises(ManifestCorrupt) as err:
            client.add_checkpoint(hostile)
        assert err.value.details.get("file") == "model.safetensors"
        assert client.list_checkpoints() == []
        ckpt = client.add_checkpoint(short_tmp / "ckpt")["checkpoint_id"]
        target = short_tmp / "ckpt" / "model-00002-of-00002.safetensors"
        with open(target, "r+b") as fh:  # same size, other bytes: only mtime/ctime tell
            fh.seek(-4, os.SEEK_END)
            fh.write(b"\x01\x02\x03\x04")
        with pytest.raises(CheckpointModified):
            client.acquire_checkpoint(ckpt)
        with pytest.raises(CheckpointModified):
            client.prewarm(ckpt, "cast")
        assert client.list_checkpoints()[0]["state"] == "modified"
        assert client.list_artifacts() == [] and staging_entries(daemon.root) == []


def test_timeout_and_killed_producer_leave_no_artifact_and_no_staging(short_tmp: Path, slow_daemon) -> None:
    make_checkpoint(short_tmp / "ckpt", n_blocks=4)
    with hc.connect(slow_daemon.socket) as client:
        ckpt = client.add_checkpoint(short_tmp / "ckpt")["checkpoint_id"]
        with pytest.raises(ProducerTimeout):
            client.prewarm(ckpt, "cast", timeout_s=1.0)
        assert client.list_artifacts() == [] and staging_entries(slow_daemon.root) == []
        assert producer_children(slow_daemon.pid) == []

        def kill_worker() -> None:
            assert wait_until(lambda: bool(producer_children(slow_daemon.pid)))
            os.kill(producer_children(slow_daemon.pid)[0], signal.SIGKILL)

        killer = threading.Thread(target=kill_worker)
        killer.start()
        with pytest.raises(ProducerFailed):
            client.prewarm(ckpt, "cast")
        killer.join()
        assert client.list_artifacts() == [] and staging_entries(slow_daemon.root) == []


def test_hwrctl_sigint_cancels_and_a_publisher_joins_a_running_build(short_tmp: Path, slow_daemon) -> None:
    make_checkpoint(short_tmp / "ckpt", n_blocks=3)
    env = {**os.environ, "HWR_SOCKET": str(slow_daemon.socket)}
    ctl = HWRCTL
    added = subprocess.run([*ctl, "checkpoints", "add", str(short_tmp / "ckpt"), "--json"], env=env,
                           capture_output=True, text=True, timeout=60)
    assert added.returncode == 0, added.stderr
    ckpt = json.loads(added.stdout)["checkpoint_id"]
    listed = subprocess.run([*ctl, "checkpoints"], env=env, capture_output=True, text=True, timeout=60)
    assert ckpt[:16] in listed.stdout
    # hwrctl as a user's terminal starts it: SIGINT at its default. A suite started in the
    # background by a non-interactive shell inherits SIGINT ignored, and so would hwrctl.
    proc = subprocess.Popen([*ctl, "prewarm", ckpt, "--producer", "cast"], env=env, stderr=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.stderr is not None
    first = proc.stderr.readline()  # the progress bar's first line: the build is running
    assert "rank 0" in first, first
    assert producer_children(slow_daemon.pid)
    proc.send_signal(signal.SIGINT)
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and "BUILD_CANCELLED" in err
    assert wait_until(lambda: not producer_children(slow_daemon.pid) and not staging_entries(slow_daemon.root))
    with hc.connect(slow_daemon.socket) as client:
        assert client.list_artifacts() == []
        # Join: a worker publishing the build's identity while it runs waits and joins it.
        info = client.list_checkpoints()[0]
        producer = CastProducer("bf16")
        identity = producer.identity(SourceIdentity(info["model_id"], info["revision"], f"hwr-checkpoint:{ckpt}"))
        results: dict = {}
        builder = threading.Thread(target=lambda: results.update(build=client.prewarm(ckpt, "cast")))
        builder.start()
        assert wait_until(lambda: bool(producer_children(slow_daemon.pid)))
        source = load_file(short_tmp / "ckpt" / "model-00001-of-00002.safetensors")
        specs = [TensorSpec(n, t.to(torch.bfloat16).dtype if t.is_floating_point() else t.dtype, tuple(t.shape))
                 for n, t in source.items()]
        with hc.connect(slow_daemon.socket) as worker, worker.publisher(identity, specs, wait_timeout=120) as pub:
            assert pub.outcome == "joined" and pub.key == identity.key
        builder.join(120)
        assert results["build"][0]["key"] == identity.key and results["build"][0]["outcome"] == "built"


def test_cast_prewarm_to_fp16_builds_in_the_worker_process(short_tmp: Path, spawn_daemon) -> None:
    """fp16 end to end: the producer's worker process rebuilds it from its options. Every fp16
    build used to fail there ("unsupported dtype 'F16'"), bf16 did not."""
    source = make_checkpoint(short_tmp / "ckpt")
    daemon = spawn_daemon()
    with hc.connect(daemon.socket) as client:
        ckpt = client.add_checkpoint(short_tmp / "ckpt")["checkpoint_id"]
        [built] = client.prewarm(ckpt, "cast", dtype="fp16")
        assert built["outcome"] == "built"
        with client.acquire(built["key"]) as lease:
            for name, tensor in source.items():
                expected = tensor.half() if tensor.is_floating_point() else tensor
                assert torch.equal(lease.tensors[name], expected), name
