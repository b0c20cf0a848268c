"""Public names: one home (``trio_vllm``), reported as such, and typed without ``Any``."""

from __future__ import annotations

import inspect
import re

import msgspec
import pytest

import trio_vllm
import trio_vllm.client
import trio_vllm.sync

# Classes and functions of the public API whose signatures users type-check against.
TYPED = (
    "EngineCoreClient",
    "EngineEvents",
    "RequestStream",
    "SyncClient",
    "SyncRequestStream",
    "SyncEngineEvents",
    "open_client",
    "make_request",
)
_ANY = re.compile(r"\bAny\b")


def _defined_here(obj: object) -> bool:
    return inspect.isclass(obj) or inspect.isfunction(obj)


def test_all_is_unique_and_resolves() -> None:
    assert len(set(trio_vllm.__all__)) == len(trio_vllm.__all__)
    for name in trio_vllm.__all__:
        assert hasattr(trio_vllm, name), name


@pytest.mark.parametrize("name", sorted(trio_vllm.__all__))
def test_public_names_report_the_public_module(name: str) -> None:
    obj = getattr(trio_vllm, name)
    if isinstance(obj, type) and issubclass(obj, msgspec.Struct):
        # msgspec resolves a struct's annotations in its module: it must stay there.
        assert obj.__module__.startswith("trio_vllm."), obj.__module__
    elif _defined_here(obj):
        assert obj.__module__ == "trio_vllm", f"{name}.__module__ is {obj.__module__}"


def test_subpackages_re_export_the_same_objects() -> None:
    """``trio_vllm.client`` and ``trio_vllm.sync`` hand out the very objects of
    ``trio_vllm`` (one definition each), and every name they export is public there."""
    for module in (trio_vllm.client, trio_vllm.sync):
        for name in module.__all__:
            assert name in trio_vllm.__all__, f"{module.__name__}.{name} is not in trio_vllm"
            assert getattr(module, name) is getattr(trio_vllm, name)


def _annotations(obj: object) -> list[tuple[str, str]]:
    found: list[tuple[str, str]] = []
    members = [("", obj)]
    if inspect.isclass(obj):
        members = [
            (name, member)
            for name, member in inspect.getmembers(obj)
            if not name.startswith("_") or name in ("__init__", "__anext__", "__next__")
        ]
    for name, member in members:
        target = member.fget if isinstance(member, property) else member
        if not callable(target):
            continue
        try:
            signature = inspect.signature(target)
        except (TypeError, ValueError):
            continue
        annotations = [str(p.annotation) for p in signature.parameters.values()]
        annotations.append(str(signature.return_annotation))
        found.extend((name, a) for a in annotations)
    return found


@pytest.mark.parametrize("name", TYPED)
def test_no_any_in_public_signatures(name: str) -> None:
    obj = getattr(trio_vllm, name)
    offending = [(member, a) for member, a in _annotations(obj) if _ANY.search(a)]
    assert offending == []
