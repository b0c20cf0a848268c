"""A client process killed outright (SIGKILL: no cleanup runs) leaves no engine behind.

The engines run in their own session, so nothing else would stop them; they watch the
client's pid (``--parent-pid``) and shut down once it is gone. Its ipc directory is the
one thing such a client leaves: nothing of it runs to remove the directory.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

from _procs import alive

pytestmark = pytest.mark.timeout(60)

_CLIENT = textwrap.dedent(
    """
    import json, sys, trio
    import trio_vllm as tv

    async def main():
        async with tv.open_client(tv.ReferenceEngines(2, model="echo"), ready_timeout=30) as c:
            print(json.dumps(sorted(c.engine_pids.values())), flush=True)
            await trio.sleep_forever()

    trio.run(main)
    """
)


def test_engines_stop_when_their_client_is_killed() -> None:
    # A temporary directory of its own: what the killed client leaves is looked at and
    # removed here, not counted as a leak of the run (tests/conftest.py).
    own_tmp = tempfile.mkdtemp(prefix="tv-kill-")
    client = subprocess.Popen(
        [sys.executable, "-c", _CLIENT],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "TMPDIR": own_tmp},
    )
    try:
        assert client.stdout is not None
        line = client.stdout.readline()
        assert line, f"client did not start: {client.stderr.read() if client.stderr else ''}"
        pids: list[int] = json.loads(line)
        assert len(pids) == 2
        assert all(alive(pid) for pid in pids)
    finally:
        os.kill(client.pid, signal.SIGKILL)
        client.wait()
        if client.stdout is not None:
            client.stdout.close()
        if client.stderr is not None:
            client.stderr.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(alive(pid) for pid in pids):
        time.sleep(0.05)
    left = [pid for pid in pids if alive(pid)]
    for pid in left:  # do not leak them into the rest of the run
        os.kill(pid, signal.SIGKILL)
    leftovers = {
        name: sorted(os.listdir(os.path.join(own_tmp, name))) for name in os.listdir(own_tmp)
    }
    shutil.rmtree(own_tmp)
    assert not left, f"engines {left} outlived their killed client"
    # The one exit that leaves the client's ipc directory (sockets and all): SIGKILL.
    assert len(leftovers) == 1, leftovers
    [(name, inside)] = leftovers.items()
    assert name.startswith("trio-vllm-")
    assert {"handshake", "input", "output"} <= set(inside), inside
