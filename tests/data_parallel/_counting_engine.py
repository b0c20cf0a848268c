"""The reference engine plus engine-side bookkeeping for the data-parallel tests.

Runs ``trio_vllm.reference_engine`` unchanged except that it records every ADD and
ABORT it receives, and offers two more utilities: ``dp_counts`` (what it received)
and ``emit_eep`` (send an elastic-EP notice, reserved call id -1, to client 0). The
tests ask the engines themselves where requests and aborts went.
"""

from __future__ import annotations

import sys
from typing import Any


def main() -> int:
    from trio_vllm.reference_engine import _server, _utilities
    from trio_vllm.reference_engine._options import parse_options

    added: list[str] = []
    aborted: list[str] = []
    server_cls = _server.EngineServer
    original_add = server_cls._handle_add
    original_abort = server_cls._handle_abort

    def handle_add(self: Any, req: Any) -> None:
        added.append(req.request_id)
        original_add(self, req)

    def handle_abort(self: Any, request_ids: list[str]) -> None:
        aborted.extend(request_ids)
        original_abort(self, request_ids)

    def dp_counts(self: Any) -> dict[str, Any]:
        return {"rank": self._server.rank, "added": added, "aborted": aborted}

    def emit_eep(self: Any, kind: str) -> bool:
        self._server._reply(0, -1, None, [kind, self._server.rank])
        return True

    server_cls._handle_add = handle_add  # type: ignore[method-assign]
    server_cls._handle_abort = handle_abort  # type: ignore[method-assign]
    _utilities.Utilities.dp_counts = dp_counts  # type: ignore[attr-defined]
    _utilities.Utilities.emit_eep = emit_eep  # type: ignore[attr-defined]
    return _server.run_engine(parse_options())


if __name__ == "__main__":
    sys.exit(main())
