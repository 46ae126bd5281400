"""The sd_notify protocol, spoken directly over ``$NOTIFY_SOCKET`` (no libsystemd).

Protocol (systemd's ``sd_notify(3)``): one datagram of newline-separated ``KEY=VALUE`` lines to
the ``AF_UNIX``/``SOCK_DGRAM`` socket named by ``$NOTIFY_SOCKET``; a leading ``@`` names an
abstract socket. hwrd sends::

    READY=1 + STATUS=...   once gRPC and the peer socket accept connections (never before)
    STATUS=...             when something an operator should see changes (reload)
    RELOADING=1 ... READY=1 around a SIGHUP reload
    WATCHDOG=1             every ``watchdog_interval(env)`` seconds (half of $WATCHDOG_USEC)
    STOPPING=1             as soon as SIGTERM/SIGINT is received, before the shutdown starts

Contract: ``Notifier.from_env()`` returns a notifier that does nothing when ``$NOTIFY_SOCKET`` is
unset, so the daemon calls it unconditionally. Sending never raises: a lost notification is
logged once and the daemon keeps serving (systemd's own ``sd_notify`` behaves the same).
Limits: no descriptor store (``FDSTORE=1``) and no ``MAINPID=`` (hwrd is the main process).
``$WATCHDOG_PID``, when set to another pid, disables the watchdog for this process as systemd
documents; the environment is not unset, so children inherit it and ignore it the same way.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Mapping

__all__ = ["Notifier", "watchdog_interval"]

log = logging.getLogger("hwrd.notify")


def watchdog_interval(env: Mapping[str, str], pid: int | None = None) -> float | None:
    """Seconds between ``WATCHDOG=1`` pings (half of ``$WATCHDOG_USEC``), or ``None`` when off.

    Off when ``WATCHDOG_USEC`` is unset, not a positive integer, or ``WATCHDOG_PID`` names
    another process.
    """
    raw = env.get("WATCHDOG_USEC", "")
    if not raw.isdigit() or int(raw) <= 0:
        return None
    owner = env.get("WATCHDOG_PID", "")
    if owner and owner != str(os.getpid() if pid is None else pid):
        return None
    return int(raw) / 2_000_000


def _address(raw: str) -> str | bytes | None:
    if not raw:
        return None
    if raw.startswith("@"):
        return b"\0" + raw[1:].encode()
    if raw.startswith("/"):
        return raw
    return None  # vsock and other addresses are not supported by this implementation


class Notifier:
    """Sends sd_notify messages; a no-op when no notify socket is configured."""

    def __init__(self, address: str | bytes | None) -> None:
        self.address = address
        self._warned = False

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Notifier:
        env = os.environ if env is None else env
        return cls(_address(env.get("NOTIFY_SOCKET", "")))

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, **fields: str | int) -> bool:
        """Send one datagram of ``KEY=VALUE`` lines; returns whether it was delivered."""
        if self.address is None:
            return False
        lines = []
        for key, value in fields.items():
            text = str(value).replace("\n", " ")  # a newline would start a new assignment
            lines.append(f"{key}={text}")
        payload = "\n".join(lines).encode()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        try:
            sock.sendto(payload, self.address)
            return True
        except OSError as exc:
            if not self._warned:
                log.warning("sd_notify failed: %s", exc.strerror or exc)
                self._warned = True
            return False
        finally:
            sock.close()

    def ready(self, status: str) -> bool:
        return self.send(READY=1, STATUS=status)

    def status(self, status: str) -> bool:
        return self.send(STATUS=status)

    def reloading(self) -> bool:
        # MONOTONIC_USEC lets Type=notify-reload managers (systemd >= 253) match this reload.
        return self.send(RELOADING=1, MONOTONIC_USEC=time.monotonic_ns() // 1000)

    def watchdog(self) -> bool:
        return self.send(WATCHDOG=1)

    def stopping(self, status: str = "shutting down") -> bool:
        return self.send(STOPPING=1, STATUS=status)
