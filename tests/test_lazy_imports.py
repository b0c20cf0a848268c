"""``import trio_vllm`` stays cheap for engine processes; every public name still resolves."""

from __future__ import annotations

import subprocess
import sys

import pytest

import trio_vllm


def test_engine_entry_point_does_not_import_the_client() -> None:
    code = (
        "import sys, trio_vllm.reference_engine.__main__, trio_vllm.reference_engine._server\n"
        "heavy = sorted(m for m in ('trio', 'anyio', 'trio_vllm.client') if m in sys.modules)\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == ""


def test_every_public_name_resolves() -> None:
    assert len(set(trio_vllm.__all__)) == len(trio_vllm.__all__)
    for name in trio_vllm.__all__:
        assert getattr(trio_vllm, name) is not None, name
    assert set(trio_vllm.__all__) <= set(dir(trio_vllm))
    namespace: dict[str, object] = {}
    exec("from trio_vllm import *", namespace)
    assert set(trio_vllm.__all__) <= set(namespace)
    from trio_vllm.client import open_client
    from trio_vllm.sync import SyncClient

    assert trio_vllm.open_client is open_client
    assert trio_vllm.SyncClient is SyncClient


def test_unknown_names_still_raise() -> None:
    with pytest.raises(AttributeError, match="no_such_name"):
        trio_vllm.no_such_name  # type: ignore[attr-defined]  # noqa: B018


def test_client_imports_and_runs_on_asyncio_without_trio() -> None:
    # The in-process adapter runs the client in vLLM's own interpreter, which has anyio but
    # no trio: the client must neither import trio nor need it on asyncio.
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'trio' or name.startswith('trio.'):\n"
        "            raise ImportError('trio is blocked')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import anyio\n"
        "from trio_vllm.client import ReferenceEngines, make_request, open_client\n"
        "async def main():\n"
        "    async with open_client(ReferenceEngines(model='echo'), ready_timeout=60) as c:\n"
        "        async with c.generate(make_request([1, 5, 7], max_tokens=4)) as s:\n"
        "            print(sum([len(o.new_token_ids) async for o in s]))\n"
        "anyio.run(main, backend='asyncio')\n"
        "print('trio' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=90, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["4", "False"]
