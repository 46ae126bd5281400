"""Acceptance: another process sees the published bytes, and N workers share one physical copy."""

from __future__ import annotations

import pytest
import torch

from hwr.client import ArtifactIdentity, connect
from hwr.daemon.app.launcher import DaemonProcess

from .helpers import MIB, Worker, digests, mapping_pss_kib, patterned, pss_kib, workers

ARTIFACT_BYTES = 512 * MIB
WORKERS = 4


@pytest.mark.timeout(90)
def test_bytes_equal_after_acquire_in_another_process(shared_hwrd: DaemonProcess) -> None:
    tensors = {
        "blocks.0.attn.qkv.weight": patterned(768 * 256 * 2, 7, torch.bfloat16).reshape(768, 256),
        "blocks.0.attn.qkv.bias": torch.linspace(-3.0, 3.0, 768, dtype=torch.float32),
        "blocks.0.norm.weight": torch.randn(256, dtype=torch.float16),
        "pos_embed": torch.arange(4 * 16 * 8, dtype=torch.int64).reshape(4, 16, 8),
        "embed.weight.t": patterned(64 * 48 * 4, 11, torch.float32).reshape(64, 48).t(),  # not contiguous
        "quant.scale": torch.tensor(0.125, dtype=torch.float32),  # 0-dim
        "mask": torch.tensor([True, False, True]),
        "codebook": patterned(4096, 3),
    }
    with connect(shared_hwrd.socket) as client:
        key = client.publish(ArtifactIdentity.simple("e2e/bytes"), tensors, buffers=("mask",))
    assert key == ArtifactIdentity.simple("e2e/bytes").key

    worker = Worker("digest", str(shared_hwrd.socket), key, forked=True)
    try:
        report = worker.result(timeout=60)
        assert worker.wait() == 0, worker.stderr
    finally:
        worker.close()

    assert report["key"] == key
    assert report["tensors"] == digests(tensors)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_workers_share_one_physical_copy(shared_hwrd: DaemonProcess) -> None:
    daemon = shared_hwrd
    # Four 128 MiB tensors: two bf16 matrices, one f32 vector, one byte blob (about 1 s to build).
    quarter = ARTIFACT_BYTES // 4
    tensors = {
        "blocks.0.weight": patterned(quarter, 1, torch.bfloat16).reshape(-1, 4096),
        "blocks.1.weight": patterned(quarter, 2, torch.bfloat16).reshape(-1, 4096),
        "blocks.0.bias": patterned(quarter, 3, torch.float32),
        "embed.weight": patterned(quarter, 4),
    }
    with connect(daemon.socket) as client:
        key = client.publish(ArtifactIdentity.simple("e2e/pss"), tensors)
        del tensors
        artifact_bytes = client.inspect(key)["size_bytes"]
        assert artifact_bytes >= ARTIFACT_BYTES

        artifacts_dir = daemon.root / "artifacts"
        with workers(*[("hold", str(daemon.socket), key)] * WORKERS, forked=True) as procs:
            for w in procs:
                w.expect("ready", timeout=90)
            # After imports and connect, before acquire (forked from the zygote, the workers share
            # torch's pages: about 50 MiB PSS each; about 180 MiB as fresh interpreters).
            before = [pss_kib(w.pid) for w in procs]
            for w in procs:
                w.send("acquire")
            for w in procs:
                w.expect("held", timeout=60)
            # Every worker holds its lease and has touched every page: measure now, all at once.
            leases = [x for x in client.leases() if x["key"] == key]
            after = [pss_kib(w.pid) for w in procs]
            mapped = [mapping_pss_kib(w.pid, artifacts_dir) for w in procs]
            for w in procs:
                w.send("release")
            for w in procs:
                w.expect("done", timeout=30)
                assert w.wait() == 0, w.stderr

    growth = [(a - b) * 1024 for a, b in zip(after, before, strict=True)]
    mib = [round(g / MIB, 1) for g in growth]
    print(f"\nartifact {artifact_bytes / MIB:.1f} MiB, {WORKERS} workers")
    print(f"PSS before acquire (MiB): {[round(b / 1024, 1) for b in before]}")
    print(f"PSS while holding   (MiB): {[round(a / 1024, 1) for a in after]}")
    print(f"PSS growth          (MiB): {mib} sum {sum(growth) / MIB:.1f} "
          f"(limit {(1.15 * artifact_bytes + WORKERS * 64 * MIB) / MIB:.1f})")
    print(f"artifact-mapping PSS (MiB): {[round(m / 1024, 1) for m in mapped]} "
          f"sum {sum(mapped) / 1024:.1f} (limit {1.05 * artifact_bytes / MIB:.1f})")

    assert len(leases) == WORKERS and {x["pid"] for x in leases} == {w.pid for w in procs}
    assert sum(growth) <= 1.15 * artifact_bytes + WORKERS * 64 * MIB
    # Sharing really happens: the artifact's pages are counted once across the workers, and each
    # worker did map (and touch) its share of them.
    assert sum(mapped) * 1024 <= 1.05 * artifact_bytes
    assert all(m * 1024 >= artifact_bytes / (2 * WORKERS) for m in mapped)
