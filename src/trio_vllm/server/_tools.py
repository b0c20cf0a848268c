"""Tool calling and reasoning in ``/v1/chat/completions``, as ``vllm serve`` 0.32 does
them with ``--enable-auto-tool-choice``, ``--tool-call-parser NAME`` and
``--reasoning-parser NAME``.

Requests: vLLM's ``tools``/``tool_choice`` validation and messages; the tools go to the
chat template; parsers that need the model's markup tokens turn
``skip_special_tokens`` off, as their ``adjust_request`` does. Responses: each choice
runs through a `ChatOutputParser` (the text layer's port of vLLM's serving-side
parser): ``reasoning``, ``content`` and ``tool_calls`` of the message or of each
streamed delta, finish reason ``tool_calls`` when the parser found calls (for
``required`` too; a named tool's choice keeps the engine's reason, as in vLLM).
``tool_choice`` ``required`` and named (and ``auto`` with a strict tool or
``parallel_tool_calls: false``) constrain the output with the structured output vLLM
derives from the tools (`trio_vllm.text.tools.tool_choice_constraint`: a structural
tag for ``hermes``/``llama3_json``, a JSON schema for ``pythonic``);
``parallel_tool_calls: false`` also keeps only the first call of a response.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec
from msgspec import UNSET

from ..text.reasoning import REASONING_PARSERS, reasoning_parser_class
from ..text.tools import TOOL_PARSERS, ChatOutputParser, make_tool_call_id, tool_parser_class
from ._http import HTTPError, validation_error

if TYPE_CHECKING:
    from ..text.tools import DeltaMessage, FunctionCall
    from ._frontend import TokenizerLike
    from ._schemas import ChatCompletionRequest

__all__ = [
    "UNPORTED_TOOL_PARSERS",
    "ChoiceParsers",
    "ToolOptions",
    "check_tools",
    "delta_fields",
    "skip_special_tokens",
    "tool_choice_of",
]

#: vLLM 0.32 tool parsers trio-vllm knows by name but has not ported, and why; with
#: ``--enable-auto-tool-choice`` the server refuses to start with them (see
#: `ToolOptions.check_tokenizer`).
UNPORTED_TOOL_PARSERS: dict[str, str] = {
    "mistral": (
        "vLLM 0.32 builds it on mistral_common and its parser engine (a grammar from "
        "mistral_common's tokenizer for v11+ models, an ijson event stream for older "
        "ones); trio-vllm has not ported it"
    ),
}
# The token vLLM's MistralParser looks up first (mistral_common's SpecialTokens).
_MISTRAL_TOOL_CALLS = "[TOOL_CALLS]"

_CORRECT_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'


class ToolOptions(msgspec.Struct, frozen=True):
    """The server's tool and reasoning flags (vllm serve's spelling).

    Raises `ValueError` for an unknown parser name, and for
    ``enable_auto_tool_choice`` without ``tool_call_parser`` (vLLM refuses to start).
    """

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
        known = TOOL_PARSERS.keys() | UNPORTED_TOOL_PARSERS.keys()
        if self.tool_call_parser is not None and self.tool_call_parser not in known:
            raise ValueError(
                f"invalid tool call parser: {self.tool_call_parser} "
                f"(chose from {{ {', '.join(sorted(known))} }})"
            )
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"invalid reasoning parser: {self.reasoning_parser} "
                f"(chose from {{ {', '.join(sorted(REASONING_PARSERS))} }})"
            )

    def check_tokenizer(self, tokenizer: TokenizerLike, model: str) -> None:
        """vLLM's startup check (``ParserManager.validate_parser_tokenizer``): build
        the active parsers once with the model's tokenizer; `ValueError` with vLLM's
        message if one cannot work with it (a marker token missing), and for a parser
        named in `UNPORTED_TOOL_PARSERS`."""
        flags = []
        active = self.active_tool_parser
        if active is not None:
            flags.append(f"--tool-call-parser {active}")
        if self.reasoning_parser is not None:
            flags.append(f"--reasoning-parser {self.reasoning_parser}")
        error: Exception | None = None
        if self.reasoning_parser is not None:  # vLLM's composed parser builds it first
            try:
                reasoning_parser_class(self.reasoning_parser)(tokenizer)
            except RuntimeError as exc:
                error = exc
        if error is None and active is not None:
            if active not in UNPORTED_TOOL_PARSERS:
                try:
                    tool_parser_class(active)(tokenizer, None)
                except RuntimeError as exc:
                    error = exc
            elif tokenizer.token_to_id(_MISTRAL_TOOL_CALLS) is None:
                # What vLLM's parser raises first for such a tokenizer.
                error = RuntimeError(
                    "Mistral parser could not locate the tool call token in the tokenizer!"
                )
            else:
                raise ValueError(
                    f"--tool-call-parser {active} is not supported by trio-vllm: "
                    f"{UNPORTED_TOOL_PARSERS[active]}"
                )
        if error is not None:
            raise ValueError(
                f"{' and '.join(flags)} cannot be used with the tokenizer of {model!r}: {error}"
            )

    @property
    def active_tool_parser(self) -> str | None:
        """The tool parser that runs: vLLM builds none without
        ``--enable-auto-tool-choice``, whatever ``--tool-call-parser`` says."""
        return self.tool_call_parser if self.enable_auto_tool_choice else None

    @property
    def has_parser(self) -> bool:
        """A per-request parser runs (vLLM: a tool or a reasoning parser is active)."""
        return self.active_tool_parser is not None or self.reasoning_parser is not None


def tool_choice_of(req: ChatCompletionRequest) -> str | dict[str, Any] | None:
    """``tool_choice`` as vLLM reads it: ``"auto"`` when tools come without one."""
    if req.tool_choice is None and req.tools:
        return "auto"
    return req.tool_choice


def check_tools(req: ChatCompletionRequest, options: ToolOptions) -> None:
    """vLLM's checks of ``tools`` and ``tool_choice`` (its protocol validator, then its
    renderer), with its messages; `HTTPError` (400). The validator's errors name their
    parameter, so their text ends with `` (parameter=...)`` as vLLM's does."""
    if req.tools == []:
        raise validation_error(
            "`tools` must not be an empty array. "
            "Either provide at least one tool or omit the field entirely.",
            "tools",
        )
    choice = tool_choice_of(req)
    if choice is None or choice == "none":
        return
    if req.tools is None:
        raise validation_error("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if choice not in ("auto", "required") and not isinstance(choice, dict):
        raise validation_error(
            f"Invalid value for `tool_choice`: {choice}! "
            'Only named tools, "none", "auto" or "required" are supported.',
            "tool_choice",
        )
    if isinstance(choice, dict):
        function = choice.get("function")
        if not isinstance(function, dict):
            raise validation_error(
                f"Invalid value for `function`: `{function}` in `tool_choice`! {_CORRECT_USAGE}",
                "tool_choice.function",
            )
        if "name" not in function:
            raise validation_error(
                f"Expected field `name` in `function` in `tool_choice`! {_CORRECT_USAGE}",
                "tool_choice.function.name",
            )
        name = function["name"]
        if not isinstance(name, str) or not name:
            raise validation_error(
                f"Invalid `name` in `function`: `{name}` in `tool_choice`! {_CORRECT_USAGE}",
                "tool_choice.function.name",
            )
        if not any(
            isinstance(t.get("function"), dict) and t["function"].get("name") == name
            for t in req.tools
        ):
            raise validation_error(
                "The tool specified in `tool_choice` does not match any of the specified `tools`",
                "tool_choice",
            )
    # The renderer's checks (vLLM's messages; no param).
    if options.active_tool_parser is None:
        if choice == "auto" and not options.enable_auto_tool_choice:
            raise HTTPError(
                '"auto" tool choice requires --enable-auto-tool-choice and '
                "--tool-call-parser to be set"
            )
        if choice != "auto":
            desc = (
                f'function "{choice["function"]["name"]}"'
                if isinstance(choice, dict)
                else (f'"{choice}"')
            )
            raise HTTPError(f"tool_choice={desc} requires --tool-call-parser to be set")


def skip_special_tokens(req: ChatCompletionRequest, options: ToolOptions, choice: object) -> bool:
    """The request's ``skip_special_tokens`` after the parsers' ``adjust_request``:
    off for a tool parser that turns it off (``hermes``: its markers may be special
    tokens) when tools are used, and always for the engine-based ``qwen3`` reasoning
    parser."""
    active = options.active_tool_parser
    if (
        active is not None
        and tool_parser_class(active).keeps_special_tokens
        and req.tools
        and choice != "none"
    ):
        return False
    if options.reasoning_parser == "qwen3":
        return False
    return req.skip_special_tokens


class ChoiceParsers:
    """The per-choice parsers of one chat request, and what its response needs."""

    def __init__(
        self,
        req: ChatCompletionRequest,
        options: ToolOptions,
        tokenizer: TokenizerLike,
        n: int,
        choice: str | dict[str, Any] | None,
    ) -> None:
        self.options = options
        self.tool_choice = choice
        self.parsers: list[ChatOutputParser] = []
        try:
            self._build(req, options, tokenizer, n, choice)
        except RuntimeError as exc:  # the model's vocabulary lacks the parser's markers
            raise HTTPError(str(exc)) from None
        self.tools_streamed = [False] * n
        self.named = isinstance(choice, dict)
        self.forced = self.named or choice == "required"
        # vLLM's maybe_filter_parallel_tool_calls: only an explicit false keeps one call.
        self.single_call = req.parallel_tool_calls is False

    def _build(
        self,
        req: ChatCompletionRequest,
        options: ToolOptions,
        tokenizer: TokenizerLike,
        n: int,
        choice: str | dict[str, Any] | None,
    ) -> None:
        tools = req.tools
        kwargs = req.chat_template_kwargs
        for _ in range(n):
            reasoning = (
                reasoning_parser_class(options.reasoning_parser)(
                    tokenizer, chat_template_kwargs=kwargs
                )
                if options.reasoning_parser is not None
                else None
            )
            active = options.active_tool_parser
            tool = tool_parser_class(active)(tokenizer, tools) if active is not None else None
            self.parsers.append(
                ChatOutputParser(
                    reasoning,
                    tool,
                    tool_choice=choice,
                    enable_auto_tools=options.enable_auto_tool_choice,
                )
            )

    def message(
        self, i: int, text: str, finish_reason: str | None
    ) -> tuple[str | None, str | None, list[dict[str, Any]], str]:
        """``(reasoning, content, tool_calls, finish_reason)`` of choice ``i``'s
        complete text (vLLM's chat_completion_full_generator branches)."""
        reasoning, content, calls = self.parsers[i].parse(text)
        reason = finish_reason or "stop"
        tools: list[dict[str, Any]] = []
        if self.forced:
            # vLLM: content "" rather than null, and every call the parser read.
            content = content or ""
            tools = [_tool_call(c) for c in calls or ()]
            if self.tool_choice == "required" and finish_reason == "stop":
                reason = "tool_calls"
        elif (
            self.tool_choice in ("auto", None)
            and self.options.active_tool_parser is not None
            and calls
        ):
            tools = [_tool_call(c) for c in calls]
            reason = "tool_calls"
        if self.single_call:
            tools = tools[:1]
        return reasoning, content, tools, reason

    def delta(
        self, i: int, text: str, token_ids: list[int], prompt_ids: list[int], finished: bool
    ) -> DeltaMessage | None:
        """Choice ``i``'s streamed delta, or ``None`` for nothing to send."""
        message = self.parsers[i].parse_delta(text, token_ids, prompt_ids, finished=finished)
        if message is not None and message.tool_calls:
            self.tools_streamed[i] = True
            if self.single_call:  # vLLM filters after counting the call as streamed
                message.tool_calls = [c for c in message.tool_calls if c.index == 0]
        return message

    def finish_reason(self, i: int, reason: str | None) -> str:
        """``tool_calls`` for a choice that streamed calls and stopped, unless a named
        tool was forced (vLLM)."""
        if self.tools_streamed[i] and not self.named and reason == "stop":
            return "tool_calls"
        return reason or "stop"


def _tool_call(call: FunctionCall) -> dict[str, Any]:
    return {
        "id": make_tool_call_id(),
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


def delta_fields(message: DeltaMessage) -> dict[str, Any]:
    """A parser delta as the JSON fields of a stream chunk's ``delta``: the fields the
    parser set, ``None`` ones included (vLLM's ``exclude_unset``)."""
    out: dict[str, Any] = {}
    if message.role is not UNSET:
        out["role"] = message.role
    if message.content is not UNSET:
        out["content"] = message.content
    if message.reasoning is not UNSET:
        out["reasoning"] = message.reasoning
    if message.tool_calls:
        out["tool_calls"] = msgspec.to_builtins(message.tool_calls)
    return out
