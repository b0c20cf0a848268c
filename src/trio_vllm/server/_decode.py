"""The one decode path for request bodies: bytes -> JSON -> request struct.

Sans-I/O (no sockets, no event loop): an endpoint hands over the ``Content-Type``
header and the complete body (`read_body` has already refused bodies over the size
limit with 413). Every way a body can be wrong ends as `HTTPError` 400 with vLLM's
error shape, never as another exception: a wrong content type (`check_json`), bytes
that are not UTF-8, text that is not JSON (``NaN``/``Infinity`` included, which strict
JSON has not), nesting deeper than the decoder recurses, numbers out of range, a top
level that is not an object (`decode_object`), wrong field types (`decode_struct`).
Duplicate keys are accepted, the last one winning, and a leading UTF-8 byte order mark
is skipped, as Python's ``json`` (and so ``vllm serve``) takes them.

Every endpoint with a body decodes it here: completions and chat (`decode_request`),
``/v1/embeddings`` (`decode_body`, from ``_embeddings``), ``/tokenize`` and
``/detokenize`` (``_tokenize``), the LoRA endpoints.
"""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING, Final, Literal, TypeAlias, TypeVar

import msgspec
import msgspec.inspect

from ._http import HTTPError
from ._schemas import UNSUPPORTED_FIELDS, ChatCompletionRequest, CompletionRequest
from ._structured import warn_removed_guided_fields

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

__all__ = [
    "RequestKind",
    "check_json",
    "decode_body",
    "decode_object",
    "decode_request",
    "decode_struct",
    "decode_value",
]

logger = logging.getLogger("trio_vllm.server")

RequestKind: TypeAlias = Literal["completion", "chat"]
GenerationRequest: TypeAlias = CompletionRequest | ChatCompletionRequest
T = TypeVar("T")

_JSON_CT: Final = b"application/json"
_BOM: Final = b"\xef\xbb\xbf"
_FIELDS: Final = {
    "completion": frozenset(CompletionRequest.__struct_fields__),
    "chat": frozenset(ChatCompletionRequest.__struct_fields__),
}
_OBJECT: Final = msgspec.json.Decoder(dict[str, msgspec.Raw])
_ANY: Final = msgspec.json.Decoder()
_DECODERS: Final[dict[str, msgspec.json.Decoder[GenerationRequest]]] = {
    # strict=False: pydantic's lax mode (vLLM's), e.g. "2" for an int field.
    "completion": msgspec.json.Decoder(CompletionRequest, strict=False),
    "chat": msgspec.json.Decoder(ChatCompletionRequest, strict=False),
}


def _bad(detail: str, param: str | None = None) -> HTTPError:
    # vLLM's RequestValidationError handler: type "Bad Request", one line per error.
    return HTTPError(f"1 validation error:\n  {detail}", err_type="Bad Request", param=param)


def _unbom(body: bytes) -> bytes:
    # Python's json.loads(bytes) (vLLM's parser) skips a UTF-8 byte order mark.
    return body[len(_BOM) :] if body.startswith(_BOM) else body


def check_json(content_type: bytes | None) -> None:
    """vLLM's ``validate_json_request``: only ``application/json`` bodies (400)."""
    if (content_type or b"").split(b";", 1)[0].strip().lower() != _JSON_CT:
        raise _bad("Unsupported Media Type: Only 'application/json' is allowed")


def decode_object(body: bytes) -> dict[str, msgspec.Raw]:
    """The body's top-level keys, values left undecoded; 400 unless a JSON object."""
    try:
        return _OBJECT.decode(_unbom(body))
    except msgspec.ValidationError:
        raise _bad("Input should be a valid dictionary or object") from None
    except msgspec.DecodeError as exc:
        raise _bad(f"JSON decode error: {exc}") from None
    except RecursionError:  # unreachable with Raw values; kept so nothing escapes
        raise _bad("JSON decode error: nested too deeply") from None


def decode_struct(decoder: msgspec.json.Decoder[T], body: bytes) -> T:
    """``body`` decoded by ``decoder``; 400 naming the field (``param``) if it does
    not fit, 400 if it is not JSON.

    Booleans as pydantic's lax mode (vLLM's) reads them, where msgspec's
    ``strict=False`` differs: ``"yes"``/``"no"``, ``"on"``/``"off"``, ``"t"``/``"f"``,
    ``"y"``/``"n"`` (any case) and ``0.0``/``1.0`` are booleans too; the string
    ``"null"`` is not None for a field that takes no string. The happy path costs one
    scan of the body; a body with such values is decoded a second time.
    """
    body = _unbom(body)
    try:
        try:
            req = decoder.decode(body)
        except msgspec.ValidationError:
            lax = _lax_body(decoder.type, body)
            if lax is None:
                raise
            req = decoder.decode(lax)
        else:
            if _NULL_STRING.search(body) is not None:
                _lax_body(decoder.type, body)  # raises for a "null" msgspec took as None
        return req
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


# pydantic's lax booleans (``str_to_bool`` in pydantic-core; case-insensitive), which
# msgspec's strict=False takes only as "true"/"false"/"1"/"0"
_LAX_BOOL: Final = {
    **dict.fromkeys(("1", "on", "t", "true", "y", "yes"), b"true"),
    **dict.fromkeys(("0", "off", "f", "false", "n", "no"), b"false"),
}
_NULL_STRING: Final = re.compile(rb'"null"', re.IGNORECASE)


class _Fields:
    """A struct's fields that lax decoding looks at (encode names)."""

    __slots__ = ("bools", "nested", "no_str")

    def __init__(self, tp: object) -> None:
        self.bools: set[str] = set()
        self.no_str: set[str] = set()  # optional fields a "null" string must not fill
        self.nested: dict[str, type] = {}
        info = msgspec.inspect.type_info(tp)
        if not isinstance(info, msgspec.inspect.StructType):
            return
        for f in info.fields:
            types = f.type.types if isinstance(f.type, msgspec.inspect.UnionType) else (f.type,)
            if any(isinstance(t, msgspec.inspect.BoolType) for t in types):
                self.bools.add(f.encode_name)
            optional = any(isinstance(t, msgspec.inspect.NoneType) for t in types)
            if optional and not any(isinstance(t, msgspec.inspect.StrType) for t in types):
                self.no_str.add(f.encode_name)
            for t in types:
                if isinstance(t, msgspec.inspect.StructType):
                    self.nested[f.encode_name] = t.cls


_FIELDS_OF: dict[object, _Fields] = {}


def _lax_body(tp: object, body: bytes) -> bytes | None:
    """``body`` with its lax booleans made JSON booleans (at the top level and in
    nested structs), or None if it has none; raises ``msgspec.ValidationError`` for
    a ``"null"`` string in a field that takes no string (pydantic refuses it)."""
    try:
        raw = _OBJECT.decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
        return None  # the first decode's error stands
    patched = _lax_object(tp, raw, "$")
    return None if patched is None else msgspec.json.encode(patched)


def _lax_object(
    tp: object, raw: dict[str, msgspec.Raw], where: str
) -> dict[str, msgspec.Raw] | None:
    fields = _FIELDS_OF.get(tp)
    if fields is None:
        fields = _FIELDS_OF[tp] = _Fields(tp)
    patched: dict[str, msgspec.Raw] | None = None
    for name, value in raw.items():
        data = bytes(value)
        new: bytes | None = None
        if name in fields.no_str and data.startswith(b'"') and data[1:-1].lower() == b"null":
            kind = "bool" if name in fields.bools else "value"
            raise msgspec.ValidationError(
                f"Expected `{kind} | null`, got `str` - at `{where}.{name}`"
            )
        if name in fields.bools and data not in (b"true", b"false", b"null"):
            try:
                decoded = _ANY.decode(data)
            except msgspec.DecodeError:
                continue
            if isinstance(decoded, str):
                new = _LAX_BOOL.get(decoded.lower())
            elif isinstance(decoded, float) and decoded in (0.0, 1.0):
                new = b"true" if decoded else b"false"
        elif name in fields.nested and data.startswith(b"{"):
            try:
                nested = _OBJECT.decode(data)
            except (msgspec.DecodeError, RecursionError):  # ValidationError included
                continue  # the struct decoder's error stands
            inner = _lax_object(fields.nested[name], nested, f"{where}.{name}")
            if inner is not None:
                new = msgspec.json.encode(inner)
        if new is not None:
            if patched is None:
                patched = dict(raw)
            patched[name] = msgspec.Raw(new)
    return patched


def decode_value(raw: msgspec.Raw | bytes) -> object:
    """One raw value of `decode_object` as Python objects; 400 if it does not decode."""
    try:
        return _ANY.decode(raw)
    except msgspec.DecodeError as exc:
        raise _bad(f"JSON decode error: {exc}") from None
    except RecursionError:
        raise _bad("JSON decode error: nested too deeply") from None


def decode_body(
    decoder: msgspec.json.Decoder[T],
    fields: frozenset[str],
    content_type: bytes | None,
    body: bytes,
    *,
    check_raw: Callable[[Mapping[str, msgspec.Raw]], None] | None = None,
) -> tuple[T, dict[str, object]]:
    """A JSON body of any endpoint: its request struct (``decoder``'s) and the values of
    the keys not in ``fields``, which are logged as ignored (vLLM's ``extra="allow"``).
    ``check_raw`` sees the top-level keys (values undecoded) before the fields are
    decoded, as a pydantic ``BeforeValidator`` does, and may raise `HTTPError`.

    Raises `HTTPError` (400) for every malformed body and nothing else. Synchronous.
    """
    check_json(content_type)
    raw = decode_object(body)  # keys first: a non-object top level is its own 400
    if check_raw is not None:
        check_raw(raw)
    req = decode_struct(decoder, body)
    unknown = raw.keys() - fields
    extra: dict[str, object] = {k: decode_value(raw[k]) for k in unknown}
    if unknown:
        logger.warning(
            "The following fields were present in the request but ignored: %s", sorted(unknown)
        )
    return req, extra


def decode_request(
    kind: RequestKind, content_type: bytes | None, body: bytes
) -> tuple[GenerationRequest, dict[str, object]]:
    """A completions or chat body: its request struct and the values of the keys the
    struct does not have (vLLM's fields trio-vllm lacks are checked by the planner;
    the rest are logged as ignored, as vLLM's ``extra="allow"`` models do).

    Raises `HTTPError` (400) for every malformed body and nothing else: callers need
    no other handler. Synchronous (no cancellation point).
    """
    check_json(content_type)
    # Keys first (values left raw, cheap): a top level that is not an object is told
    # apart from a field of the wrong type.
    raw = decode_object(body)
    req = decode_struct(_DECODERS[kind], body)
    unknown = raw.keys() - _FIELDS[kind]
    extra: dict[str, object] = {k: decode_value(raw[k]) for k in unknown}
    if unknown:
        warn_removed_guided_fields(unknown)
        _warn_ignored(extra)
    return req, extra


def _warn_ignored(extra: Mapping[str, object]) -> None:
    ignored = extra.keys() - UNSUPPORTED_FIELDS.keys()
    if ignored:
        logger.warning(
            "The following fields were present in the request but ignored: %s", sorted(ignored)
        )
