"""Registering the servicer so that a request that is not a valid protobuf gets a typed error.

gRPC decodes each request before the handler runs; when the generated ``FromString`` raises,
grpc logs a traceback at ERROR and answers UNKNOWN with no ``hwr-error-code``, so the client
sees an untyped failure. ``add_servicer`` registers the generated handlers with a decoder that
instead hands the handler an ``Undecodable`` marker, and a wrapper that answers it with
``INVALID_ARGUMENT`` (``hwr-error-code`` and details in trailing metadata, like every typed
error: ``hwr.daemon.rpc.support.abort_with``), logged at debug level: a bad request is the
client's error, not the daemon's.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from hwr.client.errors import InvalidRequest
from hwr.daemon.rpc.support import abort_with

__all__ = ["Undecodable", "add_servicer"]

log = logging.getLogger("hwrd.rpc")


class Undecodable:
    """Stands for a request message that could not be decoded."""

    def __init__(self, method: str, reason: str) -> None:
        self.method = method
        self.reason = reason

    def error(self) -> InvalidRequest:
        return InvalidRequest(f"the {self.method} request is not a valid protobuf message",
                              details={"method": self.method, "reason": self.reason[:200]})


class _Capture:
    """Stands in for the server while the generated ``add_*_to_server`` registers its handlers."""

    def __init__(self) -> None:
        self.service = ""
        self.handlers: dict[str, Any] = {}

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass  # rebuilt from the registered handlers below

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        self.service, self.handlers = service, handlers


def add_servicer(add_to_server: Callable[[Any, Any], None], servicer: Any, server: grpc.aio.Server) -> None:
    """``add_to_server(servicer, server)`` (a generated ``add_*Servicer_to_server``), with every
    request decoder made tolerant (see the module docstring)."""
    capture = _Capture()
    add_to_server(servicer, capture)
    wrapped = {name: _tolerant(name, handler) for name, handler in capture.handlers.items()}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(capture.service, wrapped),))
    server.add_registered_method_handlers(capture.service, wrapped)


def _tolerant(name: str, handler: Any) -> Any:
    decode = handler.request_deserializer

    def decoder(data: bytes) -> Any:
        try:
            return decode(data)
        except Exception as exc:  # DecodeError, and what a corrupt message makes upb raise
            log.debug("undecodable %s request: %s", name, exc)
            return Undecodable(name, str(exc))

    if handler.unary_unary is not None:
        behavior = handler.unary_unary

        async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, Undecodable):
                await abort_with(context, request.error())
            return await behavior(request, context)

        return grpc.unary_unary_rpc_method_handler(unary, request_deserializer=decoder,
                                                   response_serializer=handler.response_serializer)
    if handler.unary_stream is not None:
        stream = handler.unary_stream

        async def streaming(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            if isinstance(request, Undecodable):
                await abort_with(context, request.error())
                return
            async for item in stream(request, context):
                yield item

        return grpc.unary_stream_rpc_method_handler(streaming, request_deserializer=decoder,
                                                    response_serializer=handler.response_serializer)
    return handler  # streaming requests: not used by this service
