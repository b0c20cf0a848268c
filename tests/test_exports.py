"""Public names: one home (``trio_vllm``), reported as such, and typed without ``Any``."""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import sys
import typing
from typing import TYPE_CHECKING

import msgspec
import numpy as np
import pytest

import trio_vllm
import trio_vllm.client
import trio_vllm.sync

if TYPE_CHECKING:
    import types


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


def _defining_module(obj: object) -> types.ModuleType:
    """Where ``obj`` was written (``__module__`` says ``trio_vllm`` once published): a
    function's globals, else the deepest trio_vllm module that holds it."""
    function = inspect.unwrap(obj) if inspect.isfunction(obj) else None
    if function is None and inspect.isclass(obj):
        function = next(
            (f for f in vars(obj).values() if inspect.isfunction(f)),
            None,
        )
    if function is not None:
        return sys.modules[function.__globals__["__name__"]]
    holders = [
        m
        for name, m in list(sys.modules.items())
        if name.startswith("trio_vllm.") and getattr(m, getattr(obj, "__name__", ""), None) is obj
    ]
    if not holders:
        return sys.modules[obj.__module__]  # type: ignore[attr-defined]
    return max(holders, key=lambda m: m.__name__.count("."))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


@functools.cache
def _type_namespace(module: types.ModuleType) -> dict[str, object]:
    """The module's globals plus the names it imports under ``if TYPE_CHECKING:``, so
    its string annotations resolve (aliases included: an alias of ``Any`` is ``Any``)."""
    namespace = dict(vars(module))
    package = module.__name__ if hasattr(module, "__path__") else module.__name__.rpartition(".")[0]
    tree = ast.parse(inspect.getsource(module))
    for node in ast.walk(tree):
        if not (isinstance(node, ast.If) and _is_type_checking(node.test)):
            continue
        for stmt in ast.walk(node):
            if isinstance(stmt, ast.ImportFrom):
                source = importlib.import_module(
                    "." * stmt.level + (stmt.module or ""), package if stmt.level else None
                )
                for alias in stmt.names:
                    value = getattr(source, alias.name, None)
                    if value is None:
                        value = importlib.import_module(f"{source.__name__}.{alias.name}")
                    namespace[alias.asname or alias.name] = value
            elif isinstance(stmt, ast.Import):
                for alias in stmt.names:
                    imported = importlib.import_module(alias.name)
                    if alias.asname:
                        namespace[alias.asname] = imported
                    else:
                        namespace[alias.name.partition(".")[0]] = sys.modules[
                            alias.name.partition(".")[0]
                        ]
    return namespace


def _hints(target: object, module: types.ModuleType) -> dict[str, object]:
    namespace = _type_namespace(module)
    if typing.is_typeddict(target):
        # A TypedDict's forward references name the module it was made in, whose
        # TYPE_CHECKING imports get_type_hints cannot see: evaluated here instead.
        return {
            key: eval(
                hint.__forward_arg__ if isinstance(hint, typing.ForwardRef) else hint, namespace
            )
            if isinstance(hint, (str, typing.ForwardRef))
            else hint
            for key, hint in target.__annotations__.items()
        }
    return typing.get_type_hints(target, globalns=namespace, include_extras=True)


def _any_in(tp: object, module: types.ModuleType, path: str) -> list[str]:
    """Where ``Any`` occurs in the resolved annotation ``tp`` (TypedDicts of ``**kwargs``
    and type aliases walked into)."""
    if tp is typing.Any:
        return [path]
    if typing.is_typeddict(tp):
        assert isinstance(tp, type)
        found = []
        for key, hint in _hints(tp, _defining_module(tp)).items():
            found += _any_in(hint, module, f"{path}[{key!r}]")
        return found
    found = []
    if typing.get_origin(tp) is np.ndarray:
        # numpy's own spelling of "any shape" is Any (npt.NDArray); the dtype is checked.
        return _any_in(typing.get_args(tp)[1], module, path)
    for arg in typing.get_args(tp):
        for item in arg if isinstance(arg, (list, tuple)) else [arg]:
            found += _any_in(item, module, path)
    return found


def _members(obj: object) -> list[tuple[str, object]]:
    if not inspect.isclass(obj):
        return [("", obj)]
    found: list[tuple[str, object]] = []
    for name, member in inspect.getmembers(obj):
        if name.startswith("_") and name not in ("__init__", "__anext__", "__next__"):
            continue
        target = member.fget if isinstance(member, property) else member
        if inspect.isfunction(target) and target.__module__.startswith("trio_vllm"):
            found.append((name, target))
    return found


def _public_callables() -> list[str]:
    return sorted(
        name
        for name in trio_vllm.__all__
        if _defined_here(getattr(trio_vllm, name))
        and not (
            isinstance(getattr(trio_vllm, name), type)
            and issubclass(getattr(trio_vllm, name), (msgspec.Struct, BaseException))
        )
    )


def test_the_walk_covers_the_entry_points() -> None:
    names = _public_callables()
    for entry in ("open_client", "SyncClient", "open_llm", "SyncLLM", "ClientOptions"):
        assert entry in names
    offending = _any_in(
        typing.Unpack[typing.TypedDict("T", {"x": dict[str, typing.Any]})],  # type: ignore[operator]
        sys.modules[__name__],
        "kw",
    )
    assert offending == ["kw['x']"]


@pytest.mark.parametrize("name", _public_callables())
def test_no_any_in_public_signatures(name: str) -> None:
    """No public callable of ``trio_vllm`` (functions, classes' constructors, public
    methods and properties; TypedDicts of ``**options``) has ``Any`` in its signature,
    with aliases resolved (issue 24)."""
    obj = getattr(trio_vllm, name)
    offending = []
    if typing.is_typeddict(obj):
        offending = _any_in(obj, _defining_module(obj), name)
    for member, target in _members(obj):
        module = sys.modules[inspect.unwrap(target).__globals__["__name__"]]  # type: ignore[attr-defined]
        for param, hint in _hints(target, module).items():
            offending += _any_in(hint, module, f"{name}.{member}({param})".replace(".(", "("))
    assert offending == []
