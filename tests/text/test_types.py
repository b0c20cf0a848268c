"""The public data types: vLLM's shapes, msgspec-encodable, ``add`` merges as vLLM's."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import pytest

import trio_vllm as tv
from trio_vllm.text import CompletionOutput, Logprob, RequestOutput


def _out(index: int, text: str, ids: list[int], finish: str | None = None) -> CompletionOutput:
    return CompletionOutput(index, text, ids, None, None, finish_reason=finish)


def test_public_names_and_exception_bases() -> None:
    assert tv.RequestOutput is RequestOutput
    assert issubclass(tv.InvalidRequestError, tv.TrioVllmError)
    assert issubclass(tv.InvalidRequestError, ValueError)


def test_outputs_roundtrip_through_msgspec() -> None:
    out = RequestOutput(
        "r",
        "hi",
        [1, 2],
        [None, {2: Logprob(-0.5, 1, "x")}],
        [CompletionOutput(0, "a", [5], -1.0, [{5: Logprob(-1.0, 1, "a")}], "stop", 4)],
        True,
        0,
    )
    back = msgspec.json.decode(msgspec.json.encode(out), type=RequestOutput)
    assert back == out
    assert back.outputs[0].finished()
    assert not _out(0, "", []).finished()


def test_add_aggregates_deltas_by_index() -> None:
    first = RequestOutput("r", None, [1], None, [_out(0, "ab", [1])], False)
    first.add(RequestOutput("r", None, [1], None, [_out(1, "x", [9])], False), aggregate=True)
    first.add(
        RequestOutput("r", None, [1], None, [_out(0, "c", [2], "length")], True), aggregate=True
    )
    assert [(o.index, o.text, o.token_ids, o.finish_reason) for o in first.outputs] == [
        (0, "abc", [1, 2], "length"),
        (1, "x", [9], None),
    ]
    assert first.finished


def test_add_replaces_cumulative_outputs() -> None:
    first = RequestOutput("r", None, [1], None, [_out(0, "ab", [1, 2])], False)
    first.add(
        RequestOutput("r", None, [1], None, [_out(0, "abc", [1, 2, 3])], False), aggregate=False
    )
    assert first.outputs[0].text == "abc"
    assert first.outputs[0].token_ids == [1, 2, 3]


@pytest.mark.parametrize("module", ["trio_vllm", "trio_vllm.text"])
def test_importing_stays_light(module: str) -> None:
    code = (
        f"import sys, {module}\n"
        "heavy = sorted(m for m in ('tokenizers', 'jinja2', 'transformers', 'trio', 'anyio',"
        " 'zmq') if m in sys.modules)\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == ""
