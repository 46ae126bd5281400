"""Channels: named, mutable pointers to artifact keys (the contract shared by hwrd and clients).

A channel (``flux-rl``) points to one artifact key at a time, for example the newest revision
of a model that a trainer keeps updating. It is set by an operator (``hwrctl channel set``) or
by a publication's commit (``client.publish(..., channel=NAME)``), and a client can lease
through it (``client.acquire_channel``) or watch it (``client.watch_channel``).

Names: ``[a-z0-9][a-z0-9._-]{0,63}`` (``valid_channel_name``); a name is never used as a path.

``generation``: every change of any channel on a node takes the next number of one counter that
hwrd keeps durably, so a channel's generation only grows, also across ``rm`` and restarts; the
fallback after a restart that lost a non-durable revision is a change too (a new generation).

This module is torch-free and gRPC-free: hwrd imports it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from hwr.client.errors import InvalidRequest

__all__ = ["CHANNEL_NAME_PATTERN", "ChannelUpdate", "check_channel_name", "valid_channel_name"]

CHANNEL_NAME_PATTERN = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")


def valid_channel_name(name: object) -> bool:
    """True for a channel name: ``[a-z0-9][a-z0-9._-]{0,63}``."""
    return isinstance(name, str) and CHANNEL_NAME_PATTERN.fullmatch(name) is not None


def check_channel_name(name: object) -> str:
    """``name`` when it is a valid channel name, else ``InvalidRequest`` (details name the field)."""
    if not valid_channel_name(name):
        raise InvalidRequest("a channel name is 1-64 characters of [a-z0-9._-], starting with [a-z0-9]",
                             details={"field": "channel", "channel": str(name)[:80]})
    return name  # type: ignore[return-value]


@dataclass(frozen=True)
class ChannelUpdate:
    """A state of a channel as a watcher sees it: ``key`` is the artifact it points to and
    ``generation`` the change that put it there (see the module docstring)."""

    name: str
    key: str
    generation: int
