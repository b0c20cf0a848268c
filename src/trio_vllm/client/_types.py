"""The session's types as the client's shell holds them (type checking only).

`ClientSession` is generic in the shell's handles: the client's streams are
`RequestStream` and its utility calls `Call`, so mypy checks that every action the
shell carries out names the shell's own objects (no ``isinstance`` re-assertions).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeAlias

if TYPE_CHECKING:
    from ..protocol.session import Action, ClientSession
    from ._calls import Call
    from ._streams import RequestStream

__all__ = ["Session", "ShellAction"]

#: The client's session: streams are `RequestStream`, calls `Call`.
Session: TypeAlias = "ClientSession[RequestStream, Call]"
#: One action of that session.
ShellAction: TypeAlias = "Action[RequestStream, Call]"
