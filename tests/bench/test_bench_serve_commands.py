"""``bench/bench_serve.py``'s process layout, checked on the command lines it builds.

Both settings must launch the engine the same way behind every frontend (the
stock-engine setting once let vLLM's frontends spawn their own engine core and so
measured a scheduling artefact, not the frontends). Nothing is started here: no vLLM,
no timing.
"""

from __future__ import annotations

from typing import Any

import pytest

from ._scripts import load_script

FRONTENDS = ("trio", "trio-base", "vllm", "vllm-rs")


@pytest.fixture(scope="module")
def bs() -> Any:
    return load_script("bench_serve.py", "bench_serve")


@pytest.mark.parametrize("stock", [False, True], ids=["frontend-bound", "stock-engine"])
@pytest.mark.parametrize("name", FRONTENDS)
def test_frontend_is_pinned_and_waits_for_a_headless_engine(
    bs: Any, name: str, stock: bool
) -> None:
    cmd = bs._frontend_command(name, "/vllm/python", 8000, 9000, stock)
    assert cmd[:3] == ["taskset", "-c", bs.FRONTEND_CORE]
    if name.startswith("trio"):
        assert cmd[cmd.index("--connect") + 1] == "tcp://127.0.0.1:9000"
        assert cmd[cmd.index("--engines") + 1] == "1"
        assert "--engine" not in cmd  # never spawns its own engine
    else:
        assert cmd[cmd.index("--data-parallel-size-local") + 1] == "0"
        assert cmd[cmd.index("--data-parallel-rpc-port") + 1] == "9000"
        assert "--headless" not in cmd
        engine_args = bs.STOCK_ENGINE_ARGS if stock else bs.REFERENCE_FRONTEND_ARGS
        assert cmd[-len(engine_args) :] == engine_args


def test_stock_engine_is_vllms_headless_launcher_on_the_other_cores(bs: Any) -> None:
    cmd = bs._engine_command("/vllm/python", 9000, True)
    assert cmd[:3] == ["taskset", "-c", bs._other_cores()]
    assert cmd[3:7] == ["/vllm/python", str(bs.VLLM_CLI), "serve", str(bs.MODEL)]
    assert "--headless" in cmd
    assert cmd[cmd.index("--data-parallel-rpc-port") + 1] == "9000"
    assert cmd[-len(bs.STOCK_ENGINE_ARGS) :] == bs.STOCK_ENGINE_ARGS


def test_reference_engine_connects_to_the_handshake(bs: Any) -> None:
    cmd = bs._engine_command("/vllm/python", 9000, False)
    assert cmd[:3] == ["taskset", "-c", bs._other_cores()]
    assert "trio_vllm.reference_engine" in cmd
    assert cmd[cmd.index("--handshake-address") + 1] == "tcp://127.0.0.1:9000"


def test_trio_uvicorn_is_our_server_on_asyncio(bs: Any) -> None:
    uvicorn = bs._frontend_command("trio-uvicorn", "/vllm/python", 8000, 9000, False)
    plain = bs._frontend_command("trio", "/vllm/python", 8000, 9000, False)
    assert uvicorn == [*plain, "--backend", "asyncio"]
    two = bs._frontend_command("trio-uvicorn-n2", "/vllm/python", 8000, 9000, False)
    assert two == [*plain, "--backend", "asyncio", "--api-server-count", "2"]


def test_trio_merge_is_our_server_with_merged_outputs(bs: Any) -> None:
    merged = bs._frontend_command("trio-merge", "/vllm/python", 8000, 9000, False)
    plain = bs._frontend_command("trio", "/vllm/python", 8000, 9000, False)
    assert merged == [*plain, "--merge-outputs"]


@pytest.mark.parametrize("name", ["trio", "vllm"])
def test_n2_is_the_same_server_with_two_api_servers(bs: Any, name: str) -> None:
    two = bs._frontend_command(f"{name}-n2", "/vllm/python", 8000, 9000, False)
    one = bs._frontend_command(name, "/vllm/python", 8000, 9000, False)
    assert two == [*one, "--api-server-count", "2"]
