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
