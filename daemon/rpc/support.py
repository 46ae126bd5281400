"""Shared plumbing for gRPC handlers: typed-error mapping and session lookup.

``@rpc`` wraps an async handler: a typed ``HwrError`` becomes the status code from
``hwr.client.wire.STATUS_BY_CODE`` with the hwr code and details in trailing metadata; any other
exception is logged and answered INTERNAL, and the daemon keeps serving. ``session_of`` returns
the caller's session from the ``hwr-session`` metadata or raises ``SessionInvalid``.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from hwr.client.errors import HwrError
from hwr.client.wire import ERROR_CODE_KEY, ERROR_DETAILS_KEY, SESSION_KEY, status_for

if TYPE_CHECKING:
    from hwr.daemon.app.server import Daemon
    from hwr.daemon.service.sessions import Session

__all__ = ["abort_with", "rpc", "session_of"]

log = logging.getLogger("hwrd.rpc")
R = TypeVar("R")


def rpc(handler: Callable[..., Awaitable[R]]) -> Callable[..., Awaitable[R]]:
    @functools.wraps(handler)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> R:
        try:
            return await handler(self, request, context)
        except HwrError as exc:
            await abort_with(context, exc)
        except Exception:
            log.exception("internal error in %s", handler.__name__)
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {handler.__name__}")
        raise AssertionError("unreachable")

    return wrapper


async def abort_with(context: grpc.aio.ServicerContext, exc: HwrError) -> None:
    details = json.dumps(exc.details, default=str)[:4096]
    context.set_trailing_metadata(((ERROR_CODE_KEY, exc.code), (ERROR_DETAILS_KEY, details)))
    await context.abort(status_for(exc), exc.message)


def session_of(daemon: Daemon, context: grpc.aio.ServicerContext) -> Session:
    token = None
    for key, value in context.invocation_metadata() or ():
        if key == SESSION_KEY:
            token = value
    return daemon.registry.session_for_token(token)
