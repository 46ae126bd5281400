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

Live updates: ``channel=NAME`` points the channel at the artifact as part of the commit (or at
the begin's answer when the artifact is already present); ``durable=False`` asks for no fsync
(the artifact is gone at hwrd's next start, and the channel falls back to its last durable key).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hwr.client.channels import check_channel_name
from hwr.client.errors import (
    ActiveBuildTimeout,
    ExceedsFilesystem,
    InsufficientCapacity,
    InvalidRequest,
    PublicationFailed,
    StoreLimitExceeded,
)
from hwr.client.identity import ArtifactIdentity, canonical_json
from hwr.client.safetensors_header import DTYPES
from hwr.client.wire import MAX_WAIT_TIMEOUT_MS, close_fds
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

    def to_wire(self) -> list[Any]:
        """The peer socket's form: [name, dtype code, shape, kind, role]."""
        code = _CODE_BY_DTYPE.get(self.dtype)
        if code is None:
            raise InvalidRequest(f"dtype {self.dtype} cannot be published", details={"tensor": self.name})
        return [self.name, code, list(self.shape), "buffer" if self.kind == "buffer" else "parameter", self.role]


@dataclass(frozen=True)
class _Placement:
    name: str
    file_index: int
    offset: int
    nbytes: int


def _checked_fds(fds: list[int], count: int) -> list[int]:
    if len(fds) != count:
        close_fds(fds)
        raise PublicationFailed(f"hwrd sent {len(fds)} staging descriptors, expected {count}")
    return fds




def specs_for(tensors: dict[str, torch.Tensor], buffers: Sequence[str] = ()) -> list[TensorSpec]:
    """Specs for a mapping of CPU tensors (names in ``buffers`` are marked as buffers)."""
    marked = set(buffers)
    return [TensorSpec(name, t.dtype, tuple(t.shape), "buffer" if name in marked else "parameter")
            for name, t in tensors.items()]


#: Publications at most this large (and with at most ``PEER_MAX_TENSORS`` tensors) go over the
#: peer socket (``hwr.daemon.peer.publication_frames``): one round trip to stage, with the staging
#: descriptors in the reply, and one to commit, instead of two gRPC calls plus a descriptor fetch.
#: Larger ones use the RPCs: their commit hashes and fsyncs for longer than a peer exchange should
#: hold up this client's other peer operations (leases), and their request may not fit a frame.
PEER_MAX_BYTES = 64 << 20
PEER_MAX_TENSORS = 2048
#: The longest a peer ``publish_begin`` waits (another publisher of the identity building, or
#: room in the store): it holds up this client's other peer operations meanwhile. A longer
#: ``wait_timeout`` continues through the RPC.
PEER_MAX_WAIT_S = 2.0


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
        peer: Callable[..., tuple[dict[str, Any], list[int]]] | None = None,
        peer_may_wait: Callable[[], bool] = lambda: True,
        channel: str | None = None,
        durable: bool = True,
        hand_over: Callable[[str, str, int], None] | None = None,
        reuse: Mapping[str, str] | None = None,
        reuse_base: str | None = None,
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
        total = sum(math.prod(s.shape) * s.dtype.itemsize for s in specs)
        self._peer = peer if peer is not None and total <= PEER_MAX_BYTES and len(specs) <= PEER_MAX_TENSORS \
            else None
        self._written: set[str] = set()
        self._digests: dict[str, str] = {}
        self._verify = verify
        self._channel = check_channel_name(channel) if channel is not None else None
        self._durable = durable
        # A large update (a channel's revision, or non-durable) is laid out in several files that
        # are handed over as soon as they are written, so hwrd hashes them while the rest is
        # written (``hwr.daemon.store.prehash``).
        self._hand_over = hand_over if (channel is not None or not durable) and total > PEER_MAX_BYTES else None
        self._token = ""
        # Tensors equal to ``reuse_base``'s, with the base's digests (for ``verify``): hwrd takes
        # them from the base; the reply says which it does (``reused``: not to be written).
        self._reuse = dict(reuse or {}) if reuse_base else {}
        self._reuse_base = reuse_base if self._reuse else None
        self.reused: frozenset[str] = frozenset()
        started = time.monotonic()
        peer_wait = min(wait_timeout, PEER_MAX_WAIT_S, call_timeout / 4) if peer_may_wait() else 0.0
        begun = self._begin_peer(identity, specs, format_metadata, peer_wait) if self._peer is not None else None
        if begun is not None and begun[0] == "busy":
            remaining = wait_timeout - (time.monotonic() - started)
            if remaining <= 0:
                raise begun[1]
            begun = None  # wait out the rest through the RPC, which may hold the call that long
        if begun is None:
            begun = self._begin_rpc(identity, specs, max(0.0, wait_timeout - (time.monotonic() - started)),
                                    format_metadata, staging_fds)
        self.outcome, self.key, self._publication_id, self._placements, self._fds = begun  # type: ignore[misc]
        self._done = not self.staged
        self.joined = self.outcome == "joined"
        if self._verify:
            self._digests.update({n: d for n, d in self._reuse.items() if n in self.reused})
        # Tensors not yet written, per file: a file is handed over when its set empties (one
        # whose tensors are all reused at once: hwrd copies them from the base meanwhile).
        self._unwritten: dict[int, set[str]] = {}
        if self._hand_over is not None and len(self._fds) > 1:
            for placement in self._placements.values():
                self._unwritten.setdefault(placement.file_index, set())
                if placement.name not in self.reused:
                    self._unwritten[placement.file_index].add(placement.name)
            try:
                for index in [i for i, names in self._unwritten.items() if not names]:
                    self._file_written(index)
            except BaseException:
                self.abort()
                raise

    def write_order(self, names: Iterable[str]) -> list[str]:
        """``names`` in the order of their places in the staging files (file by file): writing in
        this order hands each file over as early as possible."""
        def place(name: str) -> tuple[int, int]:
            p = self._placements.get(name)
            return (p.file_index, p.offset) if p is not None else (-1, 0)

        return sorted(names, key=place)

    def _begin_peer(self, identity: ArtifactIdentity, specs: Sequence[TensorSpec],
                    format_metadata: Mapping[str, Any] | None, wait: float) -> tuple[Any, ...]:
        """``publish_begin`` waiting at most ``wait`` seconds (for another publisher of this
        identity, or for room in the store): ("busy", error) when that was not enough (the caller
        waits out the rest through the RPC), else the begin result."""
        assert self._peer is not None
        request: dict[str, Any] = {
            "op": "publish_begin", "identity": identity.canonical_bytes.decode(),
            "tensors": [s.to_wire() for s in specs], "wait_timeout_ms": int(wait * 1000)}
        if self._channel is not None:
            request["channel"] = self._channel
        if not self._durable:
            request["durable"] = False
        if self._hand_over is not None:
            request["overlap"] = True
        if self._reuse_base is not None:
            request["reuse"] = {"base": self._reuse_base, "tensors": sorted(self._reuse)}
        if format_metadata:
            request["format_metadata"] = canonical_json(dict(format_metadata)).decode()
        try:
            reply, fds = self._peer(request)
        except ExceedsFilesystem:
            raise  # can never fit: no wait helps
        except (ActiveBuildTimeout, StoreLimitExceeded, InsufficientCapacity) as exc:
            return "busy", exc
        outcome = str(reply.get("outcome"))
        try:
            if outcome != "staged":
                return outcome, str(reply["key"]), "", {}, _checked_fds(fds, 0)
            placements = {str(n): _Placement(str(n), int(i), int(o), int(b)) for n, i, o, b in reply["placements"]}
            self._token = str(reply["publication_token"])
            self.reused = frozenset(str(n) for n in reply.get("reused", ()))
            return (outcome, str(reply["key"]), str(reply["publication_id"]), placements,
                    _checked_fds(fds, len(reply["files"])))
        except (KeyError, TypeError, ValueError):
            close_fds(fds)
            raise PublicationFailed("malformed publish_begin reply from hwrd") from None

    def _begin_rpc(self, identity: ArtifactIdentity, specs: Sequence[TensorSpec], wait_timeout: float,
                   format_metadata: Mapping[str, Any] | None,
                   staging_fds: Callable[[str, str], list[int]]) -> tuple[Any, ...]:
        request = pb.BeginPublicationRequest(
            identity_json=identity.canonical_bytes, tensors=[s.to_proto() for s in specs],
            wait_timeout_ms=int(wait_timeout * 1000),
            format_metadata_json=canonical_json(dict(format_metadata)) if format_metadata else b"",
            channel=self._channel or "", non_durable=not self._durable,
            overlap_hashing=self._hand_over is not None, reuse_base=self._reuse_base or "",
            reuse_tensors=sorted(self._reuse) if self._reuse_base else [])
        # The daemon may rightly hold this call for the whole wait (another publisher is building).
        response = self._call("BeginPublication", request, self._call_timeout + wait_timeout)
        outcome = {pb.BEGIN_OUTCOME_STAGED: "staged", pb.BEGIN_OUTCOME_JOINED: "joined",
                   pb.BEGIN_OUTCOME_ALREADY_PRESENT: "already_present"}.get(response.outcome, "unknown")
        placements = {p.name: _Placement(p.name, p.file_index, p.offset, p.nbytes) for p in response.placements}
        fds: list[int] = []
        if outcome == "staged":
            self._publication_id, self._done = response.publication_id, False
            self._token = response.publication_token
            self.reused = frozenset(response.reused)
            try:
                fds = staging_fds(response.publication_id, response.publication_token)
            except BaseException:
                self.abort()
                raise
        return outcome, response.key, response.publication_id, placements, fds

    @property
    def staged(self) -> bool:
        return self.outcome == "staged"

    @property
    def finished(self) -> bool:
        """Committed, aborted, or never staged (joined / already present)."""
        return self._done

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Copy one tensor's bytes to its place in the staging file (once per tensor; a tensor
        hwrd takes from the base, ``reused``, is not written: the call returns at once)."""
        if self._done:
            raise PublicationFailed("the publication is finished or not staged")
        if name in self.reused:
            return
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
        if self._durable:
            # The daemon fsyncs at commit; starting writeback now overlaps the disk with our
            # writing. A non-durable publication is never fsynced: the disk has no reason to
            # wait on it (the call may block while the device queue is full).
            start_writeback(fd, placement.offset, data.nbytes)
        if digest is not None:
            self._digests[name] = digest.hexdigest()
        self._written.add(name)
        pending = self._unwritten.get(placement.file_index)
        if pending is not None:
            pending.discard(name)
            if not pending:  # the file is complete: close it and hand it over to be hashed now
                self._file_written(placement.file_index)

    def _file_written(self, index: int) -> None:
        del self._unwritten[index]
        self._fds[index], closing = -1, self._fds[index]
        os.close(closing)
        assert self._hand_over is not None
        self._hand_over(self._publication_id, self._token, index)

    def commit(self) -> str:
        """Close the staging descriptors and ask the daemon to commit; returns the key."""
        if self._done:
            return self.key
        missing = sorted(set(self._specs) - self._written - self.reused)
        if missing:
            raise InvalidRequest(f"{len(missing)} tensors were not written", details={"first": missing[0]})
        self._close_fds()
        # Commit hashes and fsyncs every byte: its deadline grows with the artifact's size.
        nbytes = sum(p.nbytes for p in self._placements.values())
        try:
            if self._peer is not None:
                # A peer exchange that times out ends the session (and with it this client's
                # leases, until it reconnects): give the commit the RPC's deadline plus room to
                # queue behind other commits in the daemon.
                reply, _fds = self._peer({"op": "publish_commit", "publication_id": self._publication_id,
                                          "expected_sha256": self._digests},
                                         4 * self._call_timeout + nbytes / _COMMIT_BYTES_PER_S)
                key, joined = str(reply.get("key")), bool(reply.get("joined"))
            else:
                response = self._call("CommitPublication", pb.CommitPublicationRequest(
                    publication_id=self._publication_id, expected_sha256=self._digests),
                    self._call_timeout + nbytes / _COMMIT_BYTES_PER_S)
                key, joined = response.key, response.joined
        except BaseException:
            self.abort()
            raise
        self._done = True
        self.joined = joined
        return key

    def abort(self) -> None:
        """Abandon the publication; idempotent, never raises for a finished one."""
        self._close_fds()
        if self._done:
            return
        self._done = True
        with contextlib.suppress(Exception):
            if self._peer is not None:
                self._peer({"op": "publish_abort", "publication_id": self._publication_id})
            else:
                self._call("AbortPublication", pb.AbortPublicationRequest(publication_id=self._publication_id))

    def abandon(self) -> None:
        """Close the staging descriptors without telling the daemon (the client's session has
        ended, which aborts the publication there); a later ``commit`` fails."""
        self._close_fds()

    def _close_fds(self) -> None:
        fds, self._fds = self._fds, []
        close_fds([fd for fd in fds if fd >= 0])  # -1: a file already handed over

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
