"""``POST /v1/embeddings``: vLLM's OpenAI embeddings endpoint over ``LLM.embed``.

Offered only when the engines run the ``embed`` task (``vllm serve`` registers the
route only then, so a generate-only server answers 404, as vLLM's does). The input is
a string, a list of strings, a list of token ids or a list of such lists; every prompt
is tokenized and checked before anything is sent (the text layer's rules, vLLM's
messages); the answer carries one embedding per prompt, in order, as floats or as
base64 of the little-endian float32 bytes (vLLM's ``encoding_format``), and ``usage``
with the prompt tokens. ``dimensions`` is refused as vLLM refuses it for a model
without Matryoshka embeddings.
"""

from __future__ import annotations

import base64
import secrets
import time
from typing import TYPE_CHECKING, Any, Final, Literal, Protocol, cast

import msgspec
import numpy as np

from ..protocol import PoolingParams
from ._decode import decode_body, decode_value
from ._http import HTTPError
from ._schemas import DECLARED_FIELDS

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from ..protocol import LoRARequest
    from ..text import EmbeddingRequestOutput, Prompt

__all__ = [
    "EmbeddingFrontend",
    "EmbeddingRequest",
    "decode_embedding_request",
    "embedding_response",
    "plan_embedding",
]


class EmbeddingFrontend(Protocol):
    """What the endpoint needs of the text frontend (``trio_vllm.llm.LLM``)."""

    async def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        *,
        pooling_params: PoolingParams | None = None,
        lora_request: LoRARequest | None = None,
    ) -> list[EmbeddingRequestOutput]: ...


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    """The body of ``POST /v1/embeddings``: vLLM 0.32.0's ``EmbeddingCompletionRequest``,
    every field (`DECLARED_FIELDS` ``["embedding"]`` says which are refused)."""

    input: Any = msgspec.UNSET
    model: str | None = None
    encoding_format: Literal["float", "base64", "bytes", "bytes_only"] = "float"
    dimensions: int | None = None
    user: str | None = None
    use_activation: bool | None = None
    add_special_tokens: bool = True
    embed_dtype: Literal["float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"] = "float32"
    endianness: Literal["native", "big", "little"] = "native"
    request_id: str | None = None
    padding: Literal["max_length", "do_not_pad"] | None = None
    truncate_prompt_tokens: int | None = None
    truncation_side: Literal["left", "right"] | None = None
    priority: int = 0
    mm_processor_kwargs: dict[str, Any] | None = None
    cache_salt: str | None = None


FIELDS: Final = frozenset(EmbeddingRequest.__struct_fields__)
# strict=False: pydantic's lax mode (vLLM's), e.g. "2" for an int field.
DECODER: Final = msgspec.json.Decoder(EmbeddingRequest, strict=False)
# (field, default) for every refused field: any other value is a 400 naming it.
_REFUSED: Final = tuple(
    (f.name, f.default)
    for f in msgspec.structs.fields(EmbeddingRequest)
    if DECLARED_FIELDS["embedding"][f.name] == "refused"
)
_ENDIAN: Final = {"native": "=", "little": "<", "big": ">"}
_REMOVED_TASKS: Final = {  # vLLM's _REMOVED_POOLING_TASK_MESSAGES
    "score": "`score` task was removed; use `classify` instead.",
    "encode": "`encode` task was removed; use `token_embed` or `token_classify` instead.",
}


def _removed_parameters(raw: Mapping[str, msgspec.Raw]) -> None:
    # vLLM's reject_removed_pooling_parameters (a BeforeValidator: before any field). Its
    # VLLMValidationError escapes pydantic, so the message is str(exc), with the suffix.
    message = None
    if "normalize" in raw:
        message, param = (
            "Parameter `normalize` was removed; use `use_activation` instead.",
            "normalize",
        )
    elif "task" in raw:
        message, param = _REMOVED_TASKS.get(str(decode_value(raw["task"]))), "task"
    if message is not None:
        raise HTTPError(f"{message} (parameter={param})", param=param)


def decode_embedding_request(content_type: bytes | None, body: bytes) -> EmbeddingRequest:
    """The body through the server's one decode path (`decode_body`): `HTTPError` 400 in
    vLLM's shape for every malformed body, and 400 naming a refused field set to
    anything but its default; the removed ``normalize`` (and ``task`` ``"score"`` or
    ``"encode"``) get vLLM's 400 before any field is read. Unknown keys are logged as
    ignored, as vLLM's are."""
    req, _ = decode_body(DECODER, FIELDS, content_type, body, check_raw=_removed_parameters)
    for name, default in _REFUSED:
        if getattr(req, name) != default:
            raise HTTPError(f"`{name}` is not supported by trio-vllm serve.", param=name)
    return req


class _Usage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0
    prompt_tokens_details: None = None
    completion_tokens_details: None = None


class _Item(msgspec.Struct):
    index: int
    object: str
    embedding: list[float] | str


class _Response(msgspec.Struct):
    id: str
    object: str
    created: int
    model: str
    data: list[_Item]
    usage: _Usage


def _is_ids(value: object) -> bool:
    return isinstance(value, list) and all(type(t) is int for t in value)


def _invalid_input(detail: str, param: str | None = "body.input") -> HTTPError:
    # vLLM answers pydantic's dump of every union member that failed (type "Bad
    # Request", param the first error's location); ours gives the gist of it.
    return HTTPError(f"1 validation error:\n  {detail}", err_type="Bad Request", param=param)


def plan_embedding(req: EmbeddingRequest, tokenizer: Any) -> list[Prompt]:
    """The prompts of a request (token ids; text encoded as vLLM's renderer does), or
    `HTTPError` 400 for an input vLLM's schema refuses (a mixed batch, nothing)."""
    raw = req.input
    if raw is msgspec.UNSET:
        raise _invalid_input("input: Field required", "body.input")
    if req.encoding_format not in ("float", "base64"):
        raise HTTPError(
            f"encoding_format {req.encoding_format!r} is not supported by trio-vllm serve; "
            "use 'float' or 'base64'",
            param="encoding_format",
        )
    items: list[object]
    if isinstance(raw, str) or (_is_ids(raw) and raw):
        items = [raw]
    elif isinstance(raw, list):
        if not raw:
            raise HTTPError("You must pass at least one prompt")
        if all(isinstance(x, str) for x in raw) or all(_is_ids(x) for x in raw):
            items = list(raw)
        else:
            # pydantic's first error: the list of ints member, at its first non-int.
            first = next(i for i, x in enumerate(raw) if type(x) is not int)
            raise _invalid_input(
                "input: Input should be a string, a list of strings, a list of token ids "
                "or a list of lists of token ids",
                f"body.input.{first}",
            )
    else:
        raise _invalid_input("input: Input should be a valid string or list")
    prompts: list[Prompt] = []
    for item in items:
        if isinstance(item, str):
            if req.add_special_tokens:  # the text layer's own path (and its length bound)
                prompts.append(item)
                continue
            ids = tokenizer.encode(item, add_special_tokens=False)
            prompts.append({"prompt_token_ids": ids, "prompt": item})
        else:
            token_ids: list[int] = [int(t) for t in cast("list[int]", item)]
            prompts.append(token_ids)
    return prompts


def pooling_params(req: EmbeddingRequest) -> PoolingParams:
    """vLLM's ``EmbeddingCompletionRequest.to_pooling_params``."""
    return PoolingParams(task="embed", dimensions=req.dimensions, use_activation=req.use_activation)


def embedding_response(
    req: EmbeddingRequest,
    outputs: Sequence[EmbeddingRequestOutput],
    model: str,
    *,
    header_request_id: str | None = None,
) -> bytes:
    """The JSON answer: one item per output, in order; ``usage`` counts prompt tokens;
    ``id`` is ``embd-`` and the ``X-Request-Id`` header, else the body's ``request_id``,
    else a random id (vLLM's ``_base_request_id``)."""
    items: list[_Item] = []
    tokens = 0
    for index, out in enumerate(outputs):
        tokens += len(out.prompt_token_ids)
        vector: list[float] | str = out.outputs.embedding
        if req.encoding_format == "base64":
            data = np.asarray(vector, dtype=_ENDIAN[req.endianness] + "f4").tobytes()
            vector = base64.b64encode(data).decode("ascii")
        items.append(_Item(index, "embedding", vector))
    base_id = header_request_id if header_request_id is not None else req.request_id
    if base_id is None:
        base_id = secrets.token_hex(16)  # vLLM's random_uuid: 32 hex digits
    response = _Response(
        f"embd-{base_id}",
        "list",
        int(time.time()),
        model,
        items,
        _Usage(tokens, tokens),
    )
    return msgspec.json.encode(response)
