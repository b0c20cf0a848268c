"""Fault injection: the control socket's commands (``--control-address``) and the
``--*-after-steps`` faults. docs/reference-engine.md lists both."""

from __future__ import annotations

import json
import os
import time
from typing import TYPE_CHECKING, Any

import zmq

from ._errors import FatalEngineError, log

if TYPE_CHECKING:
    from collections.abc import Callable

    from ._state import EngineState

__all__ = ["ControlChannel", "StepFaults"]


class ControlChannel:
    """Answers JSON commands on the engine's REP control socket, one per readable poll."""

    def __init__(self, sock: zmq.Socket[bytes], engine: EngineState) -> None:
        self.socket = sock
        self._engine = engine

    def serve(self) -> None:
        """Answer one queued command (none queued: nothing). ``kill`` and ``dead`` act
        after the reply is sent: exit at once, or `FatalEngineError`."""
        try:
            raw = self.socket.recv(flags=zmq.NOBLOCK)
        except zmq.Again:
            return
        try:
            command = json.loads(raw)
            name = command["cmd"]
        except (ValueError, KeyError, TypeError) as exc:
            self.socket.send_json({"ok": False, "error": f"bad command: {exc}"})
            return
        engine = self._engine
        reply: dict[str, Any] = {"ok": True}
        after: Callable[[], None] | None = None
        if name == "ping":
            reply.update(
                pid=os.getpid(),
                steps=engine.steps,
                running=len(engine.scheduler.running) if engine.loaded else 0,
                waiting=len(engine.scheduler.waiting) if engine.loaded else 0,
                firehose=engine.firehose_requests(),
                stalled=engine.stalled,
                input_dead=engine.input_dead,
                output_dead=engine.output.dead,
            )
        elif name == "kill":
            code = int(command.get("code", 1))
            after = lambda: _exit_now(code)  # noqa: E731
        elif name == "dead":
            after = _raise_dead
        elif name == "stall":
            engine.stalled = True
        elif name == "unstall":
            engine.stalled = False
        elif name == "garbage":
            engine.output.send_garbage()
        elif name == "delay":
            engine.output.delay_ms = float(command.get("ms", 0))
        elif name == "fail_utility":
            engine.options.fail_utilities.add(str(command["name"]))
        elif name == "unfail_utility":
            engine.options.fail_utilities.discard(str(command["name"]))
        elif name == "shutdown":
            engine.shutdown_requested = True
        else:
            reply = {"ok": False, "error": f"unknown command {name!r}"}
        self.socket.send_json(reply)
        if after is not None:
            after()


def _exit_now(code: int) -> None:
    time.sleep(0.05)  # let the control reply leave
    os._exit(code)


def _raise_dead() -> None:
    raise FatalEngineError("ENGINE_CORE_DEAD requested on the control socket")


class StepFaults:
    """The ``--garbage/die/dead/stall-after-steps`` faults, checked after each step."""

    def __init__(self, engine: EngineState) -> None:
        self._engine = engine
        self._garbage_sent = False

    def after_step(self) -> None:
        engine = self._engine
        opts = engine.options
        n = engine.steps
        if (
            opts.garbage_after_steps is not None
            and n >= opts.garbage_after_steps
            and not (self._garbage_sent)
        ):
            self._garbage_sent = True
            engine.output.send_garbage()
        if opts.die_after_steps is not None and n >= opts.die_after_steps:
            log(f"fault injection: dying after step {n}")
            os._exit(1)
        if opts.dead_after_steps is not None and n >= opts.dead_after_steps:
            raise FatalEngineError(f"fault injection: ENGINE_CORE_DEAD after step {n}")
        if opts.stall_after_steps is not None and n >= opts.stall_after_steps:
            if not engine.stalled:
                log(f"fault injection: stalling after step {n}")
            engine.stalled = True
            opts.stall_after_steps = None
