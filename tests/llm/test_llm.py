"""The async text frontend against real reference engine processes (echo model).

The shipped model directory's tokenizer is byte-level (token id = byte), and the echo
model repeats the prompt, so every expected text below follows from the prompt alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import anyio
import pytest

import trio_vllm as tv
from trio_vllm.llm import LLM, open_llm
from trio_vllm.protocol import RequestOutputKind
from trio_vllm.reference_engine import EOS_TOKEN_ID, MODEL_DIR

if TYPE_CHECKING:
    from trio_vllm.testing import ReferenceEngineSet

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

LONG = 900_000  # a request that only an abort ends within the test
# wait_idle's 15 s: a hang guard for an abort on a loaded machine, well below the ~40 s
# an un-aborted LONG request runs.
ENGINES: dict[str, Any] = {"model": "echo", "extra_args": ("--max-model-len", "1000000")}


def greedy(**kwargs: Any) -> tv.SamplingParams:
    kwargs.setdefault("temperature", 0.0)
    return tv.SamplingParams(**kwargs)


def echo_text(prompt: str, num_tokens: int) -> str:
    data = prompt.encode()
    return bytes(data[k % len(data)] for k in range(num_tokens)).decode(errors="ignore")


async def test_open_llm_generates_text() -> None:
    async with open_llm(tv.ReferenceEngines(model="echo")) as llm:
        assert llm.model_name == "trio-vllm-reference"
        assert tv.open_llm is open_llm
        assert llm.max_model_len == 2048
        assert llm.tokenizer.encode("hé") == list("hé".encode())
        out = await llm.generate_final("hello ", greedy(max_tokens=9))
        assert out.finished
        assert out.prompt == "hello "
        assert out.prompt_token_ids == list(b"hello ")
        [completion] = out.outputs
        assert completion.text == "hello hel"
        assert completion.token_ids == list(b"hello hel")
        assert completion.finish_reason == "length"
        assert completion.stop_reason is None
        assert llm.num_requests == 0
        assert llm.client.live_requests == []


@pytest.mark.reference_engines(**ENGINES)
async def test_streaming_kinds_and_split_utf8(reference_engines: ReferenceEngineSet) -> None:
    llm = LLM(reference_engines.client, model=MODEL_DIR)
    prompt = "日本🎉é"  # 3 + 3 + 4 + 2 bytes: most tokens end inside a character
    n = 11  # stops inside the emoji: its first byte must not show as text
    deltas: list[str] = []
    delta_ids: list[int] = []
    params = greedy(max_tokens=n, output_kind=RequestOutputKind.DELTA)
    async with llm.generate(prompt, params) as stream:
        async for out in stream:
            [c] = out.outputs
            deltas.append(c.text)
            delta_ids.extend(c.token_ids)
    assert "".join(deltas) == echo_text(prompt, n)
    assert "".join(deltas) == "日本🎉"  # the 11th token is half of "é": never shown
    assert delta_ids == list(prompt.encode())[:n]
    cumulative: list[str] = []
    async with llm.generate(prompt, greedy(max_tokens=n)) as stream:
        async for out in stream:
            cumulative.append(out.outputs[0].text)
    assert cumulative[-1] == echo_text(prompt, n)
    assert all(cumulative[-1].startswith(t) for t in cumulative)
    finals = []
    params = greedy(max_tokens=n, output_kind=RequestOutputKind.FINAL_ONLY)
    async with llm.generate(prompt, params) as stream:
        async for out in stream:
            finals.append(out)
    assert len(finals) == 1
    assert finals[0].outputs[0].text == echo_text(prompt, n)


@pytest.mark.reference_engines(**ENGINES)
async def test_stop_string_aborts_on_the_engine(reference_engines: ReferenceEngineSet) -> None:
    llm = LLM(reference_engines.client, model=MODEL_DIR)
    control = reference_engines.controls[0]
    texts: list[str] = []
    async with llm.generate("abcdef", greedy(max_tokens=LONG, stop=["fab"])) as stream:
        async for out in stream:
            texts.append(out.outputs[0].text)
    final = out.outputs[0]
    assert final.text == "abcde"
    assert final.finish_reason == "stop"
    assert final.stop_reason == "fab"
    assert stream.finished
    # The engine knows no stop strings: without the ABORT it would run LONG tokens.
    status = await control.wait_idle(within=15.0)
    assert status.requests == 0
    assert llm.num_requests == 0
    assert reference_engines.client.live_requests == []
    # include_stop_str_in_output keeps the match.
    out = await llm.generate_final(
        "abcdef", greedy(max_tokens=LONG, stop=["fab"], include_stop_str_in_output=True)
    )
    assert out.outputs[0].text == "abcdefab"
    assert (await control.wait_idle(within=15.0)).requests == 0


@pytest.mark.reference_engines(**ENGINES)
async def test_leaving_early_aborts_every_child(reference_engines: ReferenceEngineSet) -> None:
    llm = LLM(reference_engines.client, model=MODEL_DIR)
    control = reference_engines.controls[0]
    params = tv.SamplingParams(max_tokens=LONG, n=3, temperature=1.0, seed=5)
    async with llm.generate("xyz", params) as stream:
        assert len(stream.engine_request_ids) == 3
        seen: set[int] = set()
        async for out in stream:
            seen.update(c.index for c in out.outputs)
            if seen == {0, 1, 2}:
                break
        assert (await control.status()).requests == 3
    assert (await control.wait_idle(within=15.0)).requests == 0
    assert llm.num_requests == 0
    assert reference_engines.client.live_requests == []


@pytest.mark.reference_engines(**ENGINES)
async def test_n_with_seed_and_min_tokens(reference_engines: ReferenceEngineSet) -> None:
    llm = LLM(reference_engines.client, model=MODEL_DIR)
    params = tv.SamplingParams(max_tokens=8, n=2, temperature=1.0, seed=7, stop=["b"], min_tokens=3)
    out = await llm.generate_final("ab", params)
    assert [c.index for c in out.outputs] == [0, 1]
    for c in out.outputs:
        # "ab" repeats; "b" first matches at token 2, but min_tokens=3 defers it to 4.
        assert c.text == "aba"
        assert c.finish_reason == "stop"
        assert c.stop_reason == "b"
    # DELTA with n > 1: each output names the completion it carries.
    texts = {0: "", 1: ""}
    params = tv.SamplingParams(
        max_tokens=5, n=2, temperature=1.0, seed=7, output_kind=RequestOutputKind.DELTA
    )
    async with llm.generate("xy", params) as stream:
        async for out in stream:
            for c in out.outputs:
                texts[c.index] += c.text
    assert out.finished
    assert texts == {0: "xyxyx", 1: "xyxyx"}


@pytest.mark.reference_engines(**ENGINES)
async def test_eos_logprobs_and_special_tokens(reference_engines: ReferenceEngineSet) -> None:
    llm = LLM(reference_engines.client, model=MODEL_DIR)
    prompt = [*b"hi", EOS_TOKEN_ID, *b"!"]  # the echo model emits EOS third
    out = await llm.generate_final(prompt, greedy(max_tokens=10, logprobs=2))
    [c] = out.outputs
    assert out.prompt is None
    assert c.token_ids == [*b"hi", EOS_TOKEN_ID]
    assert c.text == "hi"  # EOS stops, and special tokens are skipped
    assert c.finish_reason == "stop"
    assert c.stop_reason is None
    assert c.logprobs is not None
    assert len(c.logprobs) == 3
    first = c.logprobs[0][ord("h")]
    assert first.logprob == pytest.approx(0.0, abs=1e-6)
    assert first.rank == 1
    assert first.decoded_token == "h"
    assert c.cumulative_logprob == pytest.approx(0.0, abs=1e-5)
    out = await llm.generate_final(
        prompt, greedy(max_tokens=4, ignore_eos=True, skip_special_tokens=False)
    )
    assert out.outputs[0].text == "hi</s>!"
    assert out.outputs[0].finish_reason == "length"


@pytest.mark.reference_engines(**ENGINES)
async def test_chat(reference_engines: ReferenceEngineSet) -> None:
    llm = LLM(reference_engines.client, model=MODEL_DIR)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    text, ids = llm.render_chat(messages)
    assert text == (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert ids == list(text.encode())
    out = await llm.chat_final(messages, greedy(max_tokens=12))
    assert out.prompt == text
    assert out.prompt_token_ids == ids
    assert out.outputs[0].text == text[:12]
    async with llm.chat(messages, greedy(max_tokens=3)) as stream:
        last = await stream.collect()
    assert last is not None
    assert last.outputs[0].text == text[:3]


# A Hermes-style template that renders the request's tools (tiny-llama's ChatML does not).
TOOLS_TEMPLATE = (
    "{%- if tools %}<tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@pytest.mark.reference_engines(**ENGINES)
async def test_chat_renders_tools_through_the_template(
    reference_engines: ReferenceEngineSet,
) -> None:
    """``tools=`` reaches the chat template as ``tools`` (vLLM's ``LLM.chat(tools=...)``),
    JSON-encoded by transformers' ``tojson``; without tools the template skips them."""
    llm = LLM(reference_engines.client, model=MODEL_DIR)
    messages = [{"role": "user", "content": "weather in Paris?"}]
    text, _ = llm.render_chat(messages, chat_template=TOOLS_TEMPLATE, tools=[WEATHER_TOOL])
    assert text.startswith(
        '<tools>{"type": "function", "function": {"name": "get_weather", "description": '
        '"Weather in a city", "parameters": {"type": "object", "properties": {"city": '
        '{"type": "string"}}}}}</tools>\n<|im_start|>user\nweather in Paris?<|im_end|>\n'
    )
    plain, _ = llm.render_chat(messages, chat_template=TOOLS_TEMPLATE)
    assert plain == "<|im_start|>user\nweather in Paris?<|im_end|>\n<|im_start|>assistant\n"
    out = await llm.chat_final(
        messages, greedy(max_tokens=4), chat_template=TOOLS_TEMPLATE, tools=[WEATHER_TOOL]
    )
    assert out.prompt == text


@pytest.mark.reference_engines(**ENGINES)
async def test_invalid_requests_are_refused_before_sending(
    reference_engines: ReferenceEngineSet,
) -> None:
    llm = LLM(reference_engines.client, model=MODEL_DIR)
    bad: list[tuple[Any, tv.SamplingParams | None, str]] = [
        ([1, 2, 300], None, "out of vocabulary"),
        ([], None, "empty"),
        ("x", tv.SamplingParams(top_p=2.0), "top_p"),
        ("x", tv.SamplingParams(max_tokens=0), "max_tokens"),
        ("x", tv.SamplingParams(stop=[""]), "stop"),
        ("x", tv.SamplingParams(logprobs=10_000), "logprobs"),
    ]
    for prompt, params, message in bad:
        with pytest.raises(tv.InvalidRequestError, match=message):
            llm.generate(prompt, params)
    with pytest.raises(tv.InvalidRequestError):
        llm.render_chat([{"role": "user", "content": [{"type": "image_url"}]}])
    assert llm.num_requests == 0
    assert reference_engines.client.live_requests == []
    assert (await reference_engines.controls[0].status()).requests == 0


@pytest.mark.reference_engines(**ENGINES)
async def test_abort_by_request_id(reference_engines: ReferenceEngineSet) -> None:
    llm = LLM(reference_engines.client, model=MODEL_DIR)
    got: list[tv.RequestOutput] = []

    async def consume(task_status: anyio.abc.TaskStatus[None]) -> None:
        async with llm.generate("ab", greedy(max_tokens=LONG), request_id="mine") as stream:
            task_status.started()
            async for out in stream:
                got.append(out)

    async with anyio.create_task_group() as tg:
        await tg.start(consume)
        assert llm.live_request_ids == ["mine"]
        await llm.abort("mine")
        await llm.abort("unknown")  # ignored
    assert got[-1].finished
    assert got[-1].outputs[0].finish_reason == "abort"
    assert got[-1].request_id == "mine"
    assert (await reference_engines.controls[0].wait_idle(within=15.0)).requests == 0
    assert llm.num_requests == 0


async def test_prompt_longer_than_the_context() -> None:
    engines = tv.ReferenceEngines(model="echo", extra_args=["--max-model-len", "8"])
    async with open_llm(engines) as llm:
        assert llm.max_model_len == 8
        assert (await llm.generate_final("1234567", greedy())).outputs[0].text == "1"
        with pytest.raises(tv.InvalidRequestError, match="maximum model length of 8"):
            llm.generate("12345678")
        assert llm.num_requests == 0


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.reference_engines(**ENGINES)
async def test_engine_death_raises_from_the_stream(
    reference_engines: ReferenceEngineSet, n: int
) -> None:
    llm = LLM(reference_engines.client, model=MODEL_DIR)
    params = tv.SamplingParams(max_tokens=LONG, n=n, temperature=1.0)
    count = 0
    with pytest.raises(tv.EngineDeadError):  # noqa: PT012
        async with llm.generate("ab", params) as stream:
            async for _ in stream:
                count += 1
                if count == 3:
                    await reference_engines.controls[0].kill()
    assert count >= 3
    assert llm.dead
    assert llm.num_requests == 0
    with pytest.raises(tv.EngineDeadError):
        async with llm.generate("ab", greedy(max_tokens=3)):
            pass  # pragma: no cover


def _client_stream_done(stream: Any) -> bool:
    # The client stream got the final output: everything the engine made is buffered.
    child = stream._children[0].stream
    return child is not None and child.finished


@pytest.mark.reference_engines(**ENGINES)
async def test_next_batch_gives_every_buffered_output_unmerged(
    reference_engines: ReferenceEngineSet,
) -> None:
    llm = LLM(reference_engines.client, model=MODEL_DIR)
    prompt = "abcdefgh"
    n = 12
    params = greedy(max_tokens=n, output_kind=RequestOutputKind.DELTA)
    async with llm.generate(prompt, params) as stream:
        with anyio.fail_after(30):
            while not _client_stream_done(stream):  # noqa: ASYNC110
                await anyio.sleep(0.01)
        batch = await stream.next_batch()
        # One output per engine step (one token each), in order; only the last finished.
        assert [o.outputs[0].token_ids for o in batch] == [[b] for b in prompt.encode() * 2][:n]
        assert "".join(o.outputs[0].text for o in batch) == echo_text(prompt, n)
        assert [o.finished for o in batch] == [False] * (n - 1) + [True]
        assert await stream.next_batch() == []
    # __anext__ merges the same backlog into one output (DELTA: concatenated).
    async with llm.generate(prompt, params) as stream:
        with anyio.fail_after(30):
            while not _client_stream_done(stream):  # noqa: ASYNC110
                await anyio.sleep(0.01)
        outs = [out async for out in stream]
        assert len(outs) == 1
        assert outs[0].outputs[0].text == echo_text(prompt, n)
    assert llm.num_requests == 0


@pytest.mark.reference_engines(model="echo", extra_args=("--step-interval-ms", "20"))
async def test_next_batch_cancelled_consumes_nothing(
    reference_engines: ReferenceEngineSet,
) -> None:
    llm = LLM(reference_engines.client, model=MODEL_DIR)
    params = greedy(max_tokens=LONG, output_kind=RequestOutputKind.DELTA)
    async with llm.generate("xy", params) as stream:
        first = await stream.next_batch()
        assert first
        assert not first[-1].finished
        with anyio.CancelScope() as scope:
            scope.cancel()
            await stream.next_batch()  # cancelled at its first checkpoint
        got: list[int] = [t for o in first for t in o.outputs[0].token_ids]
        while len(got) < 6:
            got.extend(t for o in await stream.next_batch() for t in o.outputs[0].token_ids)
        assert got[:6] == list(b"xyxyxy")
    control = reference_engines.controls[0]
    assert (await control.wait_idle(within=15.0)).requests == 0
    assert llm.num_requests == 0


@pytest.mark.reference_engines(**ENGINES)
@pytest.mark.parametrize("n", [1, 2])
async def test_entering_a_stream_twice_is_refused_and_leaves_nothing(
    reference_engines: ReferenceEngineSet, n: int
) -> None:
    # The stream is its own context manager: entering it again (nested, or after the
    # block was left) is refused, and the refused entry registers nothing in the LLM.
    llm = LLM(reference_engines.client, model=MODEL_DIR)
    params = tv.SamplingParams(max_tokens=LONG, n=n, temperature=1.0, seed=1)
    async with llm.generate("ab", params, request_id="twice") as stream:
        with pytest.raises(RuntimeError, match="entered only once"):
            async with stream:
                pass  # pragma: no cover
        assert llm.num_requests == 1
        assert llm.live_request_ids == ["twice"]
    assert llm.num_requests == 0
    with pytest.raises(RuntimeError, match="entered only once"):
        async with stream:
            pass  # pragma: no cover
    assert llm.num_requests == 0
    assert llm.live_request_ids == []
    assert (await reference_engines.controls[0].wait_idle(within=15.0)).requests == 0


@pytest.mark.reference_engines(**ENGINES)
@pytest.mark.parametrize("n", [1, 2])
async def test_iterating_a_stream_not_entered_says_so(
    reference_engines: ReferenceEngineSet, n: int
) -> None:
    # ``async for out in llm.generate(...)`` without ``async with``: nothing was sent, and
    # the error says what to do (not a bare AssertionError from inside the stream).
    llm = LLM(reference_engines.client, model=MODEL_DIR)
    stream = llm.generate("ab", tv.SamplingParams(max_tokens=3, n=n, temperature=1.0, seed=1))
    with pytest.raises(RuntimeError, match="async with"):
        async for _ in stream:
            pass  # pragma: no cover
    with pytest.raises(RuntimeError, match="async with"):
        await stream.next_batch()
    assert llm.num_requests == 0
    assert reference_engines.client.live_requests == []
