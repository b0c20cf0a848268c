"""Chat templates rendered as transformers' ``apply_chat_template`` does, messages as vLLM parses.

The template runs in jinja2's ``ImmutableSandboxedEnvironment`` with ``trim_blocks`` and
``lstrip_blocks``, the ``loopcontrols`` extension, transformers' ``tojson`` filter (no
HTML escaping, ``ensure_ascii=False``), and the globals ``raise_exception`` and
``strftime_now``. It sees ``messages``, ``tools``, ``documents``, ``add_generation_prompt``,
the tokenizer's named special tokens (``bos_token``, ``eos_token``...) and any
``chat_template_kwargs`` (which win over the special tokens, as in transformers).

Messages are normalized as vLLM's "string" content format does for text-only models: a
list of content parts becomes its text parts joined by ``"\\n"``, ``None`` content becomes
``""``; ``name``, an assistant's ``tool_calls`` (JSON ``arguments`` parsed into objects)
and ``reasoning``, and a tool message's ``tool_call_id`` are kept; other keys are dropped.
A template that does not name the ``developer`` role gets developer messages as system
messages, merged into one first system message (vLLM's rule). The rendered text is
tokenized without special tokens (the template writes them).
jinja2 is imported on first use.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from .._exceptions import InvalidRequestError

if TYPE_CHECKING:
    import jinja2

    from ._tokenizer import Tokenizer
    from ._types import ChatMessage

__all__ = ["normalize_messages", "render_chat_template"]


def _text_of_parts(role: str, parts: Sequence[object]) -> str:
    texts: list[str] = []
    for part in parts:
        if isinstance(part, str):
            texts.append(part)
            continue
        if not isinstance(part, Mapping):
            raise InvalidRequestError(f"a {role} message's content part must be an object")
        kind = part.get("type")
        if kind in ("text", "input_text", "output_text", "refusal"):
            value = part.get("text" if kind != "refusal" else "refusal")
            if not isinstance(value, str):
                raise InvalidRequestError(f"a {kind!r} content part needs a string")
            texts.append(value)
        elif kind is None and isinstance(part.get("text"), str):
            texts.append(str(part["text"]))
        else:
            raise InvalidRequestError(
                f"content part type {kind!r} is not supported by a text-only model"
            )
    return "\n".join(texts)


def normalize_messages(messages: Sequence[ChatMessage]) -> list[dict[str, object]]:
    """vLLM's conversation for a text-only model (see the module docstring).

    Raises `InvalidRequestError` for a malformed message.
    """
    given: object = messages  # callers from JSON may pass anything
    if isinstance(given, (str, bytes)) or not isinstance(given, Sequence):
        raise InvalidRequestError("messages must be a list of message objects")
    out: list[dict[str, object]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidRequestError(f"messages[{i}] must be an object")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidRequestError(f"messages[{i}] needs a string 'role'")
        content = message.get("content")
        if content is None:
            text = ""
        elif isinstance(content, str):
            text = content
        elif isinstance(content, Sequence):
            text = _text_of_parts(role, content)
        else:
            raise InvalidRequestError(f"messages[{i}].content must be a string or a list")
        msg: dict[str, Any] = {"role": role, "content": text}
        if role == "assistant":
            tool_calls = message.get("tool_calls")
            if tool_calls is not None:
                msg["tool_calls"] = _parse_tool_calls(i, tool_calls)
            reasoning = message.get("reasoning", message.get("reasoning_content"))
            if reasoning is not None:
                msg["reasoning"] = msg["reasoning_content"] = reasoning
        elif role == "tool" and "tool_call_id" in message:
            msg["tool_call_id"] = message["tool_call_id"]
        if isinstance(message.get("name"), str):
            msg["name"] = message["name"]
        if role == "developer":
            msg["tools"] = message.get("tools")
        out.append(msg)
    return out


def _parse_tool_calls(i: int, tool_calls: object) -> list[Any]:
    if not isinstance(tool_calls, Sequence) or isinstance(tool_calls, (str, bytes)):
        raise InvalidRequestError(f"messages[{i}].tool_calls must be a list")
    calls: list[Any] = []
    for call in tool_calls:
        if not isinstance(call, Mapping):
            raise InvalidRequestError("assistant tool_calls entries must be objects")
        call = dict(call)
        function = call.get("function")
        if isinstance(function, Mapping) and isinstance(function.get("arguments"), str):
            # Templates expect the arguments as an object, not the JSON text OpenAI sends.
            function = dict(function)
            try:
                function["arguments"] = json.loads(function["arguments"])
            except ValueError:
                raise InvalidRequestError(
                    f"messages[{i}]: tool call arguments are not valid JSON"
                ) from None
            call["function"] = function
        calls.append(call)
    return calls


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: object,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise InvalidRequestError(f"the chat template does not parse: {exc}") from exc


def render_chat_template(
    messages: Sequence[ChatMessage],
    *,
    tokenizer: Tokenizer | None = None,
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    tools: Sequence[Mapping[str, object]] | None = None,
    documents: Sequence[Mapping[str, object]] | None = None,
    chat_template_kwargs: Mapping[str, object] | None = None,
    continue_final_message: bool = False,
) -> str:
    """The prompt text of a conversation (the model's template unless ``chat_template``).

    ``continue_final_message`` (also accepted in ``chat_template_kwargs``, as vLLM passes
    it) ends the text inside the last message instead of closing it, so generation
    continues that message (transformers' rule; not with ``add_generation_prompt``).
    Raises `InvalidRequestError` when there is no template, a message is
    malformed, or the template raises (``raise_exception``: its message is kept).
    """
    import jinja2

    template = (
        chat_template
        if chat_template is not None
        else (tokenizer.chat_template if tokenizer is not None else None)
    )
    if template is None:
        raise InvalidRequestError(
            "the model has no chat template (tokenizer_config.json 'chat_template' or "
            "chat_template.jinja); pass one with chat_template="
        )
    kwargs = dict(chat_template_kwargs or {})
    for reserved in ("chat_template", "tokenize"):
        if reserved in kwargs:
            raise InvalidRequestError(f"chat_template_kwargs may not set {reserved!r}")
    continue_final_message = bool(kwargs.pop("continue_final_message", continue_final_message))
    if "add_generation_prompt" in kwargs:
        add_generation_prompt = bool(kwargs.pop("add_generation_prompt"))
    if continue_final_message and add_generation_prompt:
        raise InvalidRequestError(
            "Cannot set both continue_final_message and add_generation_prompt to True."
        )
    conversation: list[dict[str, Any]] = normalize_messages(messages)
    if any(m["role"] == "developer" for m in conversation) and not (
        '"developer"' in template or "'developer'" in template
    ):
        # vLLM: a template without the role gets developer messages as one system message.
        conversation = _developer_to_system(conversation)
    final_message = ""
    if continue_final_message:
        if not conversation:
            raise InvalidRequestError("continue_final_message needs a final message")
        if "content" not in template:
            raise InvalidRequestError(
                'continue_final_message is set to "content" but this is not an accepted '
                "field in the chat_template"
            )
        final_message = conversation[-1]["content"]
        conversation[-1]["content"] = final_message + _CONTINUE_TAG
    compiled = _compile(template)
    context: dict[str, Any] = dict(tokenizer.special_tokens_map) if tokenizer else {}
    context.update(kwargs)
    context.update(
        messages=conversation,
        tools=[dict(t) for t in tools] if tools is not None else None,
        documents=[dict(d) for d in documents] if documents is not None else None,
        add_generation_prompt=add_generation_prompt,
    )
    try:
        rendered = compiled.render(**context)
    except jinja2.TemplateError as exc:
        raise InvalidRequestError(str(exc)) from exc
    if not continue_final_message:
        return rendered
    # transformers: cut the text where the tag ended up, i.e. right after the final
    # message's content (keeping its trailing spaces when the template kept the tag's).
    tag = _CONTINUE_TAG.strip()
    if final_message.strip() not in rendered or tag not in rendered:
        raise InvalidRequestError(
            "continue_final_message is set but the final message does not appear in the chat "
            "after applying the chat template"
        )
    tag_loc = rendered.rindex(tag)
    if rendered[tag_loc : tag_loc + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:tag_loc]
    return rendered[:tag_loc].rstrip()


_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _developer_to_system(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    # vLLM's _convert_developer_to_system then _consolidate_system_messages.
    converted = []
    for msg in conversation:
        if msg["role"] == "developer":
            msg = {k: v for k, v in msg.items() if k != "tools"} | {"role": "system"}
        converted.append(msg)
    system_contents: list[str] = []
    others: list[dict[str, Any]] = []
    needs_merge = False
    for i, msg in enumerate(converted):
        if msg["role"] == "system":
            if i > 0 or system_contents:
                needs_merge = True
            if msg.get("content"):
                system_contents.append(msg["content"])
        else:
            others.append(msg)
    if not needs_merge:
        return converted
    return [{"role": "system", "content": "\n\n".join(system_contents)}, *others]
