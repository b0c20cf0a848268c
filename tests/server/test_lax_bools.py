"""Booleans in request bodies as ``vllm serve`` 0.32 reads them (pydantic 2's lax mode,
measured with its pydantic 2.14: the table below), through the one decode path.

msgspec's ``strict=False`` takes only ``"true"``/``"false"``/``"1"``/``"0"`` and 0/1 as
booleans, and the string ``"null"`` as None; pydantic also takes ``"yes"``, ``"on"``,
... and 0.0/1.0, and refuses ``"null"``. ``tests/vllm_tier/test_lax_bool_parity.py``
checks the same table against a running ``vllm serve``.
"""

from __future__ import annotations

import json

import pytest

from trio_vllm.server._decode import decode_request
from trio_vllm.server._http import HTTPError
from trio_vllm.server._tokenize import decode_tokenize_request

# value -> the bool pydantic makes of it, or None: refused (400)
LAX_BOOLS: list[tuple[object, bool | None]] = [
    (True, True), (False, False), (1, True), (0, False), (1.0, True), (0.0, False),
    ("true", True), ("false", False), ("True", True), ("FALSE", False), ("tRuE", True),
    ("1", True), ("0", False), ("yes", True), ("no", False), ("YES", True), ("No", False),
    ("on", True), ("off", False), ("oN", True), ("Off", False), ("t", True), ("f", False),
    ("T", True), ("F", False), ("y", True), ("n", False), ("Y", True),
    (2, None), (-1, None), (1.5, None), ("2", None), ("1.0", None), ("", None),
    (" yes", None), ("yes ", None), ("null", None), ("NULL", None), ("None", None),
    ([], None), ({}, None),
]  # fmt: skip

_JSON = b"application/json"


def _decode(kind: str, body: dict[str, object]) -> object:
    data = json.dumps(body).encode()
    if kind == "tokenize":
        return decode_tokenize_request(data)
    return decode_request(kind, _JSON, data)[0]  # type: ignore[arg-type]


CASES = [
    ("completion", {"prompt": "x"}, "stream", lambda r: r.stream),
    ("completion", {"prompt": "x"}, "echo", lambda r: r.echo),
    ("completion", {"prompt": "x"}, "ignore_eos", lambda r: r.ignore_eos),  # plain bool
    ("chat", {"messages": []}, "add_generation_prompt", lambda r: r.add_generation_prompt),
    ("tokenize", {"prompt": "x"}, "return_token_strs", lambda r: r.return_token_strs),
]


@pytest.mark.parametrize(("value", "want"), LAX_BOOLS)
@pytest.mark.parametrize(("kind", "base", "field", "get"), CASES, ids=[c[2] for c in CASES])
def test_lax_bool(kind: str, base: dict[str, object], field: str, get: object,
                  value: object, want: bool | None) -> None:  # fmt: skip
    if want is None:
        with pytest.raises(HTTPError) as info:
            _decode(kind, {**base, field: value})
        assert info.value.status == 400
        assert info.value.param == field
    else:
        assert get(_decode(kind, {**base, field: value})) is want  # type: ignore[operator]


@pytest.mark.parametrize(("value", "want"), LAX_BOOLS)
def test_lax_bool_nested(value: object, want: bool | None) -> None:
    body = {"prompt": "x", "stream": "yes", "stream_options": {"include_usage": value}}
    if want is None:
        with pytest.raises(HTTPError):
            _decode("completion", body)
    else:
        req = _decode("completion", body)
        assert req.stream is True  # type: ignore[attr-defined]
        assert req.stream_options.include_usage is want  # type: ignore[attr-defined]


def test_null_string_in_other_optional_fields() -> None:
    # pydantic refuses "null" for an int; msgspec's strict=False took it as None
    with pytest.raises(HTTPError) as info:
        _decode("completion", {"prompt": "x", "max_tokens": "null"})
    assert info.value.param == "max_tokens"
    # a string field takes it as the string
    assert _decode("completion", {"prompt": "null"}).prompt == "null"  # type: ignore[attr-defined]
    # elsewhere (inside a prompt) it is just text
    req = _decode("completion", {"prompt": ["null", "x"], "stream": "on"})
    assert req.prompt == ["null", "x"]  # type: ignore[attr-defined]
    assert req.stream is True  # type: ignore[attr-defined]
