"""Publishing an artifact through hwrd: write tensors straight into a daemon-provided staging file.

    pub = client.publisher(identity, specs)         # BeginPublication (may be already present)
    for name, tensor in produce():                   # tensors produced one at a time
        pub.write(name, tensor)                      # pwrite into the staging descriptor
    key = pub.commit()                               # close descriptors, CommitPublication

The daemon lays out the safetensors file (header included) and says where each tensor goes; the
writer only copies raw bytes, in bounded memory (one tensor at a time). At commit the writer
closes every descriptor first: the daemon refuses to commit a file someone still holds open.
Only one publication per identity runs on the node; a second publisher waits and is told
``already_present``/``joined`` instead of staging (``staged`` is then False and ``commit()``
just returns the key).

Contract: a Publisher not committed is aborted by ``abort()``, by ``__exit__`` on an exception,
and by the daemon when this process's session ends; the staging is reclaimed in every case.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hwr.client.errors import InvalidRequest, PublicationFailed
from hwr.client.identity import ArtifactIdentity, canonical_json
from hwr.client.safetensors_header import DTYPES
from hwr.client.wire import MAX_WAIT_TIMEOUT_MS
from hwr.client.writeback import start_writeback
from hwr.protos.hwr.v1 import hwr_pb2 as pb

__all__ = ["Publisher", "TensorSpec", "specs_for"]

_CODE_BY_DTYPE = {info.torch_dtype: code for code, info in DTYPES.items()}
_CHUNK = 64 << 20
_COMMIT_BYTES_PER_S = 32 << 20  # a conservative hash + fsync rate for the commit deadline


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    kind: str = "parameter"
    role: str = "weight"

    def to_proto(self) -> pb.TensorSpec:
        code = _CODE_BY_DTYPE.get(self.dtype)
        if code is None:
            raise InvalidRequest(f"dtype {self.dtype} cannot be published", details={"tensor": self.name})
        kind = pb.TENSOR_KIND_BUFFER if self.kind == "buffer" else pb.TENSOR_KIND_PARAMETER
        return pb.TensorSpec(name=self.name, dtype=code, shape=list(self.shape), kind=kind, role=self.role)


def specs_for(tensors: dict[str, torch.Tensor], buffers: Sequence[str] = ()) -> list[TensorSpec]:
    """Specs for a mapping of CPU tensors (names in ``buffers`` are marked as buffers)."""
    marked = set(buffers)
    return [TensorSpec(name, t.dtype, tuple(t.shape), "buffer" if name in marked else "parameter")
            for name, t in tensors.items()]


class Publisher:
    def __init__(
        self,
        *,
        identity: ArtifactIdentity,
        specs: Sequence[TensorSpec],
        call: Callable[..., Any],
        staging_fds: Callable[[str, str], list[int]],
        wait_timeout: float,
        verify: bool,
        call_timeout: float = 30.0,
        format_metadata: Mapping[str, Any] | None = None,
    ) -> None:
        self._call = call
        self._call_timeout = call_timeout
        self._fds: list[int] = []
        self._specs = {s.name: s for s in specs}
        if len(self._specs) != len(specs):
            raise InvalidRequest("tensor names must be unique")
        wait_timeout = max(0.0, wait_timeout)
        if wait_timeout > MAX_WAIT_TIMEOUT_MS / 1000:
            raise InvalidRequest(f"wait_timeout must be at most {MAX_WAIT_TIMEOUT_MS // 1000} seconds")
        request = pb.BeginPublicationRequest(
            identity_json=identity.canonical_bytes, tensors=[s.to_proto() for s in specs],
            wait_timeout_ms=int(wait_timeout * 1000),
            format_metadata_json=canonical_json(dict(format_metadata)) if format_metadata else b"")
        # The daemon may rightly hold this call for the whole wait (another publisher is building).
        response = call("BeginPublication", request, call_timeout + wait_timeout)
        self.key: str = response.key
        self.outcome = {pb.BEGIN_OUTCOME_STAGED: "staged", pb.BEGIN_OUTCOME_JOINED: "joined",
                        pb.BEGIN_OUTCOME_ALREADY_PRESENT: "already_present"}.get(response.outcome, "unknown")
        self._publication_id = response.publication_id
        self._placements = {p.name: p for p in response.placements}
        self._written: set[str] = set()
        self._digests: dict[str, str] = {}
        self._verify = verify
        self._done = not self.staged
        self.joined = self.outcome == "joined"
        if self.staged:
            try:
                self._fds = staging_fds(response.publication_id, response.publication_token)
            except BaseException:
                self.abort()
                raise

    @property
    def staged(self) -> bool:
        return self.outcome == "staged"

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Copy one tensor's bytes to its place in the staging file (once per tensor)."""
        if self._done:
            raise PublicationFailed("the publication is finished or not staged")
        spec = self._specs.get(name)
        placement = self._placements.get(name)
        if spec is None or placement is None:
            raise InvalidRequest(f"tensor {name!r} is not part of this publication")
        if name in self._written:
            raise InvalidRequest(f"tensor {name!r} was already written")
        if tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
            raise InvalidRequest(f"tensor {name!r} does not match its spec",
                                 details={"tensor": name, "dtype": str(tensor.dtype)})
        data = _raw_bytes(tensor)
        if data.nbytes != placement.nbytes:
            raise InvalidRequest(f"tensor {name!r} has {data.nbytes} bytes, expected {placement.nbytes}")
        fd = self._fds[placement.file_index]
        digest = hashlib.sha256() if self._verify else None
        done = 0
        while done < data.nbytes:
            chunk = data[done:done + _CHUNK]
            written = os.pwrite(fd, chunk, placement.offset + done)
            if digest is not None:
                digest.update(chunk[:written])
            done += written
        # The daemon fsyncs at commit; starting writeback now overlaps the disk with our writing.
        start_writeback(fd, placement.offset, data.nbytes)
        if digest is not None:
            self._digests[name] = digest.hexdigest()
        self._written.add(name)

    def commit(self) -> str:
        """Close the staging descriptors and ask the daemon to commit; returns the key."""
        if self._done:
            return self.key
        missing = sorted(set(self._specs) - self._written)
        if missing:
            raise InvalidRequest(f"{len(missing)} tensors were not written", details={"first": missing[0]})
        self._close_fds()
        # Commit hashes and fsyncs every byte: its deadline grows with the artifact's size.
        nbytes = sum(p.nbytes for p in self._placements.values())
        try:
            response = self._call("CommitPublication", pb.CommitPublicationRequest(
                publication_id=self._publication_id, expected_sha256=self._digests),
                self._call_timeout + nbytes / _COMMIT_BYTES_PER_S)
        except BaseException:
            self.abort()
            raise
        self._done = True
        self.joined = response.joined
        return response.key

    def abort(self) -> None:
        """Abandon the publication; idempotent, never raises for a finished one."""
        self._close_fds()
        if self._done:
            return
        self._done = True
        with contextlib.suppress(Exception):
            self._call("AbortPublication", pb.AbortPublicationRequest(publication_id=self._publication_id))

    def _close_fds(self) -> None:
        fds, self._fds = self._fds, []
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is not None or not self._done:
            self.abort()


def _raw_bytes(tensor: torch.Tensor) -> memoryview:
    if tensor.device.type != "cpu":
        raise InvalidRequest("publish CPU tensors")
    flat = tensor.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")
