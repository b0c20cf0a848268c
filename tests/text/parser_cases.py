"""Tool-call and reasoning parser cases, shared by our tests and vLLM's interpreter.

Standard library only: ``parsers_vllm.py`` imports this file in vLLM's python (which has
no trio-vllm) to feed the very same deltas to vLLM's parser classes. A case is a model
output cut into the deltas a stream would deliver; ``drive`` feeds it to a parser both
whole (``extract_*``) and delta by delta (``extract_*_streaming``, with the token ids
of `delta_ids`), and returns every result as plain JSON data.
"""

from __future__ import annotations

import json
import zlib
from typing import Any

# Marker tokens of the fake vocabulary (Qwen2.5/Llama 3 ids); any other text is one
# ordinary token per delta piece.
VOCAB: dict[str, int] = {
    "<tool_call>": 151657,
    "</tool_call>": 151658,
    "<think>": 151667,
    "</think>": 151668,
    "<|python_tag|>": 128010,
    "<|im_start|>": 151644,
    "<|im_end|>": 151645,
}
# Text between markers: one token per stretch, its id derived from the text (the same
# on both sides, whatever order the cases run in); `FakeTokenizer.decode` reads it back.
_PLAIN: dict[int, str] = {}


class FakeTokenizer:
    """What both sides' parsers ask of a tokenizer: the vocabulary (vLLM's
    ``get_vocab``), a token's id (ours)."""

    def get_vocab(self) -> dict[str, int]:
        return dict(VOCAB)

    def token_to_id(self, token: str) -> int | None:
        return VOCAB.get(token)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        by_id = {v: k for k, v in VOCAB.items()}
        return "".join(by_id[i] if i in by_id else _PLAIN[i] for i in ids)

    def __len__(self) -> int:
        return 300000


def _plain_id(text: str) -> int:
    token_id = 200000 + zlib.crc32(text.encode()) % 90000
    _PLAIN[token_id] = text
    return token_id


def delta_ids(text: str) -> list[int]:
    """Token ids of one delta: each marker its id, each stretch between markers one
    ordinary token."""
    ids: list[int] = []
    rest = text
    while rest:
        found = [(rest.find(m), m) for m in VOCAB if m in rest]
        if not found:
            ids.append(_plain_id(rest))
            break
        pos, marker = min(found)
        if pos:
            ids.append(_plain_id(rest[:pos]))
        ids.append(VOCAB[marker])
        rest = rest[pos + len(marker) :]
    return ids


def chars(text: str, size: int = 3) -> list[str]:
    """``text`` in pieces of ``size`` characters (a stream of small tokens)."""
    return [text[i : i + size] for i in range(0, len(text), size)]


_WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
_TIME = '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}'

# (parser name, case name, deltas)
TOOL_CASES: list[tuple[str, str, list[str]]] = [
    ("hermes", "plain-text", ["Hel", "lo", " world", "."]),
    ("hermes", "one-call", ["<tool_call>", "\n", *chars(_WEATHER, 5), "\n", "</tool_call>"]),
    (
        "hermes",
        "one-call-big-deltas",
        ["<tool_call>\n" + _WEATHER[:30], _WEATHER[30:] + "\n</tool_call>"],
    ),
    (
        "hermes",
        "content-then-call-split-tag",
        ["Sure, ", "let me check.<tool", "_call>", *chars(_WEATHER, 7), "</tool", "_call>"],
    ),
    (
        "hermes",
        "two-calls",
        [
            "<tool_call>",
            *chars(_WEATHER, 9),
            "</tool_call>",
            "\n",
            "<tool_call>",
            *chars(_TIME, 9),
            "</tool_call>",
        ],
    ),
    ("hermes", "unclosed-call", ["<tool_call>", *chars(_TIME, 4)]),
    (
        "hermes",
        "bad-json",
        ["<tool_call>", '{"name": "f", ', '"arguments": {oops}}', "</tool_call>"],
    ),
    (
        "hermes",
        "no-arguments-unicode",
        ["<tool_call>", '{"name": "ping"', ', "arguments": {}}', "</tool_call>", " déjà vu"],
    ),
    ("hermes", "partial-tag-never-completed", ["a <tool", "_c", "x"]),
    ("llama3_json", "plain-text", ["The ", "answer ", "is 4."]),
    (
        "llama3_json",
        "one-call-parameters",
        chars('{"name": "get_weather", "parameters": {"city": "Paris"}}', 4),
    ),
    ("llama3_json", "python-tag", ["<|python_tag|>", *chars(_WEATHER, 6)]),
    ("llama3_json", "two-calls", chars(_WEATHER + "; " + _TIME, 5)),
    ("llama3_json", "text-then-json", ["Calling: ", *chars(_TIME, 8)]),
    ("llama3_json", "missing-name", chars('{"arguments": {"x": 1}}', 4)),
    (
        "llama3_json",
        "nested-args",
        chars('{"name": "f", "arguments": {"a": [1, 2, {"b": null}], "c": true}}', 3),
    ),
    ("pythonic", "one-call", chars("[get_weather(city='Paris', unit='celsius')]", 4)),
    (
        "pythonic",
        "two-calls",
        chars("[get_weather(city='Paris'), get_time(tz='UTC', offset=-2)]", 5),
    ),
    ("pythonic", "plain-text", ["I cannot ", "call tools."]),
    ("pythonic", "literals", chars("[f(a=True, b=None, c=[1, 2.5], d={'k': 'v'}, e=false)]", 3)),
    ("pythonic", "no-arguments", chars("[ping()]", 2)),
    ("pythonic", "malformed", chars("[f(a=1]", 2)),
    ("pythonic", "one-big-delta", ["[get_time(tz='UTC')]"]),
]

REASONING_CASES: list[tuple[str, str, list[str]]] = [
    (
        "deepseek_r1",
        "start-end-content",
        ["<think>", "Let me ", "think.", "</think>", "The ", "answer."],
    ),
    ("deepseek_r1", "no-start-token", ["Reason", "ing", "</think>", "Answer"]),
    ("deepseek_r1", "end-inside-delta", ["<think>", "abc</think>def", " more"]),
    ("deepseek_r1", "start-and-end-in-one-delta", ["<think>ab</think>cd", "ef"]),
    ("deepseek_r1", "no-end", ["<think>", "still ", "thinking"]),
    ("deepseek_r1", "end-without-content", ["<think>", "x", "</think>"]),
    ("deepseek_r1", "no-markers", ["just ", "text"]),
    ("deepseek_r1", "start-token-with-text", ["<think>hm", " ok", "</think>", "done"]),
    (
        "qwen3",
        "start-end-content",
        ["<think>", "\n", "Let me ", "think.", "\n", "</think>", "\n\n", "The ", "answer."],
    ),
    ("qwen3", "no-start-token", ["Reason", "ing", "</think>", "Answer"]),
    ("qwen3", "end-inside-delta", ["<think>", "abc</think>def", " more"]),
    ("qwen3", "start-and-end-in-one-delta", ["<think>ab</think>cd", "ef"]),
    ("qwen3", "no-end", ["<think>", "still ", "thinking"]),
    ("qwen3", "end-without-content", ["<think>", "x", "</think>"]),
    ("qwen3", "whitespace-content-at-end", ["<think>", "x", "</think>", "\n\n"]),
    ("qwen3", "no-markers", ["just ", "text"]),
    (
        "qwen3",
        "tool-call-ends-reasoning",
        ["<think>", "plan", "</think>", "\n", "<tool_call>", '\n{"name": "f"}\n', "</tool_call>"],
    ),
    ("qwen3", "tool-call-without-end", ["<think>", "plan ", "<tool_call>", "{}", "</tool_call>"]),
    ("qwen3", "marker-text-split-across-deltas", ["ab</th", "ink>cd"]),
    ("qwen3", "partial-marker-at-end", ["<think>", "x </thi"]),
    ("qwen3", "angle-brackets", ["a < b > c", " <fun", "ction=x>", " </think> y>"]),
    (
        "qwen3",
        "second-end-and-start-in-content",
        ["r", "</think>", "c1", "</think>", "<think>", "c2"],
    ),
    ("qwen3_nothink", "markers-are-content", ["<think>", "a", "</think>", "b"]),
    ("qwen3_nothink", "plain", ["\n", "hello"]),
]


def _plain(value: Any) -> Any:
    """A parser result as JSON data: empty ``tool_calls`` dropped (vLLM's serializer
    drops them), each tool-call id replaced by ``"<id>"`` once checked to be
    vLLM-shaped. ``None`` values stay: in a streamed delta they are the fields a parser
    set to ``null`` (the ``to_data`` of each side leaves out the unset ones)."""
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if key == "tool_calls" and item == []:
                continue
            if key == "id" and isinstance(item, str):
                if item is None:
                    out[key] = None
                    continue
                if not item.startswith("chatcmpl-tool-"):
                    raise AssertionError(f"tool call id {item!r}")
                item = "<id>"
            out[key] = _plain(item)
        return out
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def drive_tool_parser(make: Any, to_data: Any, deltas: list[str]) -> dict[str, Any]:
    """Feed ``deltas`` to fresh parsers from ``make()``: the non-streaming result, the
    streamed deltas, and the state the server reads after the stream."""
    whole = "".join(deltas)
    extracted = make().extract_tool_calls(whole)
    parser = make()
    stream: list[Any] = []
    previous_text, previous_ids = "", []
    for delta in deltas:
        ids = delta_ids(delta)
        current_text, current_ids = previous_text + delta, previous_ids + ids
        result = parser.extract_tool_calls_streaming(
            previous_text, current_text, delta, previous_ids, current_ids, ids
        )
        stream.append(None if result is None else _plain(to_data(result)))
        previous_text, previous_ids = current_text, current_ids
    return {
        "extracted": _plain(to_data(extracted)),
        "stream": stream,
        "prev_tool_call_arr": json.loads(json.dumps(parser.prev_tool_call_arr)),
        "streamed_args_for_tool": list(parser.streamed_args_for_tool),
        "remaining": parser.get_remaining_unstreamed_args(),
    }


def drive_reasoning_parser(make: Any, to_data: Any, deltas: list[str]) -> dict[str, Any]:
    """As `drive_tool_parser`, for a reasoning parser."""
    whole = "".join(deltas)
    reasoning, content = make().extract_reasoning(whole)
    parser = make()
    stream: list[Any] = []
    previous_text, previous_ids = "", []
    for delta in deltas:
        ids = delta_ids(delta)
        current_text, current_ids = previous_text + delta, previous_ids + ids
        result = parser.extract_reasoning_streaming(
            previous_text, current_text, delta, previous_ids, current_ids, ids
        )
        stream.append(None if result is None else _plain(to_data(result)))
        previous_text, previous_ids = current_text, current_ids
    # Engine-based parsers (qwen3) hold text back until the stream's end.
    if getattr(parser, "engine_based_streaming", False):
        result = parser.finish_streaming()
        stream.append({"finish": None if result is None else _plain(to_data(result))})
    all_ids = [i for d in deltas for i in delta_ids(d)]
    return {
        "extracted": [reasoning, content],
        "stream": stream,
        "is_reasoning_end": parser.is_reasoning_end(all_ids),
        "content_ids": parser.extract_content_ids(all_ids),
    }


# The server's per-choice chain (vLLM's DelegatingParser; ours ChatOutputParser):
# (reasoning parser or "", tool parser or "", tool_choice, case name, deltas).
_REQUIRED = (
    '[{"name": "get_weather", "parameters": {"city": "Paris", "n": [1, {"a": "]"}]}}, '
    '{"name": "get_weather", "parameters": {"city": "Ro\\"me"}}]'
)
_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CHAIN_CASES: list[tuple[str, str, str, str, list[str]]] = [
    ("", "hermes", "auto", "call-after-text", ["Let me ", "check.", *chars(_CALL, 9)]),
    ("", "hermes", "auto", "plain", ["no ", "tools ", "here"]),
    ("", "hermes", "none", "markup-is-content", ["x", *chars(_CALL, 11)]),
    ("deepseek_r1", "hermes", "auto", "think-then-call",
     ["<think>", "I should ", "call.", "</think>", "\n\n", *chars(_CALL, 8)]),
    ("deepseek_r1", "", "auto", "think-then-answer", ["<think>", "hm", "</think>", "Yes", "."]),
    ("qwen3", "hermes", "auto", "qwen3-think-then-call",
     ["<think>", "\n", "plan", "\n", "</think>", "\n\n", *chars(_CALL, 10)]),
    ("qwen3", "", "auto", "qwen3-think-then-answer",
     ["<think>", "a", "</think>", "\n\n", "B", "!"]),
    ("qwen3", "", "auto", "qwen3-end-and-text-in-one-delta", ["<think>x</think>\n\nok", " done"]),
    ("qwen3", "", "auto", "qwen3-never-ends", ["<think>", "a </th"]),
    ("qwen3", "hermes", "none", "qwen3-tools-none", ["r", "</think>", "t", *chars(_CALL, 13)]),
    # tool_choice required / named: hermes is constrained by a structural tag and reads
    # its output as auto does; pythonic by a JSON schema, read as that schema's shape.
    ("", "hermes", "required", "required-call", chars(_CALL, 7)),
    ("", "hermes", "required", "required-nothing", [" ", "\n"]),
    ("", "hermes", "named:get_weather", "named-call", chars(_CALL, 12)),
    ("", "pythonic", "required", "required-two", chars(_REQUIRED, 5)),
    ("", "pythonic", "required", "required-one-delta", [_REQUIRED]),
    ("", "pythonic", "required", "required-not-an-array", chars('{"name": "x"}', 4)),
    ("", "pythonic", "required", "required-bad-parameters",
     ['[{"name": "get_weather", ', '"parameters": 3}]']),
    ("", "pythonic", "named:get_weather", "named-args", chars('{"city": "Paris"}', 4)),
    ("", "pythonic", "named:get_weather", "named-blank", [" "]),
    ("deepseek_r1", "pythonic", "required", "think-then-required",
     ["<think>", "hm", "</think>", *chars(_REQUIRED, 9)]),
    ("deepseek_r1", "pythonic", "named:get_weather", "think-then-named",
     ["<think>", "hm", "</think>", '{"city"', ': "Oslo"}']),
]  # fmt: skip
CHAIN_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]


def chain_choice(choice: str) -> str | dict[str, Any]:
    """A case's ``tool_choice``: ``named:NAME`` is the named-tool object."""
    if choice.startswith("named:"):
        return {"type": "function", "function": {"name": choice.removeprefix("named:")}}
    return choice


CHAIN_PROMPT_IDS = [151644, 872, 198, 151645]  # <|im_start|>user\n<|im_end|>: no reasoning end


def drive_chain(make: Any, to_data: Any, deltas: list[str]) -> dict[str, Any]:
    """The non-streaming ``parse`` and every ``parse_delta`` (the last one finished) of
    fresh chains from ``make()``; tool-call ids checked and replaced."""
    reasoning, content, calls = make().parse("".join(deltas))
    chain = make()
    stream: list[Any] = []
    for k, delta in enumerate(deltas):
        result = chain.parse_delta(
            delta, delta_ids(delta), CHAIN_PROMPT_IDS, finished=k == len(deltas) - 1
        )
        stream.append(None if result is None else _plain(to_data(result)))
    return {
        "parse": [reasoning, content, None if calls is None else [to_data(c) for c in calls]],
        "stream": stream,
    }
