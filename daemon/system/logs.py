"""hwrd's log lines: ``key=value`` fields that read well in journald and in a terminal.

Under systemd (``$JOURNAL_STREAM`` names our stderr) a line is ``<PRIORITY>logger: message
key=value ...``: no timestamp (journald stamps every line) and the syslog priority as the
``<N>`` prefix journald parses, so ``journalctl -p warning -u hwrd`` works. Elsewhere it is
``2025-01-01T12:00:00.123 INFO logger: message key=value ...``.

Fields: pass ``extra={"fields": {...}}`` (or use ``fields(**kv)``) to a logging call; values are
quoted when they contain spaces, quotes or ``=``, and newlines are escaped so one record is one
line. Contract: ``configure`` is idempotent (it replaces the handler it installed before) and
``set_level`` changes the level of every hwrd logger at once (used by SIGHUP reload). Limits: no
native journal protocol (``sd_journal_send``): the fields stay in ``MESSAGE``, which keeps hwrd
free of libsystemd.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from typing import Any, TextIO

__all__ = ["KeyValueFormatter", "configure", "fields", "format_fields", "running_under_journald", "set_level"]

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
_SYSLOG_PRIORITY = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}
_HANDLER_NAME = "hwrd-stderr"


def fields(**kv: Any) -> dict[str, Any]:
    """``log.info("msg", extra=fields(key=value))``."""
    return {"fields": kv}


def format_fields(kv: Mapping[str, Any]) -> str:
    parts = []
    for key, value in kv.items():
        text = str(value).replace("\\", "\\\\").replace("\n", "\\n")
        if not text or any(c in text for c in ' "='):
            text = '"' + text.replace('"', '\\"') + '"'
        parts.append(f"{key}={text}")
    return " ".join(parts)


def running_under_journald(stream: TextIO, env: Mapping[str, str] | None = None) -> bool:
    """True when ``$JOURNAL_STREAM`` (``DEVICE:INODE``) is the stream we write to, as systemd
    documents; a stale variable inherited by a child writing elsewhere does not count."""
    env = os.environ if env is None else env
    device, _, inode = env.get("JOURNAL_STREAM", "").partition(":")
    if not device.isdigit() or not inode.isdigit():
        return False
    try:
        st = os.fstat(stream.fileno())
    except (OSError, ValueError, AttributeError):
        return False
    return (st.st_dev, st.st_ino) == (int(device), int(inode))


class KeyValueFormatter(logging.Formatter):
    def __init__(self, *, journald: bool) -> None:
        super().__init__()
        self.journald = journald

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage().replace("\n", "\\n")
        extra = getattr(record, "fields", None)
        if isinstance(extra, Mapping) and extra:
            message = f"{message} {format_fields(extra)}"
        if record.exc_info:
            message = f"{message} {format_fields({'exception': self.formatException(record.exc_info)})}"
        if self.journald:
            return f"<{_SYSLOG_PRIORITY.get(record.levelno, 6)}>{record.name}: {message}"
        stamp = self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}"
        return f"{stamp} {record.levelname} {record.name}: {message}"


def configure(level: str, stream: TextIO | None = None, env: Mapping[str, str] | None = None) -> bool:
    """Install hwrd's handler on the root logger; returns whether journald format was chosen."""
    stream = sys.stderr if stream is None else stream
    journald = running_under_journald(stream, env)
    root = logging.getLogger()
    for handler in list(root.handlers):
        if handler.get_name() == _HANDLER_NAME:
            root.removeHandler(handler)
    handler = logging.StreamHandler(stream)
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(KeyValueFormatter(journald=journald))
    root.addHandler(handler)
    set_level(level)
    return journald


def set_level(level: str) -> None:
    logging.getLogger().setLevel(LEVELS[level])
    logging.getLogger("hwrd").setLevel(LEVELS[level])
