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
