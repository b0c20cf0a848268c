"""Prompt processing and validation (vLLM's InputProcessor rules), no engine."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import pytest

from trio_vllm import InvalidRequestError
from trio_vllm.protocol import ClientCodec, SamplingParams
from trio_vllm.text import (
    InputProcessor,
    ModelFiles,
    OutputProcessor,
    Tokenizer,
    TokensPrompt,
    internal_request_id,
    random_hex,
    random_uuid,
)

if TYPE_CHECKING:
    from pathlib import Path


@pytest.fixture
def inp(tiny_files: ModelFiles, tiny: Tokenizer) -> InputProcessor:
    return InputProcessor.from_model_files(tiny_files, tiny, max_model_len=32)


def test_prompt_forms(inp: InputProcessor, tiny: Tokenizer) -> None:
    ids = tiny.encode("Hello")
    assert inp.tokenize_prompt("Hello") == ("Hello", ids)
    assert inp.tokenize_prompt({"prompt": "Hello"}) == ("Hello", ids)
    assert inp.tokenize_prompt([5, 6]) == (None, [5, 6])
    assert inp.tokenize_prompt(TokensPrompt(prompt_token_ids=[5], prompt="x")) == ("x", [5])


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ([], "cannot be empty"),
        (
            list(range(5, 37)),  # 32 tokens: no room to generate
            "The decoder prompt (length 32) plus the number of requested output tokens (at least"
            " 1) is longer than the maximum model length of 32.",
        ),
        (list(range(5, 37)), "maximum context length is 32 tokens"),
        (
            list(range(5, 45)),
            "This model's maximum context length is 32 tokens. However, your "
            "prompt contains 40 input tokens, which exceeds this limit even without any output",
        ),
        ("hello " * 40, "your prompt contains at least 33 input tokens"),
        ("x" * 100_000, "your prompt contains 100000 characters"),
        ([5, 512], "Token id 512 is out of vocabulary"),
        ([-1, 5], "Token id -1 is out of vocabulary"),
        ([5, "6"], "ints only"),
        ([5, 6.0], "ints only"),
        ({"text": "x"}, "'prompt'"),
        (b"abc", "must be text"),
    ],
)
def test_prompt_validation(inp: InputProcessor, prompt: object, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=re.escape(message)):
        inp.process_inputs("r", prompt)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (
            SamplingParams(logprobs=21),
            "Requested sample logprobs of 21, which is greater than max allowed: 20",
        ),
        (SamplingParams(prompt_logprobs=25), "Requested prompt logprobs of 25"),
        (SamplingParams(logprobs=-1), "greater than max allowed: 20"),  # -1: the whole vocabulary
        (SamplingParams(n=2, temperature=0.0), "n must be 1 when using greedy sampling"),
        (SamplingParams(min_tokens=20, max_tokens=5), "min_tokens must be less than or equal"),
        (SamplingParams(max_tokens=None, min_tokens=40), "max_tokens=29"),
        (SamplingParams(stop=["a", ""]), "stop cannot contain an empty string"),
        (SamplingParams(stop_token_ids=[600]), "out-of-vocab"),
        (SamplingParams(temperature=3.0), "temperature"),
        (SamplingParams(extra_args={"k": 2**70}), "2**63"),  # msgpack cannot encode it
        (SamplingParams(seed=2**64), "seed"),
    ],
)
def test_params_validation(inp: InputProcessor, params: SamplingParams, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=re.escape(message)):
        inp.process_inputs("r", [5, 6, 7], params)


def test_default_max_tokens_and_eos(inp: InputProcessor) -> None:
    processed = inp.process_inputs("r", [5, 6, 7], SamplingParams(max_tokens=None))
    p = processed.sampling_params
    assert p.max_tokens == 32 - 3
    assert p._eos_token_id == 2
    assert p._all_stop_token_ids == {2, 4}
    assert p.stop_token_ids == [4]  # the generation config's other EOS id
    ignore = inp.process_inputs("r", [5], SamplingParams(ignore_eos=True)).sampling_params
    assert ignore._eos_token_id is None
    assert ignore._all_stop_token_ids == {2, 4}  # still known, for min_tokens
    assert ignore.stop_token_ids == []


def test_caller_params_are_not_changed(inp: InputProcessor) -> None:
    params = SamplingParams(max_tokens=None, stop_token_ids=[9])
    inp.process_inputs("r", [5], params)
    assert params.max_tokens is None
    assert params.stop_token_ids == [9]
    assert params._all_stop_token_ids == {9}


def test_skip_clone_copies_shallowly_and_changes_nothing_of_the_callers(
    inp: InputProcessor,
) -> None:
    stop = ["zz"]
    params = SamplingParams(max_tokens=None, stop=stop, stop_token_ids=[9], skip_clone=True)
    p = inp.process_inputs("r", [5], params).sampling_params
    assert p is not params
    assert p.stop is stop  # shared, as vLLM's clone() shares it with skip_clone
    assert (p._all_stop_token_ids, sorted(p.stop_token_ids or ())) == ({2, 4, 9}, [4, 9])
    assert params.max_tokens is None
    assert params.stop_token_ids == [9]
    assert params._all_stop_token_ids == {9}
    deep = inp.process_inputs("s", [5], SamplingParams(stop=stop)).sampling_params
    assert deep.stop == stop
    assert deep.stop is not stop


def test_no_params_means_generation_config_defaults(
    tiny: Tokenizer, tiny_files: ModelFiles
) -> None:
    inp = InputProcessor(
        tiny, max_model_len=64, sampling_defaults={"temperature": 0.5, "max_tokens": 7}
    )
    p = inp.process_inputs("r", [5]).sampling_params
    assert (p.temperature, p.max_tokens) == (0.5, 7)
    vanilla = InputProcessor.from_model_files(tiny_files, tiny, max_model_len=64)
    assert vanilla.process_inputs("r", [5]).sampling_params.max_tokens == 16  # vLLM's default


def test_request_ids_as_vllm_assigns_them(inp: InputProcessor) -> None:
    processed = inp.process_inputs("my-id", [5])
    (request,) = processed.requests
    assert re.fullmatch(r"my-id-[0-9a-f]{8}", request.request_id)
    assert request.external_req_id == "my-id"
    assert processed.external_req_id == "my-id"
    assert re.fullmatch(r"[0-9a-f]{16}", random_uuid())
    assert internal_request_id("x") != internal_request_id("x")
    with pytest.raises(InvalidRequestError, match="request_id"):
        inp.process_inputs("", [5])


def test_requests_encode_on_the_wire(inp: InputProcessor) -> None:
    processed = inp.process_inputs(
        "r", "Hello", SamplingParams(n=2, temperature=1.0, seed=3, stop=["x"], logprobs=2)
    )
    codec = ClientCodec()
    for request in processed.requests:
        assert codec.encode_add(request)  # validates as the engine would, then encodes


def test_register_is_all_or_nothing(inp: InputProcessor, tiny: Tokenizer) -> None:
    out = OutputProcessor(tiny)
    processed = inp.process_inputs("r", [5], SamplingParams(n=2, temperature=1.0))
    processed.register(out)
    assert out.get_num_unfinished_requests() == 2
    with pytest.raises(ValueError, match="already"):
        processed.register(out)
    assert out.get_num_unfinished_requests() == 2


def test_bad_words_are_tokenized(inp: InputProcessor, tiny: Tokenizer) -> None:
    p = inp.process_inputs("r", [5], SamplingParams(bad_words=["hello"])).sampling_params
    assert p._bad_words_token_ids
    assert p._bad_words_token_ids[0] == tiny.encode("hello", add_special_tokens=False)


def test_chat_prompt(inp: InputProcessor, tiny: Tokenizer) -> None:
    processed = inp.process_chat("c", [{"role": "user", "content": "hi"}])
    expected = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert processed.prompt == expected
    assert processed.prompt_token_ids == tiny.encode(expected, add_special_tokens=False)
    assert processed.prompt_token_ids[0] == 3  # no BOS: the template writes the specials


def test_ids_below_the_model_vocabulary_are_accepted(tmp_path: Path) -> None:
    from .conftest import metaspace_tokenizer, write_model_dir

    model = write_model_dir(
        tmp_path / "m",
        metaspace_tokenizer(),
        config={"vocab_size": 16},
        tokenizer_config={"eos_token": "</s>"},
    )
    files = ModelFiles(model)
    tok = files.load_tokenizer()
    inp = InputProcessor.from_model_files(files, tok, max_model_len=32)
    assert tok.max_token_id == 9
    assert inp.tokenize_prompt([15]) == (None, [15])  # vLLM: max(max_token_id, vocab - 1)
    with pytest.raises(InvalidRequestError, match="Token id 16 is out of vocabulary"):
        inp.tokenize_prompt([16])


def test_random_hex_never_repeats_across_threads_or_a_fork() -> None:
    import os
    import threading

    got: list[list[str]] = [[] for _ in range(8)]

    def take(out: list[str]) -> None:
        for _ in range(3000):  # several 4 KiB refills per thread
            out.append(random_hex(16))

    threads = [threading.Thread(target=take, args=(out,)) for out in got]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    ids = [i for out in got for i in out]
    assert len(ids) == 24000
    assert len(set(ids)) == len(ids)
    assert all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids[:100])
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child's next id must not be the parent's next one
        os.write(w, random_hex(16).encode())
        os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    with os.fdopen(r) as f:
        child = f.read()
    assert child != random_hex(16)
    assert len(child) == 32
