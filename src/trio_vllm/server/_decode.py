"""The one decode path for request bodies: bytes -> JSON -> request struct.

`decode_request` is sans-I/O (no sockets, no event loop): the server hands it the
``Content-Type`` header and the complete body (`read_body` has already refused bodies
over the size limit with 413). Every way a body can be wrong ends as `HTTPError` 400
with vLLM's error shape, never as another exception: a wrong content type, bytes that
are not UTF-8, text that is not JSON (``NaN``/``Infinity`` included, which strict JSON
has not), nesting deeper than the decoder recurses, numbers out of range, a top level
that is not an object, wrong field types. Duplicate keys are accepted, the last one
winning, and a leading UTF-8 byte order mark is skipped, as Python's ``json`` (and so
``vllm serve``) takes them.
"""

from __future__ import annotations

import logging
from typing import Final, Literal, TypeAlias

import msgspec

from ._http import HTTPError
from ._schemas import ChatCompletionRequest, CompletionRequest

__all__ = ["RequestKind", "decode_request"]

logger = logging.getLogger("trio_vllm.server")

RequestKind: TypeAlias = Literal["completion", "chat"]
GenerationRequest: TypeAlias = CompletionRequest | ChatCompletionRequest

_JSON_CT: Final = b"application/json"
_BOM: Final = b"\xef\xbb\xbf"
_FIELDS: Final = {
    "completion": frozenset(CompletionRequest.__struct_fields__),
    "chat": frozenset(ChatCompletionRequest.__struct_fields__),
}
_RAW_KEYS: Final = msgspec.json.Decoder(dict[str, msgspec.Raw])
_ANY: Final = msgspec.json.Decoder()
_DECODERS: Final[dict[str, msgspec.json.Decoder[GenerationRequest]]] = {
    # strict=False: pydantic's lax mode (vLLM's), e.g. "2" for an int field.
    "completion": msgspec.json.Decoder(CompletionRequest, strict=False),
    "chat": msgspec.json.Decoder(ChatCompletionRequest, strict=False),
}


def _bad(detail: str, param: str | None = None) -> HTTPError:
    # vLLM's RequestValidationError handler: type "Bad Request", one line per error.
    return HTTPError(f"1 validation error:\n  {detail}", err_type="Bad Request", param=param)


def decode_request(
    kind: RequestKind, content_type: bytes | None, body: bytes
) -> tuple[GenerationRequest, dict[str, object]]:
    """The request struct of ``body`` and the values of the keys it does not know.

    Raises `HTTPError` (400) for every malformed body and nothing else: callers need
    no other handler. Pure and synchronous (no cancellation point).
    """
    if (content_type or b"").split(b";", 1)[0].strip().lower() != _JSON_CT:
        raise _bad("Unsupported Media Type: Only 'application/json' is allowed")
    if body.startswith(_BOM):
        # Python's json.loads(bytes) (vLLM's parser) skips a UTF-8 byte order mark.
        body = body[len(_BOM) :]
    try:
        # Keys first (values left raw, cheap): a top level that is not an object is
        # told apart from a field of the wrong type.
        raw = _RAW_KEYS.decode(body)
    except msgspec.ValidationError:
        raise _bad("Input should be a valid dictionary or object") from None
    except msgspec.DecodeError as exc:
        raise _bad(f"JSON decode error: {exc}") from None
    except RecursionError:  # unreachable with Raw values; kept so nothing escapes
        raise _bad("JSON decode error: nested too deeply") from None
    try:
        req = _DECODERS[kind].decode(body)
        unknown = raw.keys() - _FIELDS[kind]
        extra: dict[str, object] = {k: _ANY.decode(raw[k]) for k in unknown}
    except msgspec.ValidationError as exc:
        message = str(exc)
        param = None
        if "`$." in message:
            param = message.rsplit("`$.", 1)[1].split("`", 1)[0].split("[", 1)[0]
        raise _bad(message, param) from None
    except msgspec.DecodeError as exc:  # invalid UTF-8 or escapes inside a value
        raise _bad(f"JSON decode error: {exc}") from None
    except RecursionError:  # msgspec recurses per nesting level (the interpreter's limit)
        raise _bad("JSON decode error: nested too deeply") from None
    if extra:  # as vLLM's extra="allow" models: ignored, and said so
        logger.warning(
            "The following fields were present in the request but ignored: %s", sorted(extra)
        )
    return req, extra
