"""Accept loops that outlive running out of file descriptors.

``asyncio``'s ``sock_accept`` raises ``OSError(EMFILE)`` when the process has no descriptor left
for the new connection (``ENFILE``: the whole system; ``ENOBUFS``/``ENOMEM``: kernel memory). An
accept loop that lets it propagate dies for good: the listening socket stays open, so clients
still connect into its backlog, but nobody accepts them again even after descriptors free up.

``Acceptor.accept`` instead waits and tries again (10 ms, doubling to 1 s, logged once per
episode), so service resumes as soon as descriptors are free. Optionally it keeps one spare
descriptor (``/dev/null``) to answer the connections that arrive meanwhile: it closes the spare,
accepts one, hands it to ``refuse`` (which sends a typed error and closes it), and reopens the
spare once that connection is closed (its slot is the one the spare gets back); a client then
gets a prompt, typed answer instead of a timeout, however many arrive. A normal accept happens
only while the spare is held: when it could not be reopened (another thread took the slot),
the next connection is the one refused, so the slot it takes is given back at once.
Connections aborted before they were accepted are skipped. A connection is also refused when,
once it is accepted, fewer than ``RESERVE`` descriptors would be left: sessions already open
need a few to serve their requests (each acquire opens its payloads), and a connection that took
the very last slot would leave them none.

Limits: while descriptors are exhausted, requests on already open connections can still fail
(each acquire opens its payloads); ``hwrd`` raises its soft ``RLIMIT_NOFILE`` to the hard limit
at start (``raise_nofile_limit``) so that this takes a great many connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import resource
import socket
from collections.abc import Callable

__all__ = ["Acceptor", "cancel_and_wait", "raise_nofile_limit"]

log = logging.getLogger("hwrd.accept")

#: Out of descriptors or kernel memory: wait for some to be freed.
EXHAUSTED = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
#: The connection went away before it was accepted: take the next one.
_SKIP = frozenset({errno.ECONNABORTED, errno.EPROTO, errno.EINTR, errno.EAGAIN})
_FIRST_DELAY, _MAX_DELAY = 0.01, 1.0
#: Descriptors kept free for open sessions' requests (see the module docstring).
RESERVE = 8


class Acceptor:
    """Accepts on a non-blocking listening socket (see the module docstring); one task at a time."""

    def __init__(self, listen: socket.socket, name: str,
                 refuse: Callable[[socket.socket], None] | None = None) -> None:
        self.listen = listen
        self.name = name
        self.refuse = refuse
        self.refused = 0  # connections answered by ``refuse`` (tests, logs)
        self._spare: int | None = _open_spare() if refuse is not None else None
        self._episode = 0  # failed accepts in the current exhaustion episode

    async def accept(self) -> socket.socket:
        """The next connection, as a non-blocking socket."""
        loop = asyncio.get_running_loop()
        delay = _FIRST_DELAY
        while True:
            if self.refuse is not None and self._spare is None:
                self._spare = _open_spare()
                if self._spare is None:  # out of descriptors: keep none of them, answer and close
                    if not self._refuse_one():
                        await asyncio.sleep(delay)
                        delay = min(delay * 2, _MAX_DELAY)
                    continue
            try:
                conn, _ = await loop.sock_accept(self.listen)
            except OSError as exc:
                if exc.errno in _SKIP:
                    continue
                if exc.errno not in EXHAUSTED:
                    raise
                if not self._episode:
                    log.warning("%s: cannot accept connections: %s; retrying until descriptors are freed",
                                self.name, exc.strerror or exc)
                self._episode += 1
                if self._refuse_one():
                    continue  # the backlog may hold more: each is answered, none waits
                await asyncio.sleep(delay)
                delay = min(delay * 2, _MAX_DELAY)
                continue
            if self.refuse is not None and not self._headroom():
                if not self._episode:
                    log.warning("%s: fewer than %d descriptors left; refusing new connections until "
                                "descriptors are freed", self.name, RESERVE)
                self._episode += 1
                self._send_refusal(conn)
                continue
            if self._episode:
                log.warning("%s: accepting connections again (%d accepts had failed, %d refused)",
                            self.name, self._episode, self.refused)
                self._episode = 0
            conn.setblocking(False)
            return conn

    def close(self) -> None:
        if self._spare is not None:
            os.close(self._spare)
            self._spare = None

    def _refuse_one(self) -> bool:
        """Use the spare descriptor (or, without one, whatever slot is free) to accept and refuse
        one waiting connection; False when nothing was waiting or no slot was free."""
        if self.refuse is None:
            return False
        if self._spare is not None:
            os.close(self._spare)
            self._spare = None
        try:
            conn, _ = self.listen.accept()
        except OSError:
            self._spare = _open_spare()
            return False
        self._send_refusal(conn)
        return True

    def _send_refusal(self, conn: socket.socket) -> None:
        assert self.refuse is not None
        try:
            self.refuse(conn)
            self.refused += 1
        except OSError as exc:  # the client went away first
            log.debug("%s: refusal not sent: %s", self.name, exc)
        finally:
            conn.close()
            if self._spare is None:
                self._spare = _open_spare()  # the slot the connection held: free again

    def _headroom(self) -> bool:
        """True when ``RESERVE`` more descriptors could still be opened (probed, then closed)."""
        if self._spare is None:
            return False
        probes: list[int] = []
        try:
            for _ in range(RESERVE):
                probes.append(os.dup(self._spare))
            return True
        except OSError:
            return False
        finally:
            for fd in probes:
                os.close(fd)


async def cancel_and_wait(task: asyncio.Task[None] | None) -> None:
    """Cancel an accept loop's task (None: nothing) and wait until it has ended."""
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def _open_spare() -> int | None:
    try:
        return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None


def raise_nofile_limit() -> tuple[int, int]:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit (each session holds a connection, each
    acquire briefly its payloads); returns (soft, hard) as they are after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open-files limit from %d to %d: %s", soft, hard, exc)
    return soft, hard
