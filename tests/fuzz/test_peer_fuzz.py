"""Fuzzing the peer socket's frames (``hwr.daemon.peer.server``): random ops and field values, and raw
byte soup, sent to a live hwrd.

Every well-formed frame (a JSON object) must be answered by exactly one frame: ``ok: true`` or a
typed error (a code from ``hwr.client.wire.STATUS_BY_CODE``, never the internal-error code) with a
message and a details object, on a connection that stays usable. Bytes that are not a frame may
end that connection, never the daemon. Afterwards no lease of a fuzzing session is left, nothing
is staged, and the log holds no traceback.

Quick size (CI): 150 frames, 30 byte strings. Long size::

    HWR_FUZZ_EXAMPLES=15000 .venv/bin/python -m pytest tests/fuzz/test_peer_fuzz.py -q
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from daemon_proc import finish_daemon
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hwr.client import ArtifactIdentity, connect
from hwr.client.wire import STATUS_BY_CODE, recv_frame, send_frame
from hwr.daemon.app.launcher import DaemonProcess

from .fuzzkit import checked

EXAMPLES = max(1, int(os.environ.get("HWR_FUZZ_EXAMPLES", "150")))
OPS = ["acquire", "release", "hello", "fds", "staging_fds", "ping", "publish_begin", "publish_commit",
       "publish_abort", "", "ACQUIRE", None, 7]
FIELDS = ["op", "key", "identity", "have", "lease_id", "lease_token", "client_name", "client_version",
          "publication_id", "publication_token", "count", "manifest_bytes", "tensors", "wait_timeout_ms",
          "format_metadata", "expected_sha256"]


@pytest.fixture(scope="module")
def peer_target() -> Iterator[tuple[DaemonProcess, Any, str, str]]:
    with tempfile.TemporaryDirectory(prefix="hwrp-") as d:
        os.chmod(d, 0o700)
        daemon = DaemonProcess(Path(d) / "store", Path(d) / "hwrd.sock").start(timeout=60)
        try:
            owner = connect(daemon.socket)
            identity = ArtifactIdentity.simple("peer-fuzz-target")
            key = owner.publish(identity, {"w": torch.arange(16.0)})
            foreign = owner.acquire(key)  # a lease of another session: releasing it must be refused
            yield daemon, owner, key, foreign.lease_id
            foreign.close()
            owner.close()
        finally:
            finish_daemon(daemon)


def _values(key: str, lease_id: str) -> st.SearchStrategy[Any]:
    hostile = ["", "\x00", "../../etc/passwd", "0" * 64, key, key.upper(), key[:8], lease_id, "x" * 5000,
               ArtifactIdentity.simple("peer-fuzz-target").canonical_bytes.decode(), '{"a":1}', "{",
               "\ud7ff", "é" * 100, [["w", "F32", [4], "parameter", "weight"]], [["w", "F32", [1 << 39]]]]
    scalars = st.one_of(st.sampled_from(hostile), st.text(max_size=80), st.integers(-(1 << 70), 1 << 70),
                        st.floats(allow_nan=True), st.booleans(), st.none())
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                        | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=6)


def _frames(key: str, lease_id: str) -> st.SearchStrategy[dict[str, Any]]:
    values = _values(key, lease_id)
    return st.builds(lambda op, extra: {"op": op, **extra} if op is not None else extra,
                     st.sampled_from(OPS), st.dictionaries(st.sampled_from(FIELDS[1:]), values, max_size=4))


def _open(daemon: DaemonProcess) -> socket.socket:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(20)
    conn.connect(f"{daemon.socket}.peer")
    assert recv_frame(conn)[0]["ok"] is True
    return conn


def _close_fds(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def test_every_peer_frame_gets_one_answer_ok_or_typed(peer_target) -> None:
    daemon, _owner, key, lease_id = peer_target
    conn = _open(daemon)
    codes: set[str] = set()

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
    @given(_frames(key, lease_id))
    def run(frame: dict[str, Any]) -> None:
        with checked("peer frame"):
            send_frame(conn, frame)
            reply, fds = recv_frame(conn, want_fds=True)
            try:
                if reply.get("ok") is True:
                    codes.add("OK")
                    tail = reply.get("manifest_bytes", 0)
                    if tail:
                        assert len(conn.recv(tail, socket.MSG_WAITALL)) == tail
                    assert len(fds) == reply.get("count", 0), (frame, reply)
                    if frame.get("op") == "acquire":  # undo it so every example starts alike
                        send_frame(conn, {"op": "release", "lease_id": reply["lease_id"]})
                        assert recv_frame(conn)[0] == {"ok": True, "released": True}
                    return
                assert reply.get("ok") is False and fds == [], (frame, reply)
                assert reply["code"] in STATUS_BY_CODE, (frame, reply)  # typed, never "internal error"
                assert isinstance(reply["message"], str) and reply["message"], (frame, reply)
                assert isinstance(reply["details"], dict), (frame, reply)
                codes.add(reply["code"])
            finally:
                _close_fds(fds)

    run()
    send_frame(conn, {"op": "ping"})
    assert recv_frame(conn)[0] == {"ok": True}
    conn.close()
    assert "INVALID_ARGUMENT" in codes and "PERMISSION_DENIED" in codes, codes


def test_byte_soup_ends_at_most_its_own_connection(peer_target) -> None:
    daemon, owner, key, _lease_id = peer_target

    def soup(data: bytes) -> None:
        """Send ``data`` and read until the daemon closes; then the daemon must still answer."""
        with checked("peer byte soup"):
            with _open(daemon) as conn:
                conn.sendall(data)
                conn.shutdown(socket.SHUT_WR)
                with contextlib.suppress(ConnectionResetError):
                    while conn.recv(65536):  # answers (or nothing) until the daemon closes
                        pass
            with _open(daemon) as conn:  # only that connection ended: a fresh one is served
                send_frame(conn, {"op": "ping"})
                assert recv_frame(conn)[0] == {"ok": True}, data[:80]

    @settings(max_examples=max(1, EXAMPLES // 5), deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.one_of(st.binary(max_size=64),
                     st.builds(lambda n, body: struct.pack(">I", n) + body,
                               st.integers(0, (1 << 32) - 1), st.binary(max_size=40))))
    def run(data: bytes) -> None:
        soup(data)

    run()
    for body in (b"[" * 100_000, b'{"op":' + b"[" * 5000 + b"]" * 5000 + b"}", b'{"op":NaN}', b'{"op":1e999}'):
        soup(struct.pack(">I", len(body)) + body)  # too deep for any decoder, or JSON only Python's json takes
    with owner.acquire(key) as lease:  # the daemon still serves
        assert float(lease.tensors["w"][3]) == 3.0


def test_after_the_peer_fuzzing_nothing_leaked(peer_target) -> None:
    daemon, owner, _key, lease_id = peer_target
    leases = owner.leases()
    assert [x["lease_id"] for x in leases] == [lease_id], leases  # only the owner's own lease
    assert owner.status()["publications"] == 0
    assert os.listdir(Path(daemon.root) / "tmp") == []
    log = daemon.log.read_text(errors="replace")
    assert "Traceback" not in log and "internal error" not in log, log[-3000:]
