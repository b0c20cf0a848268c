"""LoRA adapters as model names (reference engine with ``--max-loras``; a random PEFT
adapter written by the testing kit): ``/v1/models``, routing, runtime load/unload, and
``lora_request=`` on the text frontend."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import openai
import pytest

import trio_vllm as tv
from trio_vllm import InvalidRequestError
from trio_vllm.llm import open_llm
from trio_vllm.protocol import LoRARequest, SamplingParams
from trio_vllm.server import LoRAModulePath, OpenAIServer, parse_lora_modules
from trio_vllm.testing import write_lora_adapter

from ._util import serving

if TYPE_CHECKING:
    from trio_vllm.llm import LLM

pytestmark = pytest.mark.anyio

TINY = Path(__file__).resolve().parents[3] / "shared" / "interop" / "tiny-llama"


def test_parse_lora_modules() -> None:
    mods = parse_lora_modules(
        ["a=/p/a", "", '{"name": "b", "path": "/p/b", "base_model_name": "m"}']
    )
    assert mods == [
        LoRAModulePath(name="a", path="/p/a"),
        LoRAModulePath(name="b", path="/p/b", base_model_name="m"),
    ]
    with pytest.raises(ValueError, match="Invalid JSON format for --lora-modules"):
        parse_lora_modules(["not json"])
    with pytest.raises(ValueError, match="Invalid fields for --lora-modules"):
        parse_lora_modules(['{"name": "c"}'])


class _Recording:
    """The frontend, recording the ``lora_request`` of every generate call."""

    def __init__(self, llm: LLM) -> None:
        self._llm = llm
        self.loras: list[LoRARequest | None] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._llm, name)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        self.loras.append(kwargs.get("lora_request"))
        return self._llm.generate(*args, **kwargs)


async def test_lora_modules_served_and_routed(tmp_path: Path) -> None:
    if not (TINY / "config.json").exists():
        pytest.skip(f"the tiny model is missing: {TINY}")
    adapter = write_lora_adapter(tmp_path / "adapter", TINY)
    assert (adapter / "adapter_config.json").exists()
    engines = tv.ReferenceEngines(1, model="echo", extra_args=["--max-loras", "3"])
    async with open_llm(engines) as llm:
        # the text layer: lora_request= reaches the engine (it loads the adapter)
        lora = LoRARequest("direct", 7, str(adapter))
        out = await llm.generate_final("ab", SamplingParams(max_tokens=2), lora_request=lora)
        assert out.outputs[0].token_ids
        assert await llm.client.list_loras() == {7}

        frontend = _Recording(llm)
        async with serving(
            frontend,  # type: ignore[arg-type]
            lora_modules=[LoRAModulePath(name="tiny-lora", path=str(adapter))],
            allow_runtime_lora_updating=True,
        ) as served:
            app = served.app
            await app.load_static_loras()
            assert await llm.client.list_loras() == {7, 1}  # vLLM counts ids from 1
            base = app.model_names[0]
            async with httpx.AsyncClient(base_url=served.base_url, timeout=30) as http:
                cards = (await http.get("/v1/models")).json()["data"]
                assert [c["id"] for c in cards] == [base, "tiny-lora"]
                assert cards[1]["root"] == str(adapter)
                assert cards[1]["parent"] == base
                assert cards[1]["max_model_len"] is None

                async with openai.AsyncOpenAI(
                    base_url=f"{served.base_url}/v1", api_key="x", max_retries=0
                ) as client:
                    r = await client.completions.create(
                        model="tiny-lora", prompt="hello", max_tokens=3, temperature=0
                    )
                    assert r.model == "tiny-lora"
                    assert frontend.loras[-1] == LoRARequest("tiny-lora", 1, str(adapter))
                    await client.completions.create(model=base, prompt="hi", max_tokens=1)
                    assert frontend.loras[-1] is None
                    with pytest.raises(openai.NotFoundError) as info:
                        await client.completions.create(model="nope", prompt="x", max_tokens=1)
                    assert info.value.status_code == 404
                    assert "The model `nope` does not exist." in str(info.value)
                r2 = await http.post("/tokenize", json={"model": "tiny-lora", "prompt": "a"})
                assert r2.status_code == 200

                # runtime load / unload, vLLM's answers
                body = {"lora_name": "second", "lora_path": str(adapter)}
                r2 = await http.post("/v1/load_lora_adapter", json=body)
                assert (r2.status_code, r2.text) == (
                    200,
                    "Success: LoRA adapter 'second' added successfully.",
                )
                assert await llm.client.list_loras() == {7, 1, 2}
                r2 = await http.post("/v1/load_lora_adapter", json=body)
                assert r2.status_code == 400
                assert "has already been loaded" in r2.json()["error"]["message"]
                r2 = await http.post(
                    "/v1/load_lora_adapter", json={"lora_name": base, "lora_path": "/x"}
                )
                assert r2.status_code == 400
                assert "conflicts with a served base model" in r2.json()["error"]["message"]
                r2 = await http.post("/v1/unload_lora_adapter", json={"lora_name": "second"})
                assert (r2.status_code, r2.text) == (
                    200,
                    "Success: LoRA adapter 'second' removed successfully.",
                )
                r2 = await http.post("/v1/unload_lora_adapter", json={"lora_name": "second"})
                assert r2.status_code == 404
                r2 = await http.post(
                    "/v1/completions", json={"model": "second", "prompt": "a", "max_tokens": 1}
                )
                assert r2.status_code == 404

        # runtime updating off (the default without VLLM_ALLOW_RUNTIME_LORA_UPDATING)
        async with (
            serving(llm, allow_runtime_lora_updating=False) as served,
            httpx.AsyncClient(base_url=served.base_url, timeout=30) as http,
        ):
            r2 = await http.post("/v1/load_lora_adapter", json=body)
            assert r2.status_code == 404


async def test_lora_refused_without_lora_support(tmp_path: Path) -> None:
    async with open_llm(tv.ReferenceEngines(1, model="echo")) as llm:
        # refused when the request is sent (entering the block): nothing reaches the engine
        with pytest.raises(InvalidRequestError, match="LoRA is not enabled"):
            async with llm.generate("ab", lora_request=LoRARequest("a", 1, str(tmp_path))):
                pass
        assert llm.num_requests == 0
        app = OpenAIServer(llm, lora_modules=[LoRAModulePath(name="a", path=str(tmp_path))])
        with pytest.raises(ValueError, match="LoRA is not enabled"):
            await app.load_static_loras()
        assert app.loras.requests == {}


def test_sync_llm_takes_lora_request(tmp_path: Path) -> None:
    engines = tv.ReferenceEngines(1, model="echo", extra_args=["--max-loras", "1"])
    with tv.SyncLLM(engines) as llm:
        lora = LoRARequest("s", 3, str(tmp_path))
        out = llm.generate_final("ab", SamplingParams(max_tokens=2), lora_request=lora)
        assert out.outputs[0].token_ids
