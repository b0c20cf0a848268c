"""``/tokenize``, ``/detokenize`` and ``prompt_logprobs``: ``trio-vllm serve`` answers what
``vllm serve`` answers (token ids, counts, token strings, decoded tokens, ranks exactly;
logprob values to 1e-5; refusals by status and message).

Both servers run the tiny model (dummy weights, seeded) in turn, as in
test_serve_parity.py; every stock vLLM process runs under ``flock`` on
/work/locks/vllm.lock when that lock exists (the shared machine's rule), held by this
process (`vllm_lock`).
"""

from __future__ import annotations

import math
from typing import Any

import httpx
import pytest

from ._servers import SERVED, serve_pair

pytestmark = pytest.mark.timeout(1500)

MESSAGES = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi 🎉"}]
TOKEN_CASES: list[tuple[str, dict[str, Any]]] = [
    ("/tokenize", {"prompt": "The quick brown fox 日本語"}),
    ("/tokenize", {"prompt": "Hello", "add_special_tokens": False, "return_token_strs": True}),
    ("/tokenize", {"prompt": "word " * 400}),  # longer than max_model_len: counted
    ("/tokenize", {"messages": MESSAGES}),
    ("/tokenize", {"messages": MESSAGES, "add_generation_prompt": False,
                   "return_token_strs": True}),
    ("/tokenize", {"messages": [*MESSAGES, {"role": "assistant", "content": "Sure"}],
                   "add_generation_prompt": False, "continue_final_message": True}),
    ("/tokenize", {"messages": MESSAGES, "add_special_tokens": True}),
    ("/tokenize", {"messages": MESSAGES, "continue_final_message": True}),
    ("/tokenize", {"prompt": "a", "model": "no-such-model"}),
    ("/detokenize", {"tokens": [1, 44, 422, 80, 83, 391, 2]}),
    ("/detokenize", {"tokens": [3, 340, 382, 203, 44, 77, 4, 511]}),
    ("/detokenize", {"tokens": [600]}),
    ("/detokenize", {"tokens": [5], "model": "no-such-model"}),
]  # fmt: skip
LOGPROB_CASES: list[tuple[str, dict[str, Any]]] = [
    ("/v1/completions", {"prompt": "The quick brown fox", "max_tokens": 4, "temperature": 0,
                         "prompt_logprobs": 3}),
    ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 2, "temperature": 0,
                         "prompt_logprobs": 0, "logprobs": 1}),
    ("/v1/completions", {"prompt": [1, 5, 7, 9, 11], "max_tokens": 2, "temperature": 0,
                         "prompt_logprobs": 20}),
    ("/v1/completions", {"prompt": ["a b c", "日本語 🎉"], "max_tokens": 2, "temperature": 0,
                         "prompt_logprobs": 2}),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 3, "temperature": 0,
                              "prompt_logprobs": 2}),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 3, "temperature": 0,
                              "echo": True}),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "prompt_logprobs": 1,
                         "stream": True}),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "prompt_logprobs": 21}),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "prompt_logprobs": -1}),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "prompt_logprobs": -3}),
]  # fmt: skip


def _error(r: httpx.Response) -> dict[str, Any]:
    err = r.json()["error"]
    return {"status": r.status_code, "message": err["message"], "type": err["type"]}


def _plp(plp: Any) -> Any:
    return None if plp is None else [None if p is None else dict(p) for p in plp]


def _logprob_summary(path: str, r: httpx.Response) -> dict[str, Any]:
    if r.status_code != 200:
        return _error(r)
    data = r.json()
    if path.endswith("chat/completions"):
        return {"prompt_logprobs": _plp(data.get("prompt_logprobs")),
                "text": [c["message"]["content"] for c in data["choices"]],
                "usage": data["usage"]["prompt_tokens"]}  # fmt: skip
    return {
        "choices": [
            {"text": c["text"], "prompt_logprobs": _plp(c.get("prompt_logprobs")),
             "tokens": (c.get("logprobs") or {}).get("tokens")}
            for c in data["choices"]
        ],
        "usage": data["usage"]["prompt_tokens"],
    }  # fmt: skip


def _run_tokens(port: int) -> list[Any]:
    out: list[Any] = []
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300) as http:
        for path, body in TOKEN_CASES:
            r = http.post(path, json={"model": SERVED, **body})
            out.append(r.json() if r.status_code == 200 else _error(r))
        for path, body in LOGPROB_CASES:
            r = http.post(path, json={"model": SERVED, **body})
            out.append(_logprob_summary(path, r))
    return out


def _assert_close(want: Any, have: Any, where: Any) -> None:
    """Equal, but floats (logprobs) to 1e-5."""
    if isinstance(want, float) and isinstance(have, float):
        assert math.isclose(want, have, abs_tol=1e-5), (where, want, have)
    elif isinstance(want, dict) and isinstance(have, dict):
        assert want.keys() == have.keys(), (where, want, have)
        for k in want:
            _assert_close(want[k], have[k], where)
    elif isinstance(want, list) and isinstance(have, list):
        assert len(want) == len(have), (where, want, have)
        for a, b in zip(want, have, strict=True):
            _assert_close(a, b, where)
    else:
        assert want == have, (where, want, have)


def test_tokens_and_prompt_logprobs_match_vllm_serve() -> None:
    expected, got = serve_pair(_run_tokens)
    cases = TOKEN_CASES + LOGPROB_CASES
    mismatches: list[str] = []  # every case checked, all differences reported at once
    for case, want, have in zip(cases, expected, got, strict=True):
        try:
            if isinstance(want, dict) and "message" in want and "message" in have:
                # a refusal: the same status; for 400s the same message
                assert have["status"] == want["status"], (case, want, have)
                if want["status"] == 400:
                    assert have["message"] == want["message"], (case, want, have)
                continue
            _assert_close(want, have, case)
        except AssertionError as exc:
            mismatches.append(str(exc))
    assert not mismatches, "\n\n".join(mismatches)
    # not vacuous: token strings and prompt logprobs came back
    assert expected[1]["token_strs"]
    assert expected[len(TOKEN_CASES)]["choices"][0]["prompt_logprobs"][1]
