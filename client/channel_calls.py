"""The channel calls of a client: set, inspect, list, remove and watch channels.

``ChannelCalls`` is a base class of ``Client`` (like ``AdminCalls``): each call is one RPC made
through the client's ``Connection``, its answer converted to a plain dict (what ``hwrctl channel
... --json`` prints: ``name``, ``key``, ``generation``, ``durable``, ``durable_key``,
``switches``, ``watchers``, ``created_at``, ``updated_at``, ``history``). Acquiring through a
channel is ``Client.acquire_channel`` (the peer socket's lease path); publishing to one is
``Client.publish(..., channel=NAME)``.

Contract: every failure raises the typed ``HwrError`` of the RPC's status; a missing channel is
``ChannelNotFound``, a bad name ``InvalidRequest`` (checked here before any call). Setting and
removing need hwrd's operator role (``PermissionDeniedError`` otherwise).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hwr.client.channels import check_channel_name
from hwr.protos.hwr.v1 import hwr_pb2 as pb

if TYPE_CHECKING:
    from hwr.client.channel_watch import ChannelWatch
    from hwr.client.connection import Connection

__all__ = ["ChannelCalls", "channel_dict"]


class ChannelCalls:
    """The channel RPCs of ``Client`` (see the module contract)."""

    _connection: Connection

    def set_channel(self, name: str, key: str) -> dict[str, Any]:
        """Point channel ``name`` at the artifact ``key`` (full key or unique prefix), creating
        the channel; durable unless the artifact is not. Returns the channel's state, with
        ``changed`` False when it already pointed there."""
        r: pb.SetChannelResponse = self._connection.call(
            "SetChannel", pb.SetChannelRequest(name=check_channel_name(name), key=key))
        return {**channel_dict(r.channel), "changed": r.changed}

    def inspect_channel(self, name: str) -> dict[str, Any]:
        """One channel's state with its history, watchers and switch count."""
        r: pb.GetChannelResponse = self._connection.call(
            "GetChannel", pb.GetChannelRequest(name=check_channel_name(name)))
        return channel_dict(r.channel)

    def list_channels(self) -> list[dict[str, Any]]:
        """Every channel of the node, by name."""
        r: pb.ListChannelsResponse = self._connection.call("ListChannels", pb.ListChannelsRequest())
        return [channel_dict(c) for c in r.channels]

    def remove_channel(self, name: str) -> dict[str, Any]:
        """Remove a channel; returns its last state. Its keys become evictable once unleased."""
        r: pb.DeleteChannelResponse = self._connection.call(
            "DeleteChannel", pb.DeleteChannelRequest(name=check_channel_name(name)))
        return channel_dict(r.channel)

    def watch_channel(self, name: str) -> ChannelWatch:
        """Subscribe to a channel's changes (``hwr.client.channel_watch`` documents ``wait``,
        coalescing, and what happens when the session ends or hwrd restarts)."""
        from hwr.client.channel_watch import ChannelWatch

        self._connection.check_usable()
        return ChannelWatch(self._connection, name)


def channel_dict(c: pb.ChannelInfo) -> dict[str, Any]:
    return {"name": c.name, "key": c.key, "generation": c.generation, "durable": c.durable,
            "durable_key": c.durable_key, "switches": c.switches, "watchers": c.watchers,
            "created_at": c.created_at, "updated_at": c.updated_at,
            "owner_uid": c.owner_uid if c.HasField("owner_uid") else None,
            "history": [{"key": e.key, "generation": e.generation, "set_at": e.set_at, "set_by": e.set_by,
                         "durable": e.durable, "uid": e.uid if e.HasField("uid") else None} for e in c.history]}
