"""The producer process: ``python -m hwr.daemon.producers.worker`` (started by ``runner``).

Protocol: the job is one JSON object on stdin::

    {"producer": NAME, "options": {...}, "rank": R, "throttle_s": 0.0,
     "sources": [{"fd": N, "fingerprint": [size, dev, inode, mtime_ns, ctime_ns]}, ...],
     "outputs": {"<tensor>": [fd, absolute offset, nbytes], ...}}

The descriptors were opened and verified by the daemon and passed to this process (source
files read-only, staging payloads read-write). Events go to stdout, one JSON object per line:
``{"event": "progress", "done": B, "total": B, "tensor": NAME}`` (at most ~10 per second), then
``{"event": "done", "peak_rss_bytes": VmHWM, ...}`` and exit 0, or ``{"event": "error", "code",
"message"}`` and exit 1. Nothing else is written to stdout. The process never publishes: the
daemon commits the staging only after a clean exit, and discards it otherwise.

``throttle_s`` (a test-only knob, from hwrd's ``producer_throttle_s``) sleeps after each block so
tests can cancel or time out a build in flight.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from hwr.client.errors import CheckpointModified, HwrError, InvalidRequest
from hwr.client.safetensors_header import read_header
from hwr.daemon.producers import make_producer
from hwr.daemon.producers.base import SourceReader, SourceTensor, TensorSink

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

    sink = _Sink(placements)  # type: ignore[arg-type]
    for output in outputs:
        current[0] = output.name
        producer.produce(output, reader, sink, rank)
    for src in sources:
        if _fingerprint(src["fd"]) != list(src["fingerprint"]):
            raise CheckpointModified("a checkpoint file changed during the build")
    _emit(out, {"event": "progress", "done": sink.bytes_written, "total": total, "tensor": ""})
    return {"event": "done", "bytes_read": reader.bytes_read, "bytes_written": sink.bytes_written,
            "peak_rss_bytes": peak_rss_bytes()}


def main() -> int:
    out = sys.stdout
    # Keep stdout for events only: anything a library prints goes to stderr.
    sys.stdout = sys.stderr
    try:
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
