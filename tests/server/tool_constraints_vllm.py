"""Run the tool-constraint cases through vLLM 0.32 (not a test module).

Executed in vLLM's python by tests/vllm_tier/test_tools_parity.py (and by hand, to
refresh tests/server/data/tool_constraints.json): prints, keyed ``parser/case``, what
vLLM's chat serving sends the engine for the request (``structured_outputs`` fields
that are set, ``skip_special_tokens``), or the error it answers.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import tool_constraint_cases as cases


def main() -> None:
    import dataclasses

    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.parser.parser_manager import ParserManager

    class Tokenizer:
        def get_vocab(self) -> dict[str, int]:
            return {"<tool_call>": 1, "</tool_call>": 2, "<|python_tag|>": 3}

    out: dict[str, object] = {}
    for parser_name in cases.PARSERS:
        cls = ParserManager.get_parser(tool_parser_name=parser_name, enable_auto_tools=True)
        assert cls is not None
        for name, fields in cases.CASES:
            key = f"{parser_name}/{name}"
            try:
                request = ChatCompletionRequest(
                    model="m", messages=[{"role": "user", "content": "q"}], **fields
                )
                if request.tool_choice != "none":  # vLLM's renderer: adjust unless none
                    parser = cls(Tokenizer(), request.tools, chat_template_kwargs={})
                    request = parser.adjust_request(request)
                params = request.to_sampling_params(16, {})
            except Exception as exc:
                out[key] = {"error": f"{type(exc).__name__}: {exc}"}
                continue
            so = params.structured_outputs
            out[key] = {
                "structured_outputs": None
                if so is None
                else {
                    f.name: getattr(so, f.name)
                    for f in dataclasses.fields(so)
                    if not f.name.startswith("_") and getattr(so, f.name) not in (None, False)
                },
                "skip_special_tokens": params.skip_special_tokens,
            }
    sys.stdout.write("@@RESULT@@" + json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
