"""Adoption of a store root written by vLLM-Omni 0.30's in-process store (``hwrd --adopt true``).

``_lay_out_upstream_root`` writes, by hand, exactly what vLLM-Omni 0.30 writes (read from
``vllm_omni/host_weight_runtime/filesystem/store.py`` and ``writer.py``): ``domain.json``
(canonical JSON, 0444), ``locks/``, ``tmp/<key>.<pid>.<uuid>/`` staging, and
``artifacts/<key>/`` (0555) holding ``part-1.safetensors`` (header keys sorted,
``__metadata__ = {"format": "pt", "host_weight_runtime": "1"}``, space-padded to 8 bytes, tensors
contiguous in name order), ``manifest.json`` and ``READY.json`` (canonical JSON, 0444, integrity
mode ``full_checksum``). A second test builds the root with vLLM-Omni's own
``FilesystemHostWeightStore`` when ``vllm_omni`` is importable.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import uuid
from pathlib import Path

import pytest
import torch

from hwr.client import ArtifactIdentity, connect
from hwr.client.errors import HwrError

DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16"}


def _canonical(value: object) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def _write(path: Path, data: bytes, mode: int = 0o444) -> None:
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    try:
        os.write(fd, data)
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def _payload(tensors: dict[str, torch.Tensor]) -> tuple[bytes, dict[str, str]]:
    header: dict[str, object] = {"__metadata__": {"format": "pt", "host_weight_runtime": "1"}}
    cursor, blobs, digests = 0, [], {}
    for name in sorted(tensors):
        raw = tensors[name].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": DTYPES[tensors[name].dtype], "shape": list(tensors[name].shape),
                        "data_offsets": [cursor, cursor + len(raw)]}
        cursor += len(raw)
        blobs.append(raw)
        digests[name] = hashlib.sha256(raw).hexdigest()
    encoded = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    return struct.pack("<Q", len(encoded)) + encoded + b"".join(blobs), digests


def _artifact(root: Path, identity: ArtifactIdentity, tensors: dict[str, torch.Tensor]) -> Path:
    data, digests = _payload(tensors)
    entries = []
    for name in sorted(tensors):
        t = tensors[name]
        entries.append({"name": name, "kind": "parameter", "role": "weight", "file_name": "part-1.safetensors",
                        "storage_key": name, "shape": list(t.shape), "dtype": str(t.dtype),
                        "stride": list(t.stride()), "nbytes": t.numel() * t.element_size(),
                        "sha256": digests[name]})
    content = hashlib.sha256()
    for e in entries:
        content.update(_canonical({k: e[k] for k in ("name", "kind", "role", "shape", "dtype", "stride", "nbytes",
                                                     "sha256")}))
    manifest = _canonical({
        "schema_version": 1, "artifact_key": identity.key, "identity": identity.to_dict(),
        "producer_schema": identity.producer.manifest_schema, "restorer_schema": identity.producer.restorer_schema,
        "tensors": entries,
        "files": [{"file_name": "part-1.safetensors", "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}],
        "artifact_content_sha256": content.hexdigest(), "format_metadata": {}})
    marker = _canonical({"schema_version": 1, "publication_id": uuid.uuid4().hex,
                         "manifest_sha256": hashlib.sha256(manifest).hexdigest(),
                         "artifact_content_sha256": content.hexdigest(), "integrity_mode": "full_checksum"})
    staging = root / "tmp" / f"{identity.key}.{os.getpid()}.{uuid.uuid4().hex}"
    staging.mkdir(mode=0o700)
    _write(staging / "part-1.safetensors", data)
    _write(staging / "manifest.json", manifest)
    _write(staging / "READY.json", marker)
    os.chmod(staging, 0o755 | 0o1000)  # upstream: writable + sticky until published
    target = root / "artifacts" / identity.key
    os.replace(staging, target)
    os.chmod(target, 0o555)
    return target


def _lay_out_upstream_root(root: Path) -> dict[str, object]:
    root.mkdir(mode=0o700)
    for name in ("locks", "artifacts", "tmp", "quarantine", "deny"):
        (root / name).mkdir(mode=0o700)
    _write(root / "domain.json", _canonical({
        "schema_version": 1, "domain_uuid": uuid.uuid4().hex, "scope": "node", "domain_id": "test-node",
        "backend": "local_filesystem", "storage_class": "disk", "filesystem_type": "ext4"}))
    valid_id = ArtifactIdentity.simple("upstream-valid", dtype="float32")
    valid = {"blocks.0.weight": torch.arange(64.0).reshape(8, 8), "norm.scale": torch.linspace(0, 1, 8)}
    _artifact(root, valid_id, valid)
    corrupt_id = ArtifactIdentity.simple("upstream-corrupt", dtype="float32")
    corrupt_dir = _artifact(root, corrupt_id, {"w": torch.ones(256)})
    payload = corrupt_dir / "part-1.safetensors"
    os.chmod(corrupt_dir, 0o755)
    st = os.stat(payload)
    os.chmod(payload, 0o644)
    with open(payload, "r+b") as f:  # bit rot in the tensor bytes: size and mtime unchanged
        f.seek(-5, os.SEEK_END)
        f.write(b"\x13")
    os.chmod(payload, 0o444)
    os.utime(payload, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.chmod(corrupt_dir, 0o555)
    unfinished_id = ArtifactIdentity.simple("upstream-unfinished", dtype="float32")
    staging = root / "tmp" / f"{unfinished_id.key}.4242.{uuid.uuid4().hex}"
    staging.mkdir(mode=0o700)
    data, _ = _payload({"w": torch.ones(64)})
    _write(staging / "part-1.safetensors", data[: len(data) // 2], mode=0o600)  # producer died mid-write
    return {"valid": (valid_id.key, valid), "corrupt": corrupt_id.key, "unfinished": unfinished_id.key}


def _report(root: Path) -> dict[str, dict[str, str]]:
    return {a["key"]: a for a in json.loads((root / "adoption.json").read_bytes())["artifacts"]}


def test_adoption_serves_the_valid_artifact_and_explains_the_others(spawn_daemon, short_tmp: Path) -> None:
    root = short_tmp / "vo-root"
    laid = _lay_out_upstream_root(root)
    valid_key, valid = laid["valid"]  # type: ignore[misc]
    daemon = spawn_daemon("--adopt", "true", root=root)
    report = _report(root)
    assert report[valid_key]["status"] == "adopted", report[valid_key]
    assert report[laid["corrupt"]]["status"] == "rejected"  # type: ignore[index]
    assert "CHECKSUM_MISMATCH" in report[laid["corrupt"]]["reason"]  # type: ignore[index]
    assert report[laid["unfinished"]]["status"] == "rejected"  # type: ignore[index]
    assert "unfinished publication" in report[laid["unfinished"]]["reason"]  # type: ignore[index]
    with connect(daemon.socket) as client:
        assert {a["key"] for a in client.list_artifacts()} == {valid_key}
        with client.acquire(valid_key) as lease:
            assert lease.key == valid_key
            assert set(lease.tensors) == set(valid)
            for name, tensor in valid.items():
                assert torch.equal(lease.tensors[name], tensor)
        with pytest.raises(HwrError):
            client.acquire(laid["corrupt"])  # type: ignore[arg-type]
    assert os.listdir(root / "tmp") == []
    # A restart keeps the verdicts and does not re-hash what was adopted.
    daemon.stop()
    daemon = spawn_daemon("--adopt", "true", root=root)
    assert _report(root)[valid_key] == {**report[valid_key], "reason": "validated"}


def test_adoption_of_a_root_built_by_vllm_omni_itself(spawn_daemon, short_tmp: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("vllm_omni")
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "vllm_plugin"))
    monkeypatch.delenv("HWR_SOCKET", raising=False)  # vLLM-Omni's own FilesystemHostWeightStore
    import vo_helpers as vo
    from vllm_omni.host_weight_runtime import LookupPhase, ResolutionOutcome

    root = short_tmp / "vo-own"
    root.mkdir(mode=0o700)
    ident, data = vo.identity("adopt/model"), vo.tensors(11)
    built = vo.runtime(root, local_build=True).resolve(
        ident, producer=vo.TensorProducer(ident, data, phase=LookupPhase.PRE_LOAD_SAFE))
    assert built.report.outcome is ResolutionOutcome.LOCAL_PRODUCTION, built.report
    built.lease.close()
    assert (root / "artifacts" / ident.key / "READY.json").exists()
    daemon = spawn_daemon("--adopt", "true", root=root)
    assert _report(root)[ident.key]["status"] == "adopted"
    with connect(daemon.socket) as client, client.acquire(ident.key) as lease:
        assert lease.key == ident.key and set(lease.tensors) == set(data)
        for name, tensor in data.items():
            assert torch.equal(lease.tensors[name], tensor), name
