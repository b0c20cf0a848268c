"""Run the parser cases through vLLM 0.32's own parser classes (not a test module).

Executed in vLLM's python by tests/text/test_parsers_vllm.py (and by hand, to refresh
tests/text/data/parser_parity.json): prints ``{"tools": {...}, "reasoning": {...}}``,
keyed ``parser/case``, each value what ``parser_cases.drive_*`` returns.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import parser_cases


def main() -> None:
    from vllm.reasoning.deepseek_r1_reasoning_parser import DeepSeekR1ReasoningParser
    from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser
    from vllm.tool_parsers.llama_tool_parser import Llama3JsonToolParser
    from vllm.tool_parsers.pythonic_tool_parser import PythonicToolParser

    tool_classes = {
        "hermes": Hermes2ProToolParser,
        "llama3_json": Llama3JsonToolParser,
        "pythonic": PythonicToolParser,
    }
    from vllm.reasoning.qwen3_engine_reasoning_parser import Qwen3ParserReasoningAdapter

    def qwen3_nothink(tokenizer: object) -> object:
        return Qwen3ParserReasoningAdapter(
            tokenizer, chat_template_kwargs={"enable_thinking": False}
        )

    reasoning_classes = {
        "deepseek_r1": DeepSeekR1ReasoningParser,
        "qwen3": Qwen3ParserReasoningAdapter,
        "qwen3_nothink": qwen3_nothink,
    }
    tokenizer = parser_cases.FakeTokenizer()

    from vllm.entrypoints.generate.base.protocol import DeltaMessage

    def to_data(result: object) -> object:
        # A streamed delta as vLLM's chat serving sends it (exclude_unset: a field set
        # to None is null); anything else without its None fields.
        if isinstance(result, DeltaMessage):
            return result.model_dump(exclude_unset=True)
        return result.model_dump(exclude_none=True)  # type: ignore[attr-defined]

    class Adapted:
        """vLLM's parsers take the request as a last argument; these parsers ignore it."""

        def __init__(self, parser: object) -> None:
            self.parser = parser

        def __getattr__(self, name: str) -> object:
            return getattr(self.parser, name)

        def extract_tool_calls(self, text: str) -> object:
            return self.parser.extract_tool_calls(text, None)  # type: ignore[attr-defined]

        def extract_tool_calls_streaming(self, *args: object) -> object:
            return self.parser.extract_tool_calls_streaming(*args, None)  # type: ignore[attr-defined]

        def extract_reasoning(self, text: str) -> object:
            return self.parser.extract_reasoning(text, None)  # type: ignore[attr-defined]

    out: dict[str, dict[str, object]] = {"tools": {}, "reasoning": {}}
    for name, case, deltas in parser_cases.TOOL_CASES:
        cls = tool_classes[name]
        out["tools"][f"{name}/{case}"] = parser_cases.drive_tool_parser(
            lambda cls=cls: Adapted(cls(tokenizer)), to_data, deltas
        )
    for name, case, deltas in parser_cases.REASONING_CASES:
        cls = reasoning_classes[name]
        out["reasoning"][f"{name}/{case}"] = parser_cases.drive_reasoning_parser(
            lambda cls=cls: Adapted(cls(tokenizer)), to_data, deltas
        )
    out["chain"] = _chains(tokenizer, to_data)
    sys.stdout.write("@@RESULT@@" + json.dumps(out, indent=1, sort_keys=True, ensure_ascii=False))


def _chains(tokenizer: object, to_data: object) -> dict[str, object]:
    """The server-side chain: vLLM's composed DelegatingParser, driven as its chat
    serving drives it (``parse``; ``parse_delta`` with the request)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.parser.parser_manager import ParserManager

    class Chain:
        def __init__(self, parser: object, request: object) -> None:
            self.parser, self.request = parser, request

        def parse(self, text: str) -> object:
            reasoning, content, calls = self.parser.parse(  # type: ignore[attr-defined]
                text, self.request, enable_auto_tools=True
            )
            if calls is not None:
                calls = [{"name": c.name, "arguments": c.arguments} for c in calls]
            return reasoning, content, calls

        def parse_delta(self, delta: str, ids: list[int], prompt: list[int], *, finished: bool):  # type: ignore[no-untyped-def]
            return self.parser.parse_delta(  # type: ignore[attr-defined]
                delta, ids, self.request, prompt_token_ids=prompt, finished=finished
            )

    results: dict[str, object] = {}
    for reasoning, tool, choice, case, deltas in parser_cases.CHAIN_CASES:
        cls = ParserManager.get_parser(
            tool_parser_name=tool or None,
            reasoning_parser_name=reasoning or None,
            enable_auto_tools=True,
        )
        assert cls is not None

        def make(cls: object = cls, choice: str = choice) -> Chain:
            request = ChatCompletionRequest(
                messages=[{"role": "user", "content": "q"}],
                tools=parser_cases.CHAIN_TOOLS,
                tool_choice=parser_cases.chain_choice(choice),
            )
            parser = cls(tokenizer, request.tools, chat_template_kwargs={})  # type: ignore[operator]
            return Chain(parser, request)

        results[f"{reasoning}+{tool}/{choice}/{case}"] = parser_cases.drive_chain(
            make,
            lambda r: r if isinstance(r, dict) else to_data(r),
            deltas,  # type: ignore[operator]
        )
    return results


if __name__ == "__main__":
    main()
