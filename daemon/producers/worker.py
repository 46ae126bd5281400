"""The producer process: ``python -m hwr.daemon.producers.worker`` (started by ``runner``).

Protocol: the job is one JSON object on stdin (or, for a spare started ahead of time with
``--spare FD IDLE_S``, on the Unix socket FD: 8 bytes little-endian length, then the JSON, with
the descriptors attached by ``SCM_RIGHTS`` and ``fd_map`` naming, in order, the daemon-side
numbers the JSON uses for them)::

    {"producer": NAME, "options": {...}, "rank": R, "throttle_s": 0.0,
     "sources": [{"fd": N, "fingerprint": [size, dev, inode, mtime_ns, ctime_ns]}, ...],
     "outputs": {"<tensor>": [fd, absolute offset, nbytes], ...},
     "files": [[fd, payload file name, size], ...]}

The descriptors were opened and verified by the daemon and passed to this process (source
files read-only, staging payloads read-write). Events go to stdout, one JSON object per line:
``{"event": "progress", "done": B, "total": B, "tensor": NAME}`` (at most ~10 per second), then
``{"event": "done", "peak_rss_bytes": VmHWM, "digests": {"files": {NAME: SHA256},
"tensors": {NAME: SHA256}}, ...}`` and exit 0 (``digests``: computed while writing, see
``digests.py``; absent when ``files`` was not given or the writes were not in order), or ``{"event": "error", "code",
"message"}`` and exit 1. Nothing else is written to stdout. The process never publishes: the
daemon commits the staging only after a clean exit, and discards it otherwise.

``throttle_s`` (a test-only knob, from hwrd's ``producer_throttle_s``) sleeps after each block so
tests can cancel or time out a build in flight.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import sys
import time
from typing import Any

from hwr.client.errors import CheckpointModified, HwrError, InvalidRequest
from hwr.client.safetensors_header import read_header
from hwr.daemon.producers import make_producer
from hwr.daemon.producers.base import SourceTensor
from hwr.daemon.producers.blocks import SourceReader, TensorSink
from hwr.daemon.producers.digests import StreamDigests

__all__ = ["main", "peak_rss_bytes"]


def peak_rss_bytes(pid: str = "self") -> int:
    """VmHWM (peak resident set size) of a process, from /proc."""
    with open(f"/proc/{pid}/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _emit(out: Any, event: dict[str, Any]) -> None:
    out.write(json.dumps(event, separators=(",", ":")) + "\n")
    out.flush()


def _fingerprint(fd: int) -> list[int]:
    st = os.fstat(fd)
    return [st.st_size, st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns]


def run(job: dict[str, Any], out: Any) -> dict[str, Any]:
    started = time.monotonic()
    producer = make_producer(str(job["producer"]), job.get("options") or {})
    rank = int(job.get("rank", 0))
    throttle = float(job.get("throttle_s") or 0.0)
    sources = job["sources"]
    for src in sources:
        if _fingerprint(src["fd"]) != list(src["fingerprint"]):
            raise CheckpointModified("a checkpoint file changed before the build started")
    headers = [read_header(src["fd"], require_alignment=False) for src in sources]
    tensors = [SourceTensor(e.name, e.dtype, e.shape) for h in headers for e in h.entries]
    outputs = producer.plan(tensors, rank)
    placements = {name: tuple(v) for name, v in job["outputs"].items()}
    if {o.name for o in outputs} != set(placements) or any(o.nbytes != placements[o.name][2] for o in outputs):
        raise InvalidRequest("the worker's plan differs from the daemon's staging plan")
    reader = SourceReader([src["fd"] for src in sources], headers)
    total = sum(o.nbytes for o in outputs)
    # Placement order (file, offset): each file's digest is fed in byte order (digests.py).
    outputs.sort(key=lambda o: (placements[o.name][0], placements[o.name][1]))
    digests = StreamDigests([(int(fd), str(name), int(size)) for fd, name, size in job.get("files") or ()],
                            placements)  # type: ignore[arg-type]
    last = [0.0]
    current = [""]

    class _Sink(TensorSink):
        def write(self, name: str, byte_offset: int, tensor: Any) -> None:
            super().write(name, byte_offset, tensor)
            if throttle:
                time.sleep(throttle)
            now = time.monotonic()
            if now - last[0] >= 0.1:
                last[0] = now
                _emit(out, {"event": "progress", "done": self.bytes_written, "total": total,
                            "tensor": current[0]})

    sink = _Sink(placements, digests.wrote if job.get("files") else None)  # type: ignore[arg-type]
    try:
        for output in outputs:
            current[0] = output.name
            producer.produce(output, reader, sink, rank)
        reported = digests.finish() if job.get("files") else None
    finally:
        digests.close()
    for src in sources:
        if _fingerprint(src["fd"]) != list(src["fingerprint"]):
            raise CheckpointModified("a checkpoint file changed during the build")
    _emit(out, {"event": "progress", "done": sink.bytes_written, "total": total, "tensor": ""})
    done = {"event": "done", "bytes_read": reader.bytes_read, "bytes_written": sink.bytes_written,
            "peak_rss_bytes": peak_rss_bytes(), "seconds": round(time.monotonic() - started, 3)}
    if reported is not None:
        done["digests"] = reported
    return done


def _receive_job(fd: int, idle_s: float) -> dict[str, Any] | None:
    """A spare's job: a length-prefixed JSON document, the descriptors on its first bytes (see
    ``runner``); None when the daemon closed the socket or nothing came within ``idle_s``."""
    sock = socket.socket(fileno=fd)
    sock.settimeout(idle_s)
    try:
        head, fds, _flags, _addr = socket.recv_fds(sock, 8, 1024, socket.MSG_CMSG_CLOEXEC)
    except (TimeoutError, OSError):
        return None
    finally:
        sock.settimeout(None)
    if len(head) < 8:
        for received in fds:
            os.close(received)
        return None
    head += _recv_exact(sock, 8 - len(head))
    job = json.loads(_recv_exact(sock, struct.unpack("<Q", head)[0]))
    sock.close()
    mapping = dict(zip(job.pop("fd_map"), fds, strict=True))
    for src in job["sources"]:
        src["fd"] = mapping[src["fd"]]
    job["outputs"] = {name: [mapping[v[0]], v[1], v[2]] for name, v in job["outputs"].items()}
    job["files"] = [[mapping[f[0]], f[1], f[2]] for f in job.get("files") or ()]
    return job


def _recv_exact(sock: socket.socket, nbytes: int) -> bytes:
    parts = []
    while nbytes > 0:
        chunk = sock.recv(min(nbytes, 1 << 20))
        if not chunk:
            raise OSError("the daemon closed the job socket mid-job")
        parts.append(chunk)
        nbytes -= len(chunk)
    return b"".join(parts)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    out = sys.stdout
    # Keep stdout for events only: anything a library prints goes to stderr.
    sys.stdout = sys.stderr
    try:
        if argv[:1] == ["--spare"]:  # started ahead of time: wait for a job (runner.ensure_spare)
            spare_job = _receive_job(int(argv[1]), float(argv[2]))
            if spare_job is None:
                return 0  # idle or the daemon went away: exit quietly, nothing to report
            job = spare_job
        else:
            job = json.loads(sys.stdin.buffer.read(16 << 20))
        _emit(out, run(job, out))
        return 0
    except HwrError as exc:
        _emit(out, {"event": "error", "code": exc.code, "message": exc.message})
    except Exception as exc:  # reported, never a traceback on the wire
        _emit(out, {"event": "error", "code": "PRODUCER_FAILED", "message": f"{type(exc).__name__}: {exc}"[:2000]})
    return 1


if __name__ == "__main__":
    sys.exit(main())
