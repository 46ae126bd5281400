"""Shared plumbing for gRPC handlers: typed-error mapping, session lookup and role checks.

``@rpc`` wraps an async handler: a typed ``HwrError`` becomes the status code from
``hwr.client.wire.STATUS_BY_CODE`` with the hwr code and details in trailing metadata; any other
exception is logged and answered INTERNAL, and the daemon keeps serving. ``session_of`` returns
the caller's session from the ``hwr-session`` metadata or raises ``SessionInvalid``;
``authorize`` also checks that it holds a role (``hwr.daemon.service.roles``).
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
from hwr.daemon.service.roles import Role

if TYPE_CHECKING:
    from hwr.daemon.service.sessions import Registry, Session
    from hwr.daemon.service.settings import Settings

__all__ = ["abort_with", "authorize", "rpc", "session_of"]

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


def session_of(registry: Registry, context: grpc.aio.ServicerContext) -> Session:
    token = None
    for key, value in context.invocation_metadata() or ():
        if key == SESSION_KEY:
            token = value
    return registry.session_for_token(token)


def authorize(registry: Registry, settings: Settings, context: grpc.aio.ServicerContext, role: Role,
              action: str) -> Session:
    """The caller's session (``hwr-session`` metadata), after checking it holds ``role``."""
    session = session_of(registry, context)
    settings.roles.require(session.cred, role, action)
    return session
