"""The gRPC relay's first-bytes timeout (``grpc_first_bytes_timeout_s``), in-process: a connection
whose client sends nothing is closed once the configured time has passed, never before, and one
whose client speaks in time is spliced to gRPC's private socket (here an echo server standing in
for it). The attack that holds hundreds of such connections against a real hwrd is in
``tests/faults/test_hostile_sessions_relay.py``."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import msgspec
import pytest

from hwr.daemon.system.activation import GrpcRelay
from hwr.daemon.system.config import DaemonConfig

TIMEOUT_S = 0.5


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(1 << 16):
        writer.write(data)
        await writer.drain()
    writer.close()


async def _relay_session(root: Path) -> tuple[float, bytes]:
    """Seconds until the relay closes a silent connection, and what a speaking one got back."""
    target = root / "hwrd.sock.grpc"
    echo = await asyncio.start_unix_server(_echo, path=str(target))
    listen = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listen.bind(str(root / "hwrd.sock"))
    listen.listen(16)
    relay = GrpcRelay(listen, target, first_bytes_timeout_s=TIMEOUT_S)
    await relay.start()
    try:
        silent_r, silent_w = await asyncio.open_unix_connection(str(root / "hwrd.sock"))
        speaking_r, speaking_w = await asyncio.open_unix_connection(str(root / "hwrd.sock"))
        began = time.monotonic()
        speaking_w.write(b"preface")
        echoed = await asyncio.wait_for(speaking_r.readexactly(len(b"preface")), 10)
        assert await asyncio.wait_for(silent_r.read(1), 10) == b""  # closed by the relay
        closed_after = time.monotonic() - began
        # the speaking connection outlived the timeout: still spliced, still echoed
        speaking_w.write(b"later")
        echoed += await asyncio.wait_for(speaking_r.readexactly(len(b"later")), 10)
        for writer in (silent_w, speaking_w):
            writer.close()
        return closed_after, echoed
    finally:
        await relay.close()
        echo.close()
        await echo.wait_closed()


@pytest.mark.timeout(60)
def test_a_silent_connection_is_closed_after_the_configured_time_and_a_speaking_one_is_spliced(
        short_tmp: Path) -> None:
    # the config key's default is what hwrd.toml and the README say: 10 s
    default = next(f.default for f in msgspec.structs.fields(DaemonConfig) if f.name == "grpc_first_bytes_timeout_s")
    assert default == 10.0
    closed_after, echoed = asyncio.run(_relay_session(short_tmp))
    assert TIMEOUT_S * 0.9 <= closed_after < TIMEOUT_S + 5, closed_after
    assert echoed == b"prefacelater"
