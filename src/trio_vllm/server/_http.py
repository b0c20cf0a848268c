"""ASGI plumbing: read a bounded body, send JSON, send server-sent events, HTTP errors.

No framework: an endpoint is a coroutine that gets the ASGI ``scope``/``receive``/``send``
triple. Everything here runs on any backend anyio supports (trio and asyncio).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from http import HTTPStatus
from typing import Any

import msgspec

from ._schemas import ErrorInfo, ErrorResponse

__all__ = [
    "SEND_NOWAIT",
    "WATCH_DISCONNECT",
    "ASGIReceive",
    "ASGISend",
    "ClientDisconnected",
    "HTTPError",
    "read_body",
    "send_bytes",
    "send_error",
    "validation_error",
]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
ASGIReceive = Callable[[], Awaitable[Message]]
ASGISend = Callable[[Message], Awaitable[None]]

#: The ASGI scope extension (``scope["extensions"][WATCH_DISCONNECT]``) of `serve_h11`: a
#: callable ``watch(on_disconnect) -> stop``. ``on_disconnect()`` is called (once, from
#: the server's event loop, without awaiting) when the client goes away (FIN or reset)
#: before ``stop()`` is called or the exchange ends; the app then need not keep a task
#: waiting in ``receive()`` for ``http.disconnect``. Other servers do not offer it.
WATCH_DISCONNECT = "trio_vllm.watch_disconnect"

#: The ASGI scope extension (``scope["extensions"][SEND_NOWAIT]``) of `serve_h11`: a
#: callable ``send_nowait(body) -> bool``, the synchronous ``send`` of an
#: ``http.response.body`` with ``more_body`` (after ``http.response.start``), callable
#: from any task of the server's trio run. It writes ``body`` at once if the socket
#: takes it all (``True``); otherwise it keeps the rest, which goes out first with the
#: next ``send`` (``False``: the app should make one, an empty body will do, to wait for
#: the socket). After the client went away it does nothing (``True``; the disconnect is
#: reported as for ``send``). Other servers do not offer it.
SEND_NOWAIT = "trio_vllm.send_nowait"

_JSON = [(b"content-type", b"application/json")]
_ENCODER = msgspec.json.Encoder()


class ClientDisconnected(Exception):
    """The client went away before its request body was complete."""


class HTTPError(Exception):
    """An error answered as vLLM answers it: ``{"error": {message, type, param, code}}``.

    ``err_type`` defaults as vLLM's ``create_error_response`` does: ``BadRequestError``
    for 400, the HTTP phrase otherwise.
    """

    def __init__(
        self,
        message: str,
        status: int = 400,
        *,
        err_type: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.err_type = err_type or (
            "BadRequestError" if status == 400 else HTTPStatus(status).phrase
        )
        self.param = param

    def response(self) -> ErrorResponse:
        return ErrorResponse(ErrorInfo(self.message, self.err_type, self.param, self.status))

    def body(self) -> bytes:
        return _ENCODER.encode(self.response())


def validation_error(message: str, param: str) -> HTTPError:
    """A 400 as vLLM answers a request model's ``VLLMValidationError``: its ``str()``
    (the message, then `` (parameter=NAME)``) as ``message``, ``param`` as ``param``."""
    return HTTPError(f"{message} (parameter={param})", param=param)


def header(scope: Scope, name: bytes) -> bytes | None:
    """The first value of header ``name`` (lower case), or ``None``."""
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return None


async def read_body(scope: Scope, receive: ASGIReceive, limit: int) -> bytes:
    """The whole request body; `HTTPError` 413 once it passes ``limit`` bytes.

    A ``Content-Length`` over the limit is refused before reading anything.
    Raises `ClientDisconnected` if the client leaves first.
    """
    length = header(scope, b"content-length")
    if length is not None:
        try:
            declared = int(length)
        except ValueError:
            raise HTTPError("Invalid Content-Length header") from None
        if declared > limit:
            raise _too_large(limit)
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnected
        chunk = message.get("body", b"")
        if chunk:
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _too_large(limit: int) -> HTTPError:
    return HTTPError(
        f"Request body is larger than the server's limit of {limit} bytes "
        "(trio-vllm serve --max-request-body-bytes)",
        413,
    )


async def send_bytes(
    send: ASGISend,
    status: int,
    body: bytes,
    headers: Iterable[tuple[bytes, bytes]] = _JSON,
) -> None:
    """A complete response in two ASGI messages."""
    await send({"type": "http.response.start", "status": status, "headers": list(headers)})
    await send({"type": "http.response.body", "body": body})


async def send_error(send: ASGISend, error: HTTPError) -> None:
    await send_bytes(send, error.status, error.body())


def encode(value: object) -> bytes:
    return _ENCODER.encode(value)
