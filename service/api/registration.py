"""gRPC method handlers for a servicer, with requests that fail to parse kept for the handler."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError
from google.protobuf.message_factory import GetMessageClass

__all__ = ["Malformed", "generic_handler"]


class Malformed:
    """Stands in for a request whose bytes did not parse, so the handler can say so."""

    def __init__(self, type_name: str) -> None:
        self.type_name = type_name


def _lenient(message_class: Any) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return message_class.FromString(data)
        except (DecodeError, ValueError, RuntimeError):
            return Malformed(message_class.DESCRIPTOR.full_name)

    return parse


def generic_handler(servicer: Any, service: ServiceDescriptor) -> grpc.GenericRpcHandler:
    """Method handlers for a servicer whose undecodable requests become INVALID_ARGUMENT.

    gRPC's generated registration answers a request that fails to parse with a bare INTERNAL;
    a caller sending bad bytes deserves to be told its request is malformed.
    """
    handlers = {
        method.name: (
            grpc.stream_stream_rpc_method_handler
            if method.client_streaming and method.server_streaming
            else grpc.unary_unary_rpc_method_handler
        )(
            getattr(servicer, method.name),
            request_deserializer=_lenient(GetMessageClass(method.input_type)),
            response_serializer=GetMessageClass(method.output_type).SerializeToString,
        )
        for method in service.methods
    }
    return grpc.method_handlers_generic_handler(service.full_name, handlers)
