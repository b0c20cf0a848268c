"""Chat templates (transformers' apply_chat_template environment) and message parsing."""

from __future__ import annotations

import re
from datetime import datetime

import pytest

from trio_vllm import InvalidRequestError
from trio_vllm.text import Tokenizer, normalize_messages, render_chat_template


def test_tiny_llama_chatml(tiny: Tokenizer) -> None:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert render_chat_template(msgs, tokenizer=tiny) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert not render_chat_template(msgs, tokenizer=tiny, add_generation_prompt=False).endswith(
        "assistant\n"
    )


def test_content_parts_are_flattened_to_text() -> None:
    msgs = normalize_messages(
        [
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            {"role": "assistant", "content": None, "extra": 1},
        ]
    )
    assert msgs == [{"role": "user", "content": "a\nb"}, {"role": "assistant", "content": ""}]
    with pytest.raises(InvalidRequestError, match="image_url"):
        normalize_messages([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])
    with pytest.raises(InvalidRequestError, match="role"):
        normalize_messages([{"content": "x"}])
    with pytest.raises(InvalidRequestError, match="list"):
        normalize_messages("hello")  # type: ignore[arg-type]


def test_tool_call_arguments_are_parsed() -> None:
    (msg,) = normalize_messages(
        [
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "1",
                        "type": "function",
                        "function": {"name": "f", "arguments": '{"x": 1}'},
                    }
                ],
            }
        ]
    )
    assert msg["tool_calls"][0]["function"]["arguments"] == {"x": 1}


def test_environment_matches_transformers(tiny: Tokenizer) -> None:
    template = (
        "{% for m in messages %}\n"
        "    {% if true %}{{ bos_token }}{% endif %}{{ m['content'] | tojson }}\n"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ eos_token }}{% endif %}"
        "{{ strftime_now('%Y') }}{{ extra }}"
        "{% for i in range(3) %}{% if i == 1 %}{% break %}{% endif %}{{ i }}{% endfor %}"
    )
    out = render_chat_template(
        [{"role": "user", "content": "héllo <b>"}],
        tokenizer=tiny,
        chat_template=template,
        chat_template_kwargs={"extra": "!"},
    )
    # trim_blocks and lstrip_blocks: no newline or indentation from the block tags;
    # tojson keeps non-ASCII and does not HTML-escape; loopcontrols has break.
    assert out == f'<s>"héllo <b>"\n</s>{datetime.now().year}!0'


def test_template_errors_are_invalid_requests(tiny: Tokenizer) -> None:
    with pytest.raises(InvalidRequestError, match="roles must alternate"):
        render_chat_template(
            [{"role": "user", "content": "x"}],
            tokenizer=tiny,
            chat_template="{{ raise_exception('roles must alternate') }}",
        )
    with pytest.raises(InvalidRequestError, match="does not parse"):
        render_chat_template([], tokenizer=tiny, chat_template="{% for %}")
    with pytest.raises(InvalidRequestError, match=re.escape("chat_template_kwargs")):
        render_chat_template([], tokenizer=tiny, chat_template_kwargs={"tokenize": True})


def test_sandbox_refuses_unsafe_access(tiny: Tokenizer) -> None:
    with pytest.raises(InvalidRequestError):
        render_chat_template(
            [], tokenizer=tiny, chat_template="{{ ''.__class__.__mro__[1].__subclasses__() }}"
        )
    with pytest.raises(InvalidRequestError):  # immutable: no mutation of the messages
        render_chat_template(
            [{"role": "user", "content": "x"}],
            tokenizer=tiny,
            chat_template="{{ messages.append(1) }}",
        )


def test_no_template() -> None:
    with pytest.raises(InvalidRequestError, match="no chat template"):
        render_chat_template([{"role": "user", "content": "x"}])


def test_continue_final_message(tiny: Tokenizer) -> None:
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Once upon"}]
    text = render_chat_template(
        msgs, tokenizer=tiny, add_generation_prompt=False, continue_final_message=True
    )
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nOnce upon"
    via_kwargs = render_chat_template(
        msgs,
        tokenizer=tiny,
        chat_template_kwargs={"continue_final_message": True, "add_generation_prompt": False},
    )
    assert via_kwargs == text
    with pytest.raises(InvalidRequestError, match="Cannot set both"):
        render_chat_template(msgs, tokenizer=tiny, continue_final_message=True)


def test_developer_messages_become_one_system_message(tiny: Tokenizer) -> None:
    msgs = [
        {"role": "system", "content": "A"},
        {"role": "user", "content": "Hi"},
        {"role": "developer", "content": "B"},
    ]
    text = render_chat_template(msgs, tokenizer=tiny)
    assert text.startswith("<|im_start|>system\nA\n\nB<|im_end|>\n<|im_start|>user\nHi")
    assert "developer" not in text
    aware = "{% for m in messages %}{{ m.role }}:{{ m.content }};{% endfor %}{# 'developer' #}"
    assert render_chat_template(msgs, tokenizer=tiny, chat_template=aware) == (
        "system:A;user:Hi;developer:B;"
    )
