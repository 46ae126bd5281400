"""Socket activation: listening sockets inherited from systemd (``LISTEN_FDS``), and the relay
that lets gRPC serve on one of them.

Protocol (``sd_listen_fds(3)``): when ``$LISTEN_PID`` equals our pid, descriptors
``3 .. 3 + $LISTEN_FDS - 1`` are listening sockets, optionally named by ``$LISTEN_FDNAMES``
(colon-separated). ``inherited_sockets()`` takes them over (close-on-exec, and the three
variables are removed from ``os.environ`` so children do not inherit them), and
``assign(sockets, grpc_path, peer_path)`` decides which one serves which channel:

=================================  ========================================================
an inherited socket bound to ...   serves
=================================  ========================================================
``<socket>`` or named ``grpc``     gRPC, through ``GrpcRelay`` (below; hwrd's own socket too)
``<socket>.peer`` or named ``peer`` the peer socket, accepted directly by ``PeerServer``
anything else                      nothing: logged and closed
=================================  ========================================================

Why a relay for gRPC: grpcio's Python server has no public API to adopt a listening
descriptor (``add_insecure_port`` only binds addresses, and binding the unit's own path would
unlink systemd's socket and break the next activation), and it reads a whole request before
anything can look at the caller. So hwrd always binds gRPC on a private ``<socket>.grpc`` (mode
0600, the daemon's user only), and ``GrpcRelay`` accepts on the public socket (systemd's, or
hwrd's own ``<socket>``), asks ``admit`` about each connection's peer credentials before reading
a byte of it (``hwr.daemon.system.grpc_peers``), and splices the admitted ones both ways. A connection reaches
gRPC only once its client sent a first byte: one that sends nothing for ``first_bytes_timeout_s``
(the config key ``grpc_first_bytes_timeout_s``; gRPC clients send their connection preface at
once) is closed (it held one descriptor meanwhile, never three). ``admit`` may later shed a
connection to make room for another uid (the node-wide budget): the relay then closes it. Clients
see the public socket; gRPC carries only small control messages (descriptors go over the peer
socket), so the extra hop costs one copy of a few KiB per call. Limits: the relay keeps no
per-connection state besides the two streams, and a connection queued in the inherited backlog
while hwrd restarts is served by the new process (systemd keeps the socket open), which is the
point of socket activation. The daemon never unlinks inherited socket paths: systemd owns them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hwr.daemon.system.accepting import Acceptor, cancel_and_wait

if TYPE_CHECKING:
    from hwr.daemon.system.grpc_peers import RelayTicket

__all__ = ["Assignment", "GrpcRelay", "InheritedSocket", "assign", "inherited_sockets", "private_grpc_path"]

log = logging.getLogger("hwrd.activation")
SD_LISTEN_FDS_START = 3
#: How long the relay waits for a closed stream's connection to end (its buffer flushed) before
#: it aborts it.
RELAY_CLOSE_WAIT_S = 1.0


@dataclass(frozen=True)
class InheritedSocket:
    fd: int
    name: str
    path: str  # the bound Unix path, "" for unnamed/abstract or non-Unix sockets


@dataclass
class Assignment:
    grpc: socket.socket | None = None
    peer: socket.socket | None = None


def private_grpc_path(grpc_path: Path) -> Path:
    return Path(f"{grpc_path}.grpc")


def listen_fd_count(env: Mapping[str, str], pid: int) -> int:
    """How many descriptors systemd passed to ``pid`` (0 when the variables are absent, malformed
    or meant for another process)."""
    if env.get("LISTEN_PID", "") != str(pid):
        return 0
    raw = env.get("LISTEN_FDS", "")
    return int(raw) if raw.isdigit() else 0


def inherited_sockets(env: MutableMapping[str, str] | None = None) -> list[InheritedSocket]:
    """Take over the descriptors systemd passed to this process (see the module docstring)."""
    env = os.environ if env is None else env
    count = listen_fd_count(env, os.getpid())
    names = env.get("LISTEN_FDNAMES", "").split(":") if env.get("LISTEN_FDNAMES") else []
    for var in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        env.pop(var, None)
    found = []
    for i in range(count):
        fd = SD_LISTEN_FDS_START + i
        os.set_inheritable(fd, False)
        found.append(InheritedSocket(fd, names[i] if i < len(names) else "", _bound_path(fd)))
    return found


def _bound_path(fd: int) -> str:
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return ""
    try:
        if sock.family != socket.AF_UNIX:
            return ""
        name = sock.getsockname()
        return name if isinstance(name, str) else ""
    finally:
        sock.close()


def assign(inherited: list[InheritedSocket], grpc_path: Path, peer_path: Path) -> Assignment:
    """Match inherited sockets to channels by bound path, then by name; close the rest."""
    result = Assignment()
    for item in inherited:
        role = _role(item, grpc_path, peer_path)
        sock = socket.socket(fileno=item.fd)
        if role is None or getattr(result, role) is not None or not _is_listening_stream(sock):
            log.warning("ignoring inherited socket fd=%d name=%s path=%s", item.fd, item.name or "-",
                        item.path or "-")
            sock.close()
            continue
        setattr(result, role, sock)
        log.info("using inherited socket fd=%d role=%s path=%s", item.fd, role, item.path or "-")
    return result


def _role(item: InheritedSocket, grpc_path: Path, peer_path: Path) -> str | None:
    if item.path:
        if os.path.abspath(item.path) == os.path.abspath(grpc_path):
            return "grpc"
        if os.path.abspath(item.path) == os.path.abspath(peer_path):
            return "peer"
        return None
    return item.name if item.name in ("grpc", "peer") else None


def _is_listening_stream(sock: socket.socket) -> bool:
    try:
        return (sock.family == socket.AF_UNIX and sock.type == socket.SOCK_STREAM
                and bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)))
    except OSError:
        return False


class GrpcRelay:
    """Accept on a listening socket (systemd's, or hwrd's own ``<socket>``) and splice each
    connection to gRPC's private path. ``admit(conn, abort)``, when given, is asked before a byte
    of a connection is read: None closes it unread, else the ``RelayTicket`` it returns hears of
    the client's activity and is released once the connection ends; ``abort()`` closes the
    connection when ``admit`` sheds it later (``hwr.daemon.system.grpc_peers``). A connection
    whose client sends no byte for ``first_bytes_timeout_s`` after it was accepted is closed."""

    def __init__(self, listen: socket.socket, target: Path,
                 admit: Callable[[socket.socket, Callable[[], None]], RelayTicket | None] | None = None,
                 *, first_bytes_timeout_s: float) -> None:
        self._listen = listen
        self._target = target
        self._admit = admit
        self._first_bytes_timeout_s = first_bytes_timeout_s
        self._accept: asyncio.Task[None] | None = None
        self._conns: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._listen.setblocking(False)
        self._accept = asyncio.get_running_loop().create_task(self._accept_loop())

    async def stop_accepting(self) -> None:
        """Stop taking new connections; the inherited socket stays open until ``close``."""
        task, self._accept = self._accept, None
        await cancel_and_wait(task)

    async def close(self) -> None:
        await self.stop_accepting()
        for task in list(self._conns):
            task.cancel()
        if self._conns:
            await asyncio.gather(*self._conns, return_exceptions=True)
        self._listen.close()

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        acceptor = Acceptor(self._listen, "gRPC relay")
        while True:
            conn = await acceptor.accept()
            spliced: list[asyncio.Task[None]] = []

            def abort(conn: socket.socket = conn, spliced: list[asyncio.Task[None]] = spliced) -> None:
                if spliced:
                    spliced[0].cancel()  # the splice closes both ends
                else:
                    conn.close()

            ticket = self._admit(conn, abort) if self._admit is not None else None
            if self._admit is not None and ticket is None:
                conn.close()  # unread: a refused peer never makes the daemon buffer its bytes
                continue
            task = loop.create_task(self._splice(conn, ticket))
            spliced.append(task)
            self._conns.add(task)
            task.add_done_callback(self._conns.discard)
            # A splice cancelled (shed) before it ran never closes the connection itself.
            task.add_done_callback(lambda _t, c=conn: c.close())
            if ticket is not None:
                task.add_done_callback(lambda _t, done=ticket: done.release())

    async def _splice(self, conn: socket.socket, ticket: RelayTicket | None) -> None:
        try:
            client_r, client_w = await asyncio.open_unix_connection(sock=conn)
        except OSError:
            conn.close()
            return
        except asyncio.CancelledError:
            conn.close()
            raise
        writers = [client_w]
        try:
            # Nothing of gRPC is spent on a connection before its client speaks.
            try:
                # ``asyncio.timeout``, not ``wait_for``: on Python 3.11 ``wait_for`` loses a
                # cancellation (a shed) that arrives as the read completes.
                async with asyncio.timeout(self._first_bytes_timeout_s):
                    first = await client_r.read(1 << 16)
            except (TimeoutError, ConnectionError, OSError):
                return
            if not first or (ticket is not None and ticket.released):  # no bytes, or shed meanwhile
                return
            if ticket is not None:
                ticket.touch()
            try:
                server_r, server_w = await asyncio.open_unix_connection(str(self._target))
            except OSError as exc:
                log.warning("relay cannot reach gRPC at its private socket: %s", exc.strerror or exc)
                return
            writers.append(server_w)
            server_w.write(first)
            await asyncio.gather(_pump(client_r, server_w, ticket), _pump(server_r, client_w))
        finally:
            for writer in writers:
                writer.close()
            for writer in writers:
                await _ended(writer)


async def _ended(writer: asyncio.StreamWriter) -> None:
    """Wait until a closed stream's connection has ended, and take how it ended: a peer that went
    away while the relay wrote to it (``BrokenPipeError``) is an ordinary end of a relayed
    connection, and left untaken asyncio logs it as an error when the stream is collected. A
    connection that does not end within ``RELAY_CLOSE_WAIT_S`` (a peer that stopped reading) is
    aborted."""
    try:
        await asyncio.wait_for(writer.wait_closed(), RELAY_CLOSE_WAIT_S)
    except (TimeoutError, OSError):
        writer.transport.abort()
    except asyncio.CancelledError:
        writer.transport.abort()
        raise


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                ticket: RelayTicket | None = None) -> None:
    """Copy ``reader`` to ``writer`` until EOF; ``ticket`` (the client's direction) hears of
    every chunk, so that shedding picks the least recently active connection."""
    try:
        while chunk := await reader.read(1 << 16):
            if ticket is not None:
                ticket.touch()
            writer.write(chunk)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        writer.close()
