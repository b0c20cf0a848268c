"""Structured outputs, sans-I/O: vLLM's frontend checks (the STRUCTURED rules), the
backend choice, the choice grammar and the grammar check (llguidance)."""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING

import msgspec
import pytest

from trio_vllm import InvalidRequestError, SamplingParams, StructuredOutputsParams
from trio_vllm.protocol import rules as R
from trio_vllm.protocol import structured
from trio_vllm.protocol.structured import choice_as_grammar, resolve_structured_outputs
from trio_vllm.text._input import InputProcessor

from ._vectors import repo_vector_files

if TYPE_CHECKING:
    from pathlib import Path

S = StructuredOutputsParams
AUTO = R.Limits(structured_output_backend="auto")


def _verdict(so: StructuredOutputsParams, limits: R.Limits = AUTO) -> str | None:
    v = R.STRUCTURED.check(so, limits)
    return None if v is None else str(v)


def test_one_constraint_with_vllms_message() -> None:
    assert _verdict(S(regex="a")) is None
    assert _verdict(S(json_object=True)) is None
    none = _verdict(S())
    assert none is not None
    assert none.startswith("You must use one kind of structured outputs constraint but none")
    # vLLM shows the dataclass's __dict__, private fields too, in declaration order.
    assert none.endswith(
        "{'json': None, 'regex': None, 'choice': None, 'grammar': None, "
        "'json_object': None, 'disable_any_whitespace': False, "
        "'disable_additional_properties': False, 'whitespace_pattern': None, "
        "'structural_tag': None, '_backend': None, '_backend_was_auto': False}"
    )
    two = _verdict(S(regex="a", grammar="root ::= 'a'"))
    assert two is not None
    assert two.startswith("You can only use one kind of structured outputs constraint but multiple")


@pytest.mark.parametrize(
    ("so", "message"),
    [
        (S(choice=[]), "Choice '[]' cannot be an empty list"),
        (S(grammar=" \n"), "structured_outputs.grammar cannot be an empty string"),
        (S(json="  "), "structured_outputs.json cannot be an empty string"),
        (
            S(json_object=False),
            "structured_outputs.json_object must be True if set; omit structured_outputs "
            "to disable structured outputs",
        ),
        (
            S(regex="a\x00b"),
            "structured_outputs.regex must not contain a NUL character ('\\x00')",
        ),
        (S(structural_tag=""), "structured_outputs.structural_tag cannot be an empty string"),
        (
            S(regex="a", _backend="guidance"),
            "Request-level structured output backend selection is not supported. The "
            "request specified 'guidance', but vLLM was initialised with 'auto'. This error "
            "can be resolved by removing '_backend' from the request.",
        ),
    ],
)
def test_frontend_checks_with_vllms_messages(so: StructuredOutputsParams, message: str) -> None:
    assert _verdict(so) == message


def test_nesting_bound_is_vllms() -> None:
    def deep(levels: int) -> object:
        spec: object = 1
        for _ in range(levels):
            spec = [spec]
        return spec

    ok, too_deep = {"a": deep(63)}, {"a": deep(64)}  # the dict is one level
    assert _verdict(S(json=ok)) is None  # type: ignore[arg-type]
    assert _verdict(S(json=too_deep)) == (  # type: ignore[arg-type]
        "The JSON schema is nested too deeply: objects and arrays may nest at most 64 levels"
    )
    assert _verdict(S(json=msgspec.json.encode(too_deep).decode())) is not None
    assert _verdict(S(json="{not json")) is None  # left to the backend's message


def test_a_backend_the_frontend_chose_is_accepted_again() -> None:
    resolved = resolve_structured_outputs(S(regex="a+"))
    assert (resolved._backend, resolved._backend_was_auto) == ("xgrammar", True)
    assert _verdict(resolved) is None  # vLLM: backend == "auto" and _backend_was_auto
    assert _verdict(resolved, R.Limits(structured_output_backend="guidance")) is not None
    assert _verdict(resolved, R.Limits()) is None  # the configured backend unknown


def test_choice_grammar_is_vllms() -> None:
    assert choice_as_grammar(["yes", "no"]) == 'root ::= "yes" | "no"'
    assert choice_as_grammar(['a"b', "c\\d", "e\nf", "\x01"]) == (
        'root ::= "a\\"b" | "c\\\\d" | "e\\nf" | "\\u0001"'
    )


def test_auto_picks_xgrammar_and_sends_a_choice_as_its_grammar() -> None:
    given = S(choice=["yes", "no"])
    out = resolve_structured_outputs(given)
    assert out.choice is None
    assert out.grammar == 'root ::= "yes" | "no"'
    assert (out._backend, out._backend_was_auto) == ("xgrammar", True)
    assert given.choice == ["yes", "no"]
    assert given._backend is None
    fixed = resolve_structured_outputs(S(choice=["a"]), "xgrammar")
    assert (fixed.grammar, fixed._backend, fixed._backend_was_auto) == (
        'root ::= "a"',
        "xgrammar",
        False,
    )


@pytest.mark.parametrize("backend", ["guidance", "outlines", "lm-format-enforcer"])
def test_other_backends_keep_the_choice(backend: str) -> None:
    out = resolve_structured_outputs(S(choice=["a", "b"]), backend)
    assert (out.choice, out.grammar, out._backend, out._backend_was_auto) == (
        ["a", "b"],
        None,
        backend,
        False,
    )


def test_unknown_backend_is_a_programming_error() -> None:
    with pytest.raises(ValueError, match="unknown structured-output backend"):
        resolve_structured_outputs(S(regex="a"), "gbnf")


def test_invalid_json_text_is_refused_without_a_grammar_library() -> None:
    with pytest.raises(InvalidRequestError, match=r"^Invalid JSON grammar specification\.$"):
        resolve_structured_outputs(S(json="{oops"), check_grammar=False)


needs_llguidance = pytest.mark.skipif(
    not structured.grammar_checker_available(), reason="llguidance not installed"
)


@needs_llguidance
@pytest.mark.parametrize(
    ("so", "start"),
    [
        (S(regex="a+("), 'Grammar error: at 1(8): invalid regex "a+("'),
        (S(json={"type": "objectx"}), "Grammar error: Invalid type: objectx"),
        (S(json='{"type": "objectx"}'), "Grammar error: Invalid type: objectx"),
        (
            S(grammar='root ::= "a'),
            "Invalid grammar specification: Failed to convert the grammar from GBNF to Lark",
        ),
    ],
)
@pytest.mark.parametrize("backend", ["auto", "guidance"])
def test_bad_grammar_gets_guidances_message(
    so: StructuredOutputsParams, start: str, backend: str
) -> None:
    with pytest.raises(InvalidRequestError) as info:
        resolve_structured_outputs(so, backend)
    assert str(info.value).startswith(start), str(info.value)
    assert info.value.param is None
    resolve_structured_outputs(so, backend, check_grammar=False)  # the check is the library's


@needs_llguidance
@pytest.mark.parametrize(
    "so",
    [
        S(regex=r"\d{3}-[a-z]+"),
        S(json={"type": "object", "properties": {"n": {"type": "integer"}}}),
        S(json_object=True),
        S(grammar='root ::= "a" | "b"'),
        S(choice=["x", "y"]),
    ],
)
def test_good_grammar_passes(so: StructuredOutputsParams) -> None:
    assert resolve_structured_outputs(so)._backend == "xgrammar"


def test_without_llguidance_the_grammar_is_left_to_the_engine(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(structured, "_llguidance", lambda: None)
    monkeypatch.setattr(structured, "_warned", [])
    with caplog.at_level(logging.WARNING, logger="trio_vllm"):
        out = resolve_structured_outputs(S(regex="a+("))
        resolve_structured_outputs(S(regex="b"))
    assert out._backend == "xgrammar"
    warned = [r.getMessage() for r in caplog.records if "llguidance" in r.getMessage()]
    assert len(warned) == 1  # once per process
    assert "pip install 'trio-vllm[structured]'" in warned[0]


def _processor(backend: str = "auto") -> InputProcessor:
    return InputProcessor(
        None, max_model_len=64, vocab_size=260, structured_outputs_backend=backend
    )


def test_text_layer_resolves_a_copy() -> None:
    given = SamplingParams(max_tokens=4, structured_outputs=S(choice=["a", "b"]))
    for params in (given, msgspec.structs.replace(given, skip_clone=True)):
        sent = _processor().prepare_params(params, 3)
        assert sent.structured_outputs is not None
        assert sent.structured_outputs.grammar == 'root ::= "a" | "b"'
        assert sent.structured_outputs._backend == "xgrammar"
        assert params.structured_outputs is not None
        assert params.structured_outputs.choice == ["a", "b"]  # the caller's is unchanged
        assert params.structured_outputs._backend is None
    guided = _processor("guidance").prepare_params(given, 3).structured_outputs
    assert guided is not None
    assert guided._backend == "guidance"
    assert guided.choice == ["a", "b"]


def test_text_layer_refuses_with_vllms_messages() -> None:
    with pytest.raises(InvalidRequestError, match="cannot be an empty list"):
        _processor().prepare_params(
            SamplingParams(max_tokens=4, structured_outputs=S(choice=[])), 3
        )
    with pytest.raises(InvalidRequestError, match="Request-level structured output backend"):
        _processor().prepare_params(
            SamplingParams(max_tokens=4, structured_outputs=S(regex="a", _backend="outlines")), 3
        )


def test_raw_requests_must_name_a_backend() -> None:
    from trio_vllm.protocol.validation import check_sampling_params

    bare = SamplingParams(max_tokens=4, temperature=1.0, structured_outputs=S(regex="a"))
    verdict = check_sampling_params(bare)
    assert verdict is not None
    assert verdict.rule is R.SAMPLING_WIRE["structured_backend"]
    named = msgspec.structs.replace(
        bare, structured_outputs=resolve_structured_outputs(S(regex="a"))
    )
    assert check_sampling_params(named) is None
    # A raw request breaking the one-constraint rule would wedge the engine's decoder.
    worse = msgspec.structs.replace(bare, structured_outputs=S(regex="a", choice=["b"]))
    verdict = check_sampling_params(worse)
    assert verdict is not None
    assert "multiple are specified" in str(verdict)


@pytest.mark.parametrize(
    "path",
    # The recorded structured-output ADDs; the directory holds other families too.
    [p for p in repo_vector_files() if p.stem.startswith("add_structured_")],
    ids=lambda p: p.stem,
)
def test_resolution_matches_vllms_frontend(path: Path) -> None:
    """vLLM's own frontend resolved these constraints (backend auto) when recording them."""
    vector = json.loads(path.read_text())
    given = S(**vector["given_structured_outputs"])
    sent = vector["value"]["sampling_params"]["structured_outputs"]
    assert msgspec.structs.asdict(resolve_structured_outputs(given)) == sent


@pytest.mark.parametrize(
    ("schema", "backend"),
    [
        ({"type": "integer", "multipleOf": 3}, "guidance"),
        ({"type": "string", "format": "color"}, "guidance"),
        ({"allOf": [{"type": "string"}, {"enum": ["yes", "no"]}]}, "guidance"),
        ({"type": "object", "properties": {"x": {"type": "number", "multipleOf": 2}}}, "guidance"),
        (
            {"type": "object", "patternProperties": {"^a": {}}, "properties": {"b": {}}},
            "outlines",
        ),
        ({"type": "string", "format": "email"}, "xgrammar"),
    ],
)
def test_auto_falls_back_where_xgrammar_lacks_a_schema_feature(
    schema: dict[str, object], backend: str
) -> None:
    """vLLM's ``has_xgrammar_unsupported_json_features``: auto then picks guidance (or
    outlines for what guidance lacks too); tests/vllm_tier checks it against vLLM."""
    out = resolve_structured_outputs(S(json=schema), check_grammar=False)
    assert (out._backend, out._backend_was_auto) == (backend, True)
