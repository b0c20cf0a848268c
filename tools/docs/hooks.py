"""mkdocs hooks (``hooks:`` in mkdocs.yml).

* The API reference lists every name of ``trio_vllm.__all__`` (and of
  ``trio_vllm.testing.__all__``): a page writes ``<!-- api: MODULE -->`` and gets one
  mkdocstrings block per public name, so a new public name is documented without
  editing the page, and one that mkdocstrings cannot find fails ``mkdocs build --strict``.
* Pages under docs/ that the nav does not list are appended to it, so a branch that adds
  a page builds before anyone edits the nav.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from typing import Any

_MARKER = re.compile(r"<!-- api: ([\w.]+) -->")


_expected: dict[str, list[str]] = {}  # page -> the identifiers it must render


def _blocks(match: re.Match[str], page: str) -> str:
    module_name = match.group(1)
    module = importlib.import_module(module_name)
    names = [f"{module_name}.{n}" for n in module.__all__ if not n.startswith("__")]
    _expected.setdefault(page, []).extend(names)
    return "\n\n".join(f"::: {name}" for name in names)


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    src = page.file.src_path
    _expected.pop(src, None)
    return _MARKER.sub(lambda m: _blocks(m, src), markdown)


def on_post_page(output: str, page: Any, **kwargs: Any) -> str:
    # Every listed name must come out as a heading with its docstring's anchor.
    missing = [n for n in _expected.get(page.file.src_path, []) if f'id="{n}"' not in output]
    if missing:
        from mkdocs.exceptions import PluginError

        raise PluginError(f"{page.file.src_path}: not rendered: {', '.join(missing)}")
    return output


def _listed(nav: Any) -> set[str]:
    found: set[str] = set()
    if isinstance(nav, str):
        found.add(nav)
    elif isinstance(nav, list):
        for item in nav:
            found |= _listed(item)
    elif isinstance(nav, dict):
        for value in nav.values():
            found |= _listed(value)
    return found


def on_config(config: Any, **kwargs: Any) -> Any:
    nav = config.get("nav")
    if nav:
        docs = Path(config["docs_dir"])
        listed = _listed(nav)
        extra = sorted(
            str(p.relative_to(docs))
            for p in docs.rglob("*.md")
            if str(p.relative_to(docs)) not in listed
        )
        if extra:
            nav.append({"More": extra})
    return config
