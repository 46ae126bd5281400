"""gRPC handlers of channels: SetChannel, GetChannel, ListChannels, DeleteChannel, WatchChannel.

Thin adapters over ``hwr.daemon.service.channels`` (every rule lives there). Setting and removing
need the operator role (a publication sets its channel with the publish role, through
``BeginPublication``, within ``policy.channel_rights``); reading and watching need only a
session. ``WatchChannel`` is bound to the caller's session: it ends with SESSION_INVALID when
the session ends and with UNAVAILABLE when hwrd stops (``Channels.session_ended``/``close``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from hwr.client.channels import check_channel_name
from hwr.client.errors import HwrError, Unsupported
from hwr.daemon.policy.channel_rights import Actor
from hwr.daemon.rpc.collaborators import Ctx, Handlers
from hwr.daemon.rpc.support import abort_with, rpc
from hwr.daemon.service.roles import OPERATOR
from hwr.protos.hwr.v1 import hwr_pb2 as pb

if TYPE_CHECKING:
    from hwr.daemon.policy.channel_state import ChannelState
    from hwr.daemon.service.channels import Channels

__all__ = ["ChannelsRpc", "channel_info"]


def channel_info(state: ChannelState, watchers: int, *, history: bool = True) -> pb.ChannelInfo:
    """The wire form of one channel's state."""
    return pb.ChannelInfo(
        name=state.name, key=state.key, generation=state.generation, durable=state.durable,
        durable_key=state.durable_key, switches=state.switches, watchers=watchers,
        created_at=state.created_at, updated_at=state.updated_at,
        owner_uid=state.owner,
        history=[pb.ChannelHistoryEntry(key=e.key, generation=e.generation, set_at=e.set_at, set_by=e.set_by,
                                        durable=e.durable, uid=e.uid) for e in state.history] if history else [])


class ChannelsRpc(Handlers):
    def _channel_service(self) -> Channels:
        channels = self.c.channels
        if channels is None:
            raise Unsupported("this hwrd serves no channels")
        return channels

    def _channel_info(self, state: ChannelState, *, history: bool = True) -> pb.ChannelInfo:
        return channel_info(state, self._channel_service().watcher_count(state.name), history=history)

    @rpc
    async def SetChannel(self, request: pb.SetChannelRequest, context: Ctx) -> pb.SetChannelResponse:
        session = self._authorize(context, OPERATOR, "set a channel")
        channels = self._channel_service()
        name = check_channel_name(request.name)
        key = await self.c.catalog.resolve(request.key)
        state, changed = await channels.set(name, key, set_by="operator", check=True,
                                            actor=Actor(session.cred.uid, operator=True))
        return pb.SetChannelResponse(channel=self._channel_info(state), changed=changed)

    @rpc
    async def GetChannel(self, request: pb.GetChannelRequest, context: Ctx) -> pb.GetChannelResponse:
        self._session(context)
        channels = self._channel_service()
        channels.resolve(request.name)  # ChannelNotFound, InvalidRequest
        state = channels.get(request.name)
        assert state is not None  # resolve just found it; nothing awaited since
        return pb.GetChannelResponse(channel=self._channel_info(state))

    @rpc
    async def ListChannels(self, request: pb.ListChannelsRequest, context: Ctx) -> pb.ListChannelsResponse:
        self._session(context)
        return pb.ListChannelsResponse(channels=[self._channel_info(s) for s in self._channel_service().states()])

    @rpc
    async def DeleteChannel(self, request: pb.DeleteChannelRequest, context: Ctx) -> pb.DeleteChannelResponse:
        self._authorize(context, OPERATOR, "remove a channel")
        state = await self._channel_service().remove(request.name)
        return pb.DeleteChannelResponse(channel=channel_info(state, 0))

    async def WatchChannel(self, request: pb.WatchChannelRequest,
                           context: Ctx) -> AsyncIterator[pb.WatchChannelResponse]:
        # A streaming handler cannot use @rpc (it wraps coroutines): typed errors are mapped here.
        try:
            session = self._session(context)
            watch = self._channel_service().watch(session.session_id, request.name)
        except HwrError as exc:
            await abort_with(context, exc)
            return
        try:
            async for state in watch.states():
                if state is None:
                    yield pb.WatchChannelResponse(exists=False)
                else:
                    yield pb.WatchChannelResponse(exists=True, channel=self._channel_info(state, history=False))
        except HwrError as exc:
            await abort_with(context, exc)
        finally:
            watch.close()
