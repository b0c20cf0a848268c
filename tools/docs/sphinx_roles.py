"""A griffe extension for the API reference: Sphinx roles in docstrings as code spans.

Docstrings written for ``help()`` and Sphinx say :func:`~trio_vllm.open_client` or
:class:`EngineCoreClient`; mkdocstrings renders Markdown, where a role would show as
raw text. Rewritten at load time, so the sources need no change for the site:
``:role:`~a.b.c``` becomes ``c`` and ``:role:`a.b.c``` becomes ``a.b.c``, as code.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?[a-z]+:`(~?)\.?([^`<]+?)(?:\s*<[^>]*>)?`")


def plain(text: str) -> str:
    def sub(match: re.Match[str]) -> str:
        target = match.group(2).strip()
        if match.group(1):
            target = target.rsplit(".", 1)[-1]
        return f"`{target}`"

    return _ROLE.sub(sub, text)


class SphinxRoles(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = plain(obj.docstring.value)


def _rewrite(paths: list[str]) -> int:
    """Rewrite the roles in these files (or the .py files under these folders) in place."""
    from pathlib import Path

    changed = 0
    for arg in paths:
        root = Path(arg)
        for path in [root] if root.is_file() else sorted(root.rglob("*.py")):
            text = path.read_text()
            new = plain(text)
            if new != text:
                path.write_text(new)
                changed += 1
                print(f"rewrote {path}")
    return changed


if __name__ == "__main__":
    import sys

    # python tools/docs/sphinx_roles.py PATH...: the same conversion in the sources.
    _rewrite(sys.argv[1:])
