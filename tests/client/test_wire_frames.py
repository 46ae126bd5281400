"""The peer socket's one frame codec (``hwr.client.wire``), as the client and hwrd use it:
frames and descriptors cross a real socket pair, hwrd's buffer parser reads what the client
encodes, and an error frame turns back into the same typed error."""

from __future__ import annotations

import errno
import os
import socket

import pytest

from hwr.client.errors import HwrError, InvalidRequest, error_from_code
from hwr.client.wire import (
    MAX_FDS,
    MAX_FRAME,
    STATUS_BY_CODE,
    close_fds,
    encode_frame,
    error_frame,
    error_from_frame,
    recv_frame,
    recv_reply,
    send_frame,
    take_frame,
)
from hwr.daemon.peer.server import _failure_frame


def _pipes(n: int) -> list[int]:
    fds: list[int] = []
    for _ in range(n // 2):
        fds.extend(os.pipe())
    return fds


@pytest.mark.timeout(30)
@pytest.mark.parametrize("receive", ["recv_frame", "recv_reply"])
def test_more_descriptors_than_64_cross_in_one_reply(receive: str) -> None:
    sent = _pipes(100)
    a, b = socket.socketpair()
    try:
        send_frame(a, {"ok": True, "count": len(sent)}, sent)
        if receive == "recv_frame":
            reply, got = recv_frame(b, want_fds=True)
        else:
            reply, got, _tail = recv_reply(b, want_fds=True)
        try:
            assert reply == {"ok": True, "count": 100}
            assert len(got) == 100 <= MAX_FDS
            assert len({os.fstat(fd).st_ino for fd in got}) == 50  # 50 pipes, both ends of each
        finally:
            close_fds(got)
    finally:
        close_fds(sent)
        a.close()
        b.close()


@pytest.mark.timeout(30)
def test_a_reply_and_its_tail_cross_and_recv_frame_leaves_the_tail() -> None:
    a, b = socket.socketpair()
    with a, b:
        tail = b'{"manifest": true}' * 1000
        a.sendall(encode_frame({"ok": True, "manifest_bytes": len(tail)}, tail))
        reply, fds, got = recv_reply(b, want_fds=False)
        assert (reply["manifest_bytes"], fds, got) == (len(tail), [], tail)
        a.sendall(encode_frame({"ok": True, "manifest_bytes": 3}, b"abc") + encode_frame({"ok": True}))
        assert recv_frame(b)[0] == {"ok": True, "manifest_bytes": 3}
        assert b.recv(3, socket.MSG_WAITALL) == b"abc"
        assert recv_frame(b)[0] == {"ok": True}


def test_hwrd_parses_what_the_client_encodes_byte_by_byte() -> None:
    requests = [{"op": "acquire", "key": "ab" * 32, "have": "cd" * 32}, {"op": "ping"},
                {"op": "hello", "client_name": "naïve", "client_version": "1", "big": 1 << 70}]
    stream = b"".join(encode_frame(r) for r in requests)
    buf = bytearray()
    parsed = []
    for i in range(len(stream)):
        buf += stream[i:i + 1]
        frame = take_frame(buf)
        if frame is not None:
            parsed.append(frame)
    assert parsed == requests and buf == bytearray()


def test_one_frame_limit_for_both_sides() -> None:
    with pytest.raises(InvalidRequest):
        encode_frame({"x": "y" * MAX_FRAME})
    over = bytearray((MAX_FRAME + 1).to_bytes(4, "big"))
    with pytest.raises(ConnectionError):
        take_frame(over)
    at = bytearray(MAX_FRAME.to_bytes(4, "big"))
    assert take_frame(at) is None  # a frame of exactly MAX_FRAME is legal, just incomplete
    for body in (b"[1]", b"{", b'"x"'):
        with pytest.raises(ConnectionError):
            take_frame(bytearray(len(body).to_bytes(4, "big") + body))


@pytest.mark.parametrize("code", sorted(STATUS_BY_CODE))
def test_every_typed_error_crosses_as_a_frame_unchanged(code: str) -> None:
    sent = error_from_code(code, f"message of {code}", {"field": "x", "limit": 3})
    frame = take_frame(bytearray(encode_frame(error_frame(sent))))
    assert frame is not None and frame["ok"] is False
    got = error_from_frame(frame)
    assert (type(got), got.code, got.message, got.details) == (type(sent), code, sent.message, sent.details)


def test_hwrd_turns_every_failure_into_one_kind_of_error_frame() -> None:
    typed = error_from_frame(_failure_frame("acquire", InvalidRequest("bad key", details={"field": "key"})))
    assert isinstance(typed, InvalidRequest) and typed.details == {"field": "key"}
    emfile = error_from_frame(_failure_frame("fds", OSError(errno.EMFILE, "Too many open files")))
    assert type(emfile) is HwrError and emfile.details["errno"] == "EMFILE"
    assert "Too many open files" in emfile.message
    bug = error_from_frame(_failure_frame(["not", "a", "name"] * 20, KeyError("x")))
    assert type(bug) is HwrError and "internal error" in bug.message and len(bug.message) < 100
