"""The responders' prebuilt event templates give the bytes the general path gives."""

from __future__ import annotations

import json

import pytest

from trio_vllm.server._openai import _MARK, ChatResponder, CompletionResponder, GenerationPlan
from trio_vllm.text import CompletionOutput, RequestOutput

TEXTS = ["", "a", ' "q" \\ ', "日本", "🎉\n\t", "\x00\x1f", "", "end"]


def _plan(n: int, request_id: str, model: str, echo: bool) -> GenerationPlan:
    return GenerationPlan(
        request_id=request_id, model=model, prompts=[{"prompt_token_ids": [1, 2, 3]}],
        engine_ids=["e"], params=[], n=n, stream=True, include_usage=True,
        continuous_usage=False, logprobs=None, return_token_ids=False,
        echo_texts=["pre"] if echo else None,
    )  # fmt: skip


def _outputs(n: int) -> list[RequestOutput]:
    outs = []
    for k, text in enumerate(TEXTS):
        last = k == len(TEXTS) - 1
        completions = [
            CompletionOutput(i, text, [] if not text else [k], None, None,
                             "length" if last else None, None)
            for i in range(n)
        ]  # fmt: skip
        outs.append(RequestOutput("e", None, [1, 2, 3], None, completions, last, 0))
    return outs


@pytest.mark.parametrize("cls", [CompletionResponder, ChatResponder])
@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize(
    ("request_id", "model"),
    [("cmpl-1", "m"), ('id "\\\x00 日', "model\x00x"), ("x", "\x00trio-vllm-"), ("x", _MARK)],
)
@pytest.mark.parametrize("echo", [False, True])
def test_templates_match_the_general_path(
    cls: type[CompletionResponder | ChatResponder],
    n: int,
    request_id: str,
    model: str,
    echo: bool,
) -> None:
    fast = cls(_plan(n, request_id, model, echo), None, "fp")  # type: ignore[arg-type]
    slow = cls(_plan(n, request_id, model, echo), None, "fp")  # type: ignore[arg-type]
    assert fast.use_templates
    slow.use_templates = False
    outs = _outputs(n)
    fast_bytes = [fast.on_outputs(0, outs[:3]), *(fast.on_output(0, o) for o in outs[3:])]
    slow_bytes = [slow.on_output(0, o) for o in outs]
    assert b"".join(fast_bytes) == b"".join(slow_bytes)
    assert fast.finish() == slow.finish()
    assert fast.completion_tokens == slow.completion_tokens == n * 6
    # The templates were used, except where the model name holds the mark itself.
    assert list(fast._templates) == list(range(n))
    assert all((t is None) == (model == _MARK) for t in fast._templates.values())
    # Sanity: the events are JSON carrying each text once per choice, in order.
    events = [json.loads(e[len(b"data: "):]) for e in b"".join(fast_bytes).split(b"\n\n")
              if e]  # fmt: skip
    assert all(e["id"] == request_id and e["model"] == model for e in events)
