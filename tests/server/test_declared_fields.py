"""Every request field the server declares is implemented or refused, never dropped.

Table-driven over `DECLARED_FIELDS` (each declared field of the completions, chat and
embeddings request structs) and `UNSUPPORTED_FIELDS` (vLLM's generation fields trio-vllm
does not declare). Sans-I/O: the
ASGI app is called in this process with a stand-in frontend (the real tokenizer of the
shipped tiny-llama directory; no engine, no socket):

* an "implemented" field, set to a sample value, changes the plan the server would send
  (prompt ids, ``SamplingParams``, response flags; for embeddings the prompts, the
  ``PoolingParams`` and the answer built from a fixed vector) against the same request
  without it;
* an "accepted" field (vLLM does nothing with it either) leaves the plan as it is;
* a "refused" field gets HTTP 400 whose ``param`` names it, and nothing is generated.

A new declared field fails `test_every_declared_field_has_a_sample` until it gets a
sample here: flipping a field from refused to implemented is one entry in each table.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

import msgspec
import pytest

from trio_vllm.protocol import LoRARequest
from trio_vllm.reference_engine import TINY_LLAMA_DIR
from trio_vllm.server import OpenAIServer, ToolOptions
from trio_vllm.server._decode import decode_request
from trio_vllm.server._embeddings import (
    EmbeddingRequest,
    decode_embedding_request,
    embedding_response,
    plan_embedding,
    pooling_params,
)
from trio_vllm.server._openai import GenerationPlan, plan_chat, plan_completion
from trio_vllm.server._schemas import (
    DECLARED_FIELDS,
    UNSUPPORTED_FIELDS,
    ChatCompletionRequest,
    CompletionRequest,
)
from trio_vllm.text import (
    EmbeddingOutput,
    EmbeddingRequestOutput,
    SamplingDefaults,
    load_tokenizer,
)

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

pytestmark = pytest.mark.anyio

_TOKENIZER = load_tokenizer(TINY_LLAMA_DIR)
_PATHS = {
    "completion": "/v1/completions",
    "chat": "/v1/chat/completions",
    "embedding": "/v1/embeddings",
}
_GENERATION = ("chat", "completion")
_BASE: dict[str, dict[str, Any]] = {
    "completion": {"prompt": "hello"},
    "chat": {"messages": [{"role": "user", "content": "hello"}]},
    "embedding": {"input": "hello"},
}
_VECTOR = [0.25, -0.5, 1.0]


class _Client:
    live_requests: list[str] = []  # noqa: RUF012 - read-only here

    async def wait_dead(self) -> Any:
        raise AssertionError("not used")


class _Frontend:
    """The server's view of the text layer, without engines: generating is a failure."""

    tokenizer = _TOKENIZER
    model_name = "tiny-llama"
    max_model_len = 512
    client = _Client()
    sampling_defaults = SamplingDefaults()
    dead = False

    def generate(self, *args: object, **kwargs: object) -> Any:
        raise AssertionError("a refused request reached generate")

    async def embed(self, prompts: list[Any], **kwargs: object) -> list[EmbeddingRequestOutput]:
        # Only requests the server accepted get here: one fixed vector per prompt.
        self.embed_calls.append(kwargs)
        return [_embedded(p) for p in prompts]

    def __init__(self) -> None:
        self.embed_calls: list[dict[str, object]] = []

    def render_chat(
        self,
        messages: Sequence[Mapping[str, object]],
        *,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, object] | None = None,
        tools: Sequence[Mapping[str, object]] | None = None,
    ) -> tuple[str, list[int]]:
        # Every argument shows in the prompt, so a dropped one shows in the plan.
        text = json.dumps(
            [list(messages), add_generation_prompt, chat_template, chat_template_kwargs, tools],
            sort_keys=True,
        )
        return text, _TOKENIZER.encode(text, add_special_tokens=False)


def _embedded(prompt: object) -> EmbeddingRequestOutput:
    ids = _TOKENIZER.encode(prompt) if isinstance(prompt, str) else [1, 2]
    return EmbeddingRequestOutput("r", EmbeddingOutput(list(_VECTOR)), ids, 0, True)


_TOOL = {"type": "function", "function": {"name": "f", "parameters": {}}}

# field -> (extra base fields the sample needs, the sample value)
_SAMPLES: dict[str, dict[str, tuple[dict[str, Any], object]]] = {
    "shared": {
        "model": ({}, "tiny-llama"),
        "frequency_penalty": ({}, 0.5),
        "presence_penalty": ({}, 0.5),
        "repetition_penalty": ({}, 1.2),
        "logit_bias": ({}, {"5": 1.0}),
        "seed": ({}, 7),
        "stop": ({}, ["x"]),
        "stream": ({}, True),
        "stream_options": ({"stream": True}, {"include_usage": True}),
        "temperature": ({}, 0.5),
        "top_p": ({}, 0.5),
        "top_k": ({}, 5),
        "min_p": ({}, 0.1),
        "user": ({}, "someone"),
        "stop_token_ids": ({}, [5]),
        "include_stop_str_in_output": ({}, True),
        "ignore_eos": ({}, True),
        "min_tokens": ({}, 2),
        "skip_special_tokens": ({}, False),
        "spaces_between_special_tokens": ({}, False),
        "allowed_token_ids": ({}, [104, 101]),
        "bad_words": ({}, ["x"]),
        "prompt_logprobs": ({}, 2),
        "request_id": ({}, "my-id"),
        "return_token_ids": ({}, True),
        "use_beam_search": ({}, True),
        "priority": ({}, 1),
        "response_format": ({}, {"type": "json_object"}),
        "structured_outputs": ({}, {"regex": "[a-z]+"}),
    },
    "completion": {
        "prompt": ({}, "other"),
        "echo": ({}, True),
        "logprobs": ({}, 2),
        "max_tokens": ({}, 5),
        "n": ({}, 2),
        "suffix": ({}, "zz"),
        "add_special_tokens": ({}, False),
    },
    "chat": {
        "messages": ({}, [{"role": "user", "content": "other"}]),
        "logprobs": ({}, True),
        "top_logprobs": ({"logprobs": True}, 2),
        "max_tokens": ({}, 5),
        "max_completion_tokens": ({}, 5),
        "n": ({}, 2),
        "echo": ({}, True),
        "add_generation_prompt": ({}, False),
        "continue_final_message": ({}, True),
        "add_special_tokens": ({}, True),
        "chat_template": ({}, "{{ messages[0]['content'] }}"),
        "chat_template_kwargs": ({}, {"x": 1}),
        "tools": ({}, [_TOOL]),
        "tool_choice": ({"tools": [_TOOL]}, "none"),
        # a single call: the tools' grammar stops after one (and one call is kept)
        "parallel_tool_calls": ({"tools": [_TOOL], "tool_choice": "required"}, False),
    },
    "embedding": {
        "input": ({}, ["other", "two"]),
        "model": ({}, "tiny-llama"),
        "encoding_format": ({}, "base64"),
        "dimensions": ({}, 2),
        "user": ({}, "someone"),
        "use_activation": ({}, False),
        "add_special_tokens": ({}, False),
        "embed_dtype": ({}, "float16"),
        "endianness": ({"encoding_format": "base64"}, "big"),
        "request_id": ({}, "my-id"),
        "padding": ({}, "max_length"),
        "truncate_prompt_tokens": ({}, 3),
        "truncation_side": ({}, "left"),
        "priority": ({}, 1),
        "mm_processor_kwargs": ({}, {"a": 1}),
        "cache_salt": ({}, "salt"),
    },
}

_STRUCTS: dict[str, type[msgspec.Struct]] = {
    "completion": CompletionRequest,
    "chat": ChatCompletionRequest,
    "embedding": EmbeddingRequest,
}


def _sample(kind: str, name: str) -> tuple[dict[str, Any], object]:
    return _SAMPLES[kind].get(name) or _SAMPLES["shared"][name]


def _cases(support: str) -> list[tuple[str, str]]:
    return [
        (kind, name)
        for kind, table in DECLARED_FIELDS.items()
        for name, status in table.items()
        if status == support
    ]


class _Sent:
    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []

    async def __call__(self, message: dict[str, Any]) -> None:
        self.messages.append(message)

    @property
    def status(self) -> int:
        return int(self.messages[0]["status"])

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.messages[1:])


async def _call(app: OpenAIServer, path: str, body: dict[str, Any]) -> _Sent:
    data = json.dumps(body).encode()
    scope = {
        "type": "http",
        "method": "POST",
        "path": path,
        "headers": [(b"content-type", b"application/json")],
    }
    chunks = [{"type": "http.request", "body": data, "more_body": False}]

    async def receive() -> dict[str, Any]:
        return chunks.pop(0) if chunks else {"type": "http.disconnect"}

    sent = _Sent()
    await app(scope, receive, sent)  # type: ignore[arg-type]
    return sent


# Plans are built as `trio-vllm serve --enable-auto-tool-choice --tool-call-parser hermes`
# (without the flags a request with tools gets a 400, as from vllm serve).
_TOOL_FLAGS = ToolOptions(enable_auto_tool_choice=True, tool_call_parser="hermes")


def _plan(kind: str, body: dict[str, Any]) -> Any:
    """What the server would send (and answer) for ``body``: a `GenerationPlan`, or for
    an embedding the prompts, the pooling parameters and the answer to fixed vectors."""
    if kind == "embedding":
        ereq = decode_embedding_request(b"application/json", json.dumps(body).encode())
        prompts = plan_embedding(ereq, _TOKENIZER)
        answer = json.loads(embedding_response(ereq, [_embedded(p) for p in prompts], "tiny-llama"))
        del answer["created"]
        if ereq.request_id is None:  # a random id unless the request names one
            answer["id"] = answer["id"][:5]
        return {
            "prompts": prompts,
            "params": msgspec.structs.asdict(pooling_params(ereq)),
            "answer": answer,
        }
    app = OpenAIServer(_Frontend(), tool_options=_TOOL_FLAGS)  # type: ignore[arg-type]
    req, extra = decode_request(kind, b"application/json", json.dumps(body).encode())  # type: ignore[arg-type]
    if kind == "completion":
        return plan_completion(
            req, app.llm, model="tiny-llama", header_request_id="fixed", extra=extra
        )
    return plan_chat(
        req,
        app.llm,
        model="tiny-llama",
        header_request_id="fixed",
        extra=extra,
        tool_options=app.tool_options,
        trust_request_chat_template=True,  # as --trust-request-chat-template
    )


def _snapshot(plan: Any) -> dict[str, object]:
    if not isinstance(plan, GenerationPlan):
        return dict(plan)
    out = {name: getattr(plan, name) for name in GenerationPlan.__slots__ if name != "created"}
    out["params"] = [msgspec.structs.asdict(p) for p in plan.params]
    # The per-choice parsers are fresh objects per plan: compare what they parse for.
    out["parsers"] = None if plan.parsers is None else (plan.parsers.tool_choice, plan.n)
    return out


def _app(kind: str) -> OpenAIServer:
    tasks = ("embed",) if kind == "embedding" else ("generate",)
    return OpenAIServer(_Frontend(), supported_tasks=tasks)  # type: ignore[arg-type]


def test_the_tables_cover_the_request_structs() -> None:
    for kind, struct in _STRUCTS.items():
        assert set(DECLARED_FIELDS[kind]) == set(struct.__struct_fields__), kind
    assert set(DECLARED_FIELDS) == set(_STRUCTS)
    for kind in _GENERATION:  # the generation endpoints' undeclared vLLM fields
        assert not UNSUPPORTED_FIELDS.keys() & DECLARED_FIELDS[kind].keys()


def test_every_declared_field_has_a_sample() -> None:
    for kind, table in DECLARED_FIELDS.items():
        missing = [n for n in table if n not in _SAMPLES[kind] and n not in _SAMPLES["shared"]]
        assert not missing, f"{kind}: give these a sample value: {missing}"


@pytest.mark.parametrize(("kind", "name"), _cases("implemented"))
def test_an_implemented_field_changes_the_plan(kind: str, name: str) -> None:
    extra, value = _sample(kind, name)
    base = {**_BASE[kind], **extra}
    if name == "request_id" and kind != "embedding":  # the X-Request-Id header wins
        plan = _plan(kind, {**base, name: value})
        assert plan.request_id.endswith("-fixed")
        return
    if name == "model":  # checked against the served names by the app, not the plan
        app = OpenAIServer(_Frontend())  # type: ignore[arg-type]
        assert app._check_model(str(value)) == "tiny-llama"
        with pytest.raises(Exception, match="does not exist"):
            app._check_model("another-model")
        return  # the embeddings endpoint's own check: test_embedding_model_is_checked
    before, after = _snapshot(_plan(kind, base)), _snapshot(_plan(kind, {**base, name: value}))
    assert before != after, f"{kind}.{name} = {value!r} changed nothing: dropped"


async def test_embedding_model_is_checked() -> None:
    app = _app("embedding")
    sent = await _call(app, _PATHS["embedding"], {"input": "a", "model": "tiny-llama"})
    assert sent.status == 200, sent.body
    assert json.loads(sent.body)["data"][0]["embedding"] == _VECTOR
    sent = await _call(app, _PATHS["embedding"], {"input": "a", "model": "another-model"})
    assert sent.status == 404, sent.body
    assert json.loads(sent.body)["error"]["message"] == "The model `another-model` does not exist."
    # a LoRA adapter's name is a model: its request pools with the adapter
    adapter = LoRARequest("ad", 1, "/nowhere")
    app.loras.requests["ad"] = adapter
    sent = await _call(app, _PATHS["embedding"], {"input": "a", "model": "ad"})
    assert sent.status == 200, sent.body
    assert json.loads(sent.body)["model"] == "ad"
    frontend: Any = app.llm
    assert [c["lora_request"] for c in frontend.embed_calls] == [None, adapter]


@pytest.mark.parametrize(("kind", "name"), _cases("accepted"))
def test_an_accepted_field_changes_nothing(kind: str, name: str) -> None:
    extra, value = _sample(kind, name)
    base = {**_BASE[kind], **extra}
    assert _snapshot(_plan(kind, base)) == _snapshot(_plan(kind, {**base, name: value}))


@pytest.mark.parametrize(("kind", "name"), _cases("refused"))
async def test_a_refused_field_gets_400_naming_it(kind: str, name: str) -> None:
    extra, value = _sample(kind, name)
    app = _app(kind)
    sent = await _call(app, _PATHS[kind], {**_BASE[kind], **extra, name: value})
    assert sent.status == 400, sent.body
    error = json.loads(sent.body)["error"]
    assert error["param"] == name, error
    # its default is no refusal (the plan is built)
    default = msgspec.structs.fields(_STRUCTS[kind])
    (field,) = [f for f in default if f.name == name]
    _plan(kind, {**_BASE[kind], **extra, name: field.default})


_REFUSED_VALUES: dict[str, object] = {}


@pytest.mark.parametrize("name", sorted(UNSUPPORTED_FIELDS))
@pytest.mark.parametrize("kind", _GENERATION)
async def test_an_undeclared_vllm_field_is_refused_unless_harmless(
    kind: str, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    app = OpenAIServer(_Frontend())  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING, logger="trio_vllm.server"):
        sent = await _call(app, _PATHS[kind], {**_BASE[kind], name: _REFUSED_VALUES.get(name, 1)})
    assert sent.status == 400, sent.body
    assert json.loads(sent.body)["error"]["param"] == name
    baseline = _snapshot(_plan(kind, _BASE[kind]))
    for accepted in UNSUPPORTED_FIELDS[name]:
        assert _snapshot(_plan(kind, {**_BASE[kind], name: accepted})) == baseline
    # refused or accepted, it was not ignored: the warning does not name it
    assert not any("ignored" in r.getMessage() for r in caplog.records)


def test_response_format_text_is_accepted() -> None:
    # vLLM treats {"type": "text"} as no structured output.
    for kind in _PATHS:
        _plan(kind, {**_BASE[kind], "response_format": {"type": "text"}})


def test_the_ignored_warning_names_only_ignored_fields(caplog: pytest.LogCaptureFixture) -> None:
    body = {**_BASE["completion"], "frobnicate": 3, "response_format": {"type": "text"}}
    with caplog.at_level(logging.WARNING, logger="trio_vllm.server"):
        _plan("completion", body)
    (record,) = [r for r in caplog.records if "ignored" in r.getMessage()]
    assert record.getMessage().endswith("ignored: ['frobnicate']")


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"prompt": "a", "suffix": "z", "echo": True}, "Echo is unsupported with suffix."),
        ({"prompt": "a", "suffix": ""},
         "suffix is only supported for models with FIM completion rendering"),
        ({"prompt": ["a", "b"], "suffix": "z"},
         "suffix is only supported for models with FIM completion rendering"),
        ({"prompt": [1, 2], "suffix": "z"},
         "suffix requires text prompt input for FIM completion rendering"),
    ],
)  # fmt: skip
async def test_suffix_as_vllm_answers_it(body: dict[str, Any], message: str) -> None:
    # vLLM 0.32.0 (renderers/online_renderer.py): only a FIM renderer takes a suffix.
    app = OpenAIServer(_Frontend())  # type: ignore[arg-type]
    sent = await _call(app, "/v1/completions", body)
    assert sent.status == 400
    error = json.loads(sent.body)["error"]
    assert (error["message"], error["param"], error["type"]) == (
        message,
        "suffix",
        "BadRequestError",
    )


@pytest.mark.parametrize(
    "path", ["/v1/embeddings", "/v1/responses", "/classify", "/pooling", "/score", "/v1/rerank"]
)
async def test_endpoints_not_served_answer_as_vllm_serve_without_them(path: str) -> None:
    # vllm serve 0.32.0 on a generative model: /v1/embeddings, /pooling, /v1/rerank, ...
    # are not routed: FastAPI's 404 {"detail": "Not Found"}; with --api-key its
    # middleware answers 401 first on /v1 paths (checked live, see the notes of issue 27).
    app = OpenAIServer(_Frontend())  # type: ignore[arg-type]
    sent = await _call(app, path, {"input": "hi"})
    assert (sent.status, json.loads(sent.body)) == (404, {"detail": "Not Found"})
    keyed = OpenAIServer(_Frontend(), api_keys=["k"])  # type: ignore[arg-type]
    sent = await _call(keyed, path, {"input": "hi"})
    if path.startswith("/v1"):
        assert (sent.status, json.loads(sent.body)) == (401, {"error": "Unauthorized"})
    else:  # not guarded (as /tokenize there): the route decides
        assert (sent.status, json.loads(sent.body)) == (404, {"detail": "Not Found"})
