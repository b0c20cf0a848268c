"""`ClientOptions`: one table of the client's keywords, checked once, for every entry
point (issue 24). The value checks themselves are table-driven in
tests/reliability/test_entry_arguments.py."""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import pytest

import trio_vllm
from trio_vllm import ClientOptions, ReferenceEngines, SyncClient, SyncLLM, open_client, open_llm
from trio_vllm.client._options import option_names, resolve_options
from trio_vllm.client._startup import DEFAULT_SHUTDOWN_GRACE

if TYPE_CHECKING:
    from trio_vllm.client._process import EngineProcess

pytestmark = pytest.mark.timeout(60)


class _NoSpawn(ReferenceEngines):
    def __init__(self) -> None:
        super().__init__(1, model="echo")
        self.spawned = False

    async def spawn(self, handshake_address: str) -> list[EngineProcess]:
        self.spawned = True
        raise AssertionError("an engine was started despite a bad keyword")


def test_the_table_and_the_typed_dict_hold_the_same_options() -> None:
    """Adding an option is one change in client/_options.py: its key in the TypedDict
    and its row (default, check) in the table; this holds the two in step."""
    assert option_names() == frozenset(ClientOptions.__annotations__)
    assert ClientOptions.__required_keys__ == frozenset()  # every option is optional
    assert trio_vllm.ClientOptions is trio_vllm.client.ClientOptions


def test_resolve_fills_defaults_and_returns_values_as_used(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("VLLM_ENGINE_READY_TIMEOUT_S", raising=False)
    resolved = resolve_options({})
    assert set(resolved) == option_names()
    assert resolved["ready_timeout"] == 600.0
    assert resolved["shutdown_grace"] == DEFAULT_SHUTDOWN_GRACE
    assert resolved["stream_buffer"] == 64
    assert resolved["on_engine_death"] == "fail"
    assert resolved["waves"] is False
    assert resolved["hang_timeout"] == 30.0
    assert resolved["stall_timeout"] is None
    assert resolve_options({"hang_timeout": None})["hang_timeout"] is None
    assert resolve_options({"stall_timeout": 60})["stall_timeout"] == 60.0
    assert resolve_options({"shutdown_grace": 2})["shutdown_grace"] == 2.0
    assert isinstance(resolve_options({"shutdown_grace": 2})["shutdown_grace"], float)
    monkeypatch.setenv("VLLM_ENGINE_READY_TIMEOUT_S", "12")
    assert resolve_options({})["ready_timeout"] == 12.0
    assert resolve_options({"ready_timeout": 3})["ready_timeout"] == 3.0


def test_an_unknown_keyword_is_refused_as_python_words_it() -> None:
    with pytest.raises(
        TypeError, match=r"open_client\(\) got an unexpected keyword argument 'stream_bufer'"
    ):
        resolve_options({"stream_bufer": 8})
    with pytest.raises(ValueError, match="stream_buffer"):
        resolve_options({"stream_buffer": 0})


def test_every_entry_point_takes_the_same_options() -> None:
    """The signatures name ClientOptions (as ``**options: Unpack[...]``, or the server's
    ``client_options``), so the keywords are written once."""
    from trio_vllm.server import run_openai_server

    for entry in (open_client, SyncClient.__init__, open_llm, SyncLLM.__init__):
        last = list(inspect.signature(entry).parameters.values())[-1]
        assert last.kind is inspect.Parameter.VAR_KEYWORD, entry
        assert str(last.annotation) == "Unpack[ClientOptions]", entry
    server = inspect.signature(run_openai_server).parameters["client_options"]
    assert str(server.annotation) == "ClientOptions | None"


@pytest.mark.anyio
async def test_open_client_refuses_an_unknown_keyword_before_any_engine() -> None:
    source = _NoSpawn()
    options: Any = {"stream_bufer": 8}
    with pytest.raises(TypeError, match="unexpected keyword argument 'stream_bufer'"):
        async with open_client(source, **options):
            pass
    assert not source.spawned


@pytest.mark.anyio
async def test_open_llm_passes_the_options_to_the_one_check() -> None:
    source = _NoSpawn()
    with pytest.raises(ValueError, match="stream_buffer"):
        async with open_llm(source, stream_buffer=0):
            pass
    assert not source.spawned


def test_the_blocking_facades_pass_the_options_to_the_one_check() -> None:
    source = _NoSpawn()
    options: Any = {"waves": "yes"}
    with pytest.raises(TypeError, match="waves"), SyncClient(source, **options):
        pass
    with pytest.raises(ValueError, match="on_engine_death"), SyncLLM(source, on_engine_death="x"):  # type: ignore[typeddict-item]
        pass
    assert not source.spawned
