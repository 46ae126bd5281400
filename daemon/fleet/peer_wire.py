"""Framing and membership proofs shared by hwrd's peer tier and its NIXL transfer process.

Frames: a 4-byte big-endian length, then that many bytes of a JSON object (at most
``MAX_FRAME`` bytes: a peer or a broken transfer process cannot make hwrd buffer more). The same
framing runs on the peer control connections (TCP, between the nodes of a fleet) and on the
pipe between hwrd and its transfer process (``hwr.daemon.fleet.peer_agent``).

Membership: every node of a fleet reads the same secret from the file its ``fleet_peer_secret_file``
names. A control connection opens with a challenge from the serving node; the asking node answers
with ``HMAC-SHA256(secret, "hwr-peer-ask" | challenge | its nonce | its node id)`` and the server
proves itself back with ``HMAC-SHA256(secret, "hwr-peer-serve" | nonce | challenge)``. Nothing
else is set up (no NIXL metadata exchanged, no memory exposed) before both proofs check out. The
secret never crosses the wire; a recorded exchange cannot be replayed (fresh nonces both ways).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import os
import stat
import struct
from typing import Any

from hwr.client.errors import ConfigError

__all__ = ["MAX_FRAME", "FrameError", "ask_proof", "load_secret", "read_frame", "serve_proof", "write_frame"]

MAX_FRAME = 1 << 20
#: The shortest secret accepted (bytes in the file, surrounding whitespace stripped).
MIN_SECRET_BYTES = 16
_LENGTH = struct.Struct(">I")


class FrameError(Exception):
    """A frame that is too long or not a JSON object (the connection is closed)."""


def encode(message: dict[str, Any]) -> bytes:
    body = json.dumps(message, separators=(",", ":")).encode()
    if len(body) > MAX_FRAME:
        raise FrameError(f"frame of {len(body)} bytes exceeds {MAX_FRAME}")
    return _LENGTH.pack(len(body)) + body


def decode(body: bytes) -> dict[str, Any]:
    try:
        message = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise FrameError(f"frame is not JSON ({exc})") from None
    if not isinstance(message, dict):
        raise FrameError("frame is not a JSON object")
    return message


async def read_frame(reader: asyncio.StreamReader) -> dict[str, Any]:
    """The next frame; ``asyncio.IncompleteReadError`` at end of stream, ``FrameError`` when bad."""
    (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    if length > MAX_FRAME:
        raise FrameError(f"frame of {length} bytes exceeds {MAX_FRAME}")
    return decode(await reader.readexactly(length))


async def write_frame(writer: asyncio.StreamWriter, message: dict[str, Any]) -> None:
    writer.write(encode(message))
    await writer.drain()


def load_secret(path: str) -> bytes:
    """The fleet secret from ``path``: a regular file, not readable by others, >= 16 bytes."""
    details = {"key": "fleet_peer_secret_file", "path": path}
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(f"fleet_peer_secret_file {path} cannot be opened: {exc.strerror}", details=details) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"fleet_peer_secret_file {path} is not a regular file", details=details)
        if st.st_mode & 0o007:
            raise ConfigError(f"fleet_peer_secret_file {path} is readable by others (mode "
                              f"{stat.S_IMODE(st.st_mode):o}): chmod o-rwx it", details=details)
        data = os.read(fd, 4096).strip()
    finally:
        os.close(fd)
    if len(data) < MIN_SECRET_BYTES:
        raise ConfigError(f"fleet_peer_secret_file {path} holds {len(data)} bytes; at least "
                          f"{MIN_SECRET_BYTES} are needed (e.g. `head -c 32 /dev/urandom | base64`)", details=details)
    return data


def ask_proof(secret: bytes, challenge: str, nonce: str, node: str) -> str:
    return hmac.new(secret, b"|".join([b"hwr-peer-ask", challenge.encode(), nonce.encode(), node.encode()]),
                    hashlib.sha256).hexdigest()


def serve_proof(secret: bytes, challenge: str, nonce: str) -> str:
    return hmac.new(secret, b"|".join([b"hwr-peer-serve", nonce.encode(), challenge.encode()]),
                    hashlib.sha256).hexdigest()


def same(a: object, b: str) -> bool:
    """Constant-time comparison of a received proof with the expected one."""
    return isinstance(a, str) and hmac.compare_digest(a.encode(), b.encode())
