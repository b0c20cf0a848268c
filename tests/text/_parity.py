"""Parity cases shared by the unit tests and the vllm tier: the same JSON cases go through
trio-vllm's text layer here and through stock vLLM in ``vllm_reference.py``."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np

from trio_vllm.protocol import (
    EngineCoreOutput,
    EngineCoreRequest,
    FinishReason,
    LogprobsLists,
    LogprobsTensors,
    SamplingParams,
)
from trio_vllm.text import (
    OutputProcessor,
    ParentRequest,
    Tokenizer,
    load_tokenizer,
)
from trio_vllm.text import _detokenizer as detok_mod

from .vllm_reference import logprob_columns, replay_steps

# <repo>/../shared/interop/tiny-llama, as the vllm tier finds it.
TINY_LLAMA = str(Path(__file__).resolve().parents[3] / "shared" / "interop" / "tiny-llama")
STOP, LENGTH = int(FinishReason.STOP), int(FinishReason.LENGTH)


def tiny_llama_available() -> bool:
    return Path(TINY_LLAMA, "tokenizer.json").is_file()


# -- our side ------------------------------------------------------------------------------


_TOKENIZERS: dict[str, Tokenizer] = {}


def tokenizer_for(model: str) -> Tokenizer:
    if model not in _TOKENIZERS:
        _TOKENIZERS[model] = load_tokenizer(model)
    return _TOKENIZERS[model]


def run_case_here(case: dict[str, Any]) -> dict[str, Any]:
    tokenizer = tokenizer_for(case["model"])
    original = detok_mod._decode_stream_class
    if case.get("slow"):
        detok_mod._decode_stream_class = lambda: None  # type: ignore[assignment]
    try:
        params = SamplingParams(**case["params"])
        processor = OutputProcessor(tokenizer)
        prompt = case.get("prompt")
        request = EngineCoreRequest(
            case["request_id"],
            prompt_token_ids=list(case["prompt_token_ids"]),
            sampling_params=params,
            external_req_id=case["external_req_id"],
        )
        if params.n == 1:
            processor.add_request(request, prompt)
            ids = [request.request_id]
        else:
            parent = ParentRequest(case["request_id"], case["external_req_id"], params)
            ids = []
            for idx in range(params.n):
                child_id, child_params = parent.get_child_info(idx)
                child = EngineCoreRequest(
                    child_id,
                    prompt_token_ids=list(case["prompt_token_ids"]),
                    sampling_params=child_params,
                    external_req_id=case["external_req_id"],
                )
                processor.add_request(child, prompt, parent, idx)
                ids.append(child_id)

        def output(request_id: str, item: dict[str, Any], lp: Any, plp: Any) -> EngineCoreOutput:
            finish = item.get("finish_reason")
            return EngineCoreOutput(
                request_id,
                new_token_ids=list(item["new_token_ids"]),
                new_logprobs=lp,
                new_prompt_logprobs_tensors=plp,
                finish_reason=None if finish is None else FinishReason(finish),
                stop_reason=item.get("stop_reason"),
            )

        def columns(rows: dict[str, Any]) -> tuple[Any, Any, Any]:
            return logprob_columns(rows, np.array, np.int32, np.float32)

        return replay_steps(
            case, ids, processor,
            logprobs=lambda rows: LogprobsLists(*columns(rows)),
            prompt_logprobs=lambda rows: LogprobsTensors(*columns(rows)),
            output=output,
        )  # fmt: skip
    finally:
        detok_mod._decode_stream_class = original  # type: ignore[assignment]


# -- cases ---------------------------------------------------------------------------------


def _steps(
    token_ids: list[int],
    per_step: int = 1,
    finish: int = LENGTH,
    stop_reason: int | str | None = None,
    child: int = 0,
) -> list[list[dict[str, Any]]]:
    steps: list[list[dict[str, Any]]] = []
    for i in range(0, len(token_ids), per_step):
        steps.append([{"child": child, "new_token_ids": token_ids[i : i + per_step]}])
    steps[-1][0]["finish_reason"] = finish
    steps[-1][0]["stop_reason"] = stop_reason
    return steps


def _one_case(
    name: str,
    ids: list[int],
    params: dict[str, Any],
    *,
    per_step: int = 1,
    finish: int = LENGTH,
    stop_reason: int | str | None = None,
    slow: bool = False,
    prompt_ids: list[int] | None = None,
    model: str = TINY_LLAMA,
) -> dict[str, Any]:
    tok = tokenizer_for(model)
    return {
        "kind": "outputs",
        "name": name,
        "model": model,
        "slow": slow,
        "request_id": f"{name}-0123abcd",
        "external_req_id": name,
        "prompt": "Tell me: ",
        "prompt_token_ids": prompt_ids or tok.encode("Tell me: "),
        "params": params,
        "steps": _steps(ids, per_step, finish, stop_reason),
    }


def _logprob_rows(rng: random.Random, ids: list[int], k: int, vocab: int) -> dict[str, Any]:
    token_ids, logprobs, ranks = [], [], []
    for sampled in ids:
        top = rng.sample(range(vocab), k)
        token_ids.append([sampled, *top])
        values = sorted((float(np.float32(-rng.random() * 5)) for _ in range(k)), reverse=True)
        logprobs.append([float(np.float32(-rng.random() * 6)), *values])
        ranks.append(rng.randint(1, 50))
    return {"token_ids": token_ids, "logprobs": logprobs, "ranks": ranks}


def output_cases(model: str = TINY_LLAMA) -> list[dict[str, Any]]:
    """Detokenizer, stop-string, output-kind, logprobs and n>1 cases (tiny-llama by default)."""
    tok = tokenizer_for(model)
    text = "Hello world! 你好，世界 😀🎉 naïve café stop here. More text after."
    ids = tok.encode(text, add_special_tokens=False)
    specials = [i for t in tok.all_special_tokens if (i := tok.token_to_id(t)) is not None]
    a, b = specials[-2], specials[-1]
    im_end = b
    special_ids = [*ids[:4], a, b, a, *ids[4:9], b, 1, 2, *ids[9:14]]
    vocab = tok.vocab_size
    cases: list[dict[str, Any]] = []

    def _case(*args: Any, **kwargs: Any) -> dict[str, Any]:
        case = _one_case(*args, model=model, **kwargs)
        if model != TINY_LLAMA:
            case["name"] += "@" + Path(model).name
        return case

    for slow in (False, True):
        sfx = "-slow" if slow else ""
        for kind in (0, 1, 2):
            cases.append(
                _case(
                    f"plain-k{kind}{sfx}",
                    ids,
                    {"max_tokens": len(ids), "output_kind": kind},
                    slow=slow,
                )
            )
        for include in (False, True):
            for kind in (0, 1):
                cases.append(
                    _case(
                        f"stop-inc{int(include)}-k{kind}{sfx}",
                        ids,
                        {
                            "stop": ["stop here", "界 😀"],
                            "include_stop_str_in_output": include,
                            "output_kind": kind,
                        },
                        slow=slow,
                    )
                )
                cases.append(
                    _case(
                        f"stop-multi-inc{int(include)}-k{kind}{sfx}",
                        ids,
                        {
                            "stop": ["café", "xyz"],
                            "include_stop_str_in_output": include,
                            "output_kind": kind,
                        },
                        per_step=3,
                        slow=slow,
                    )
                )
        cases.append(
            _case(
                f"min-tokens{sfx}",
                ids,
                {"stop": ["l"], "min_tokens": 6, "output_kind": 1},
                slow=slow,
            )
        )
        cases.append(
            _case(
                f"min-tokens-multi{sfx}",
                ids,
                {"stop": ["o"], "min_tokens": 4, "output_kind": 0},
                per_step=4,
                slow=slow,
            )
        )
        cases.append(_case(f"eos{sfx}", [*ids[:10], 2], {"output_kind": 1}, finish=STOP, slow=slow))
        cases.append(
            _case(
                f"stop-token-inc{sfx}",
                [*ids[:10], im_end],
                {
                    "stop_token_ids": [im_end],
                    "include_stop_str_in_output": True,
                    "skip_special_tokens": False,
                },
                finish=STOP,
                stop_reason=im_end,
                slow=slow,
            )
        )
        for skip in (True, False):
            for spaces in (True, False):
                cases.append(
                    _case(
                        f"special-skip{int(skip)}-sp{int(spaces)}{sfx}",
                        special_ids,
                        {
                            "skip_special_tokens": skip,
                            "spaces_between_special_tokens": spaces,
                            "output_kind": 1,
                        },
                        slow=slow,
                    )
                )
    for kind in (0, 1, 2):
        cases.append(
            _case(f"interval3-k{kind}", ids[:20], {"stream_interval": 3, "output_kind": kind})
        )
    # Logprobs (sample and prompt), with byte-level tokens that split characters.
    rng = random.Random(7)
    lp_ids = ids[10:30]
    case = _case("logprobs", lp_ids, {"logprobs": 3, "prompt_logprobs": 2, "output_kind": 0})
    prompt = case["prompt_token_ids"]
    for i, step in enumerate(case["steps"]):
        step[0]["logprobs"] = _logprob_rows(rng, step[0]["new_token_ids"], 3, vocab)
        if i == 0:
            step[0]["prompt_logprobs"] = _logprob_rows(rng, prompt[1:], 2, vocab)
    cases.append(case)
    delta = _case(
        "logprobs-delta-stop",
        lp_ids,
        {"logprobs": 0, "prompt_logprobs": 0, "output_kind": 1, "stop": ["😀"]},
        per_step=2,
    )
    for i, step in enumerate(delta["steps"]):
        step[0]["logprobs"] = _logprob_rows(rng, step[0]["new_token_ids"], 0, vocab)
        if i == 0:
            step[0]["prompt_logprobs"] = _logprob_rows(rng, prompt[1:], 0, vocab)
    cases.append(delta)
    # Chunked prefill: prompt logprobs in two parts, the first with no new token yet.
    long_prompt = tok.encode("A longer prompt, so that its logprobs come in two chunks: ok")
    for kind in (0, 1):
        chunked = _case(
            f"prompt-lp-chunks-k{kind}",
            lp_ids[:6],
            {"prompt_logprobs": 2, "logprobs": 1, "output_kind": kind},
            prompt_ids=long_prompt,
        )
        rows = _logprob_rows(rng, long_prompt[1:], 2, vocab)
        half = len(long_prompt[1:]) // 2
        first = {k: v[:half] for k, v in rows.items()}
        second = {k: v[half:] for k, v in rows.items()}
        chunked["steps"][0][0]["prompt_logprobs"] = second
        for step in chunked["steps"]:
            step[0]["logprobs"] = _logprob_rows(rng, step[0]["new_token_ids"], 1, vocab)
        chunked["steps"].insert(0, [{"child": 0, "new_token_ids": [], "prompt_logprobs": first}])
        cases.append(chunked)
    # n = 2 with a seed: children interleaved, child 1 finishes first.
    for kind in (0, 1, 2):
        base = _case(
            f"n2-k{kind}",
            ids,
            {"n": 2, "seed": 42, "temperature": 0.8, "output_kind": kind, "stop": ["café"]},
        )
        a, b = ids[:12], ids[5:11]
        steps: list[list[dict[str, Any]]] = []
        for i in range(max(len(a), len(b))):
            step = []
            if i < len(a):
                step.append({"child": 0, "new_token_ids": [a[i]]})
            if i < len(b):
                step.append({"child": 1, "new_token_ids": [b[i]]})
            steps.append(step)
        steps[len(b) - 1][-1].update(finish_reason=LENGTH)
        steps[len(a) - 1][0].update(finish_reason=STOP, stop_reason=None)
        steps[len(a) - 1][0]["new_token_ids"] = [2]
        base["steps"] = steps
        cases.append(base)
    return cases


def fuzz_cases(seeds: range = range(6), model: str = TINY_LLAMA) -> list[dict[str, Any]]:
    """Random token ids (special, byte-level and merged tokens) through both detokenizers,
    half of them with sample logprobs (decoded-token correction of split characters)."""
    tok = tokenizer_for(model)
    vocab = tok.vocab_size
    cases = []
    for seed in seeds:
        rng = random.Random(seed)
        ids = [
            rng.randrange(0, vocab) if rng.random() < 0.3 else rng.randrange(100, vocab)
            for _ in range(60)
        ]
        decoded = tok.decode(ids, skip_special_tokens=True)
        stops = [decoded[i : i + 3] for i in (20, 40) if len(decoded) > i + 3]
        stops = [s for s in stops if s.strip()] or ["zzz"]
        for slow in (False, True):
            params = {
                "skip_special_tokens": seed % 2 == 0,
                "spaces_between_special_tokens": seed % 3 != 0,
                "stop": stops,
                "include_stop_str_in_output": seed % 4 == 1,
                "output_kind": seed % 3,
            }
            if seed % 2:
                params["logprobs"] = 2
            case = _one_case(
                f"fuzz{seed}{'-slow' if slow else ''}",
                ids,
                params,
                per_step=1 + seed % 3,
                slow=slow,
                model=model,
            )
            if seed % 2:
                for step in case["steps"]:
                    step[0]["logprobs"] = _logprob_rows(rng, step[0]["new_token_ids"], 2, vocab)
            if model != TINY_LLAMA:
                case["name"] += "@" + Path(model).name
            cases.append(case)
    return cases


def tokenizer_case(model: str = TINY_LLAMA) -> dict[str, Any]:
    return {
        "kind": "tokenizer",
        "model": model,
        "texts": ["Hello world", " leading space", "你好，世界 😀", "a<|im_start|>b</s>c", ""],
        "id_lists": [
            [1, 44, 422, 3, 4, 80],
            [225, 314, 399],
            [300, 301, 302, 2, 2],
            [4],
            [200, 259, 260, 261, 5, 6, 7],
            list(range(280, 300)),
        ],
        "chats": [
            [
                [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 😀"}],
                True,
            ],
            [[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}], False],
            [
                [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo "}],
                "continue",
            ],
        ]
        if model == TINY_LLAMA
        else [],  # the other model has no chat template
    }


def params_cases() -> list[dict[str, Any]]:
    gen = {"eos_token_id": [2, 4], "bos_token_id": 1}
    return [
        {"kind": "params", "model": TINY_LLAMA, "generation_config": gen, "params": p}
        for p in (
            {},
            {"ignore_eos": True},
            {"stop_token_ids": [7, 9]},
            {"stop_token_ids": [4, 100], "ignore_eos": True},
            {"bad_words": ["hello", " world"]},
        )
    ]


def inputs_case() -> dict[str, Any]:
    """Prompts and params through vLLM's InputProcessor (max_model_len 32)."""
    items: list[dict[str, Any]] = [
        {"prompt": "Hello world", "params": {"max_tokens": None}},
        {"prompt": {"prompt": "Hi 你好 😀"}, "params": {"stop": ["abc", "z"], "max_tokens": 4}},
        {"prompt": {"prompt_token_ids": [5, 6, 7]}, "params": {"ignore_eos": True}},
        {"prompt": {"prompt_token_ids": [5, 6]}, "params": {"stop_token_ids": [9, 4]}},
        {"prompt": {"prompt_token_ids": list(range(5, 37))}, "params": {}},
        {"prompt": {"prompt_token_ids": list(range(5, 45))}, "params": {}},
        {"prompt": "hello " * 40, "params": {}},
        {"prompt": "x" * 100_000, "params": {}},
        {"prompt": {"prompt_token_ids": [5, 512]}, "params": {}},
        {"prompt": {"prompt_token_ids": []}, "params": {}},
        {"prompt": {"prompt_token_ids": [5]}, "params": {"logprobs": 21}},
        {"prompt": {"prompt_token_ids": [5]}, "params": {"prompt_logprobs": 30}},
        {"prompt": {"prompt_token_ids": [5]}, "params": {"stop_token_ids": [600]}},
        {"prompt": {"prompt_token_ids": [5, 6]}, "params": {"max_tokens": None, "min_tokens": 40}},
        # One bad value each: the request rules' messages (trio_vllm.protocol.rules).
        *(
            {"prompt": {"prompt_token_ids": [5, 6]}, "params": params}
            for params in (
                {"temperature": -1.0},
                {"temperature": 2.5},
                {"top_p": 2.0},
                {"top_p": 0.0, "temperature": 0.0},
                {"top_k": -2},
                {"min_p": 1.5},
                {"max_tokens": 0},
                {"n": 0},
                {"n": 2, "temperature": 0.0},
                {"presence_penalty": 3.0},
                {"frequency_penalty": -2.5},
                {"repetition_penalty": 0.0},
                {"min_tokens": -1},
                {"min_tokens": 9, "max_tokens": 4},
                {"stop": [""]},
                {"bad_words": [""]},
                {"logprobs": -2},
                {"prompt_logprobs": -2},
                {"stream_interval": 0},
                {"allowed_token_ids": [600]},
                {"allowed_token_ids": []},
                {"logprob_token_ids": [1] * 129, "logprobs": 129},
                {"extra_args": {"k": 2**64}},
            )
        ),
    ]
    return {"kind": "inputs", "model": TINY_LLAMA, "max_model_len": 32, "items": items}


def chat_parse_case() -> dict[str, Any]:
    return {
        "kind": "chat_parse",
        "model": TINY_LLAMA,
        "messages": [
            {"role": "system", "content": "sys"},
            {"role": "developer", "content": "dev", "tools": [{"type": "function"}]},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                "name": "bob",
            },
            {
                "role": "assistant",
                "content": None,
                "extra": 1,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "f", "arguments": '{"x": [1, 2]}'},
                    }
                ],
            },
            {"role": "tool", "content": "42", "tool_call_id": "c1"},
            {"role": "user", "content": "end"},
        ],
    }


def build_sentencepiece_model(path: Path) -> str:
    """A Llama-2/Mistral-style model directory: BPE with byte fallback, a Metaspace
    pre-tokenizer and the Replace/ByteFallback/Fuse/Strip decoder (what tiny-llama's
    byte-level BPE does not exercise: leading-space handling and <0xNN> byte tokens)."""
    import json

    from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors, trainers
    from tokenizers import Tokenizer as HFTokenizer

    corpus = [
        "Hello world, this is a small corpus for a sentencepiece style tokenizer.",
        "The quick brown fox jumps over the lazy dog. Stop here please, then more text.",
        "naive cafe resume hello hello world world the the and and of of to to",
    ] * 20
    metaspace = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    base = HFTokenizer(models.BPE(unk_token="<unk>"))
    base.pre_tokenizer = metaspace
    base.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, show_progress=False))
    trained = json.loads(base.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for i in range(256):
        vocab[f"<0x{i:02X}>"] = len(vocab)
    for piece in sorted(trained["vocab"], key=trained["vocab"].get):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    tok = HFTokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    )
    tok.pre_tokenizer = metaspace
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("\u2581", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<unk>", "<s>", "</s>")])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "clean_up_tokenization_spaces": False,
            }
        )
    )
    (path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_attention_heads": 2,
                "num_key_value_heads": 2,
                "num_hidden_layers": 1,
                "vocab_size": tok.get_vocab_size(),
                "max_position_embeddings": 128,
                "bos_token_id": 1,
                "eos_token_id": 2,
            }
        )
    )
    return str(path)
