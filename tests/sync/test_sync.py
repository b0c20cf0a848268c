"""The blocking facade against real reference-engine processes.

Each test runs the facade's event loop on trio and on asyncio, and checks that the
background thread and the engine processes are gone after the ``with`` block.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from typing import TYPE_CHECKING, Any

import anyio
import pytest

from trio_vllm import EngineDeadError, EngineStartupError, UtilityCallError
from trio_vllm.client import ReferenceEngines, make_request
from trio_vllm.sync import SyncClient, SyncRequestStream

if TYPE_CHECKING:
    from collections.abc import Iterator
from pathlib import Path

# Generous: the machine is shared, and a loaded one starts engines slowly.
READY = 120
# A context so long that an un-aborted request keeps the engine busy for minutes.
LONG = ["--max-model-len", "1000000", "--num-gpu-blocks", "1000000"]


@pytest.fixture(params=["trio", "asyncio"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def new_threads(before: set[int | None]) -> list[threading.Thread]:
    """Threads started since ``before``, except trio's idle thread-cache workers.

    trio runs ``subprocess.Popen`` in its process-wide thread cache, whose idle workers
    ("Trio thread N") exit by themselves after 10 s; they belong to trio, not to the
    client (``test_no_thread_at_all_after_idle_timeout`` waits them out once).
    """
    return [
        t
        for t in threading.enumerate()
        if t.ident not in before and not t.name.startswith("Trio thread ")
    ]


@pytest.fixture(autouse=True)
def no_thread_left() -> Iterator[None]:
    before = {t.ident for t in threading.enumerate()}
    yield
    left = new_threads(before)
    assert left == [], f"threads outlived the SyncClient: {left}"


def echo_tokens(prompt: list[int], n: int) -> list[int]:
    return [prompt[i % len(prompt)] for i in range(n)]


def process_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _children(pid: int) -> list[int]:
    found: list[int] = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            text = Path(f"/proc/{pid}/task/{task}/children").read_text()
            found.extend(int(p) for p in text.split())
    return found


def engine_is_idle(client: SyncClient, probe_s: float = 8) -> bool:
    """True if no request runs on the engine: a ``wait`` pause then completes at once.

    An un-aborted request (900,000 tokens) keeps the pause waiting for minutes; an idle
    engine answers in milliseconds, given ``probe_s`` on a loaded machine.
    """
    portal, async_client = client.portal, client.async_client

    async def probe() -> bool:
        import anyio

        with anyio.move_on_after(probe_s):
            await async_client.pause_scheduler("wait", False)
            await async_client.resume_scheduler()
            return True
        return False

    return portal.call(probe)


def test_generate_raw_api_and_utilities(backend: str) -> None:
    with SyncClient(ReferenceEngines(model="echo"), backend=backend, ready_timeout=READY) as client:
        pids = list(client.engine_pids.values())
        assert client.ranks == [0]
        assert client.vllm_version == "0.32.0"
        assert client.max_model_len == 2048
        # generate: a blocking iterator, one output per step, final one carries the reason.
        stream = client.generate(make_request([1, 5, 7], max_tokens=10))
        outputs = list(stream)
        assert [t for o in outputs for t in o.new_token_ids] == echo_tokens([1, 5, 7], 10)
        assert outputs[-1].finish_reason == 1
        assert stream.finish_reason == 1
        assert stream.closed
        assert not stream.aborted
        # raw API: add_request + blocking get_output until the final output.
        request = make_request([3, 4], max_tokens=5)
        client.add_request(request)
        tokens: list[int] = []
        finished = False
        while not finished:
            for out in client.get_output(timeout=10).outputs:
                assert out.request_id == request.request_id
                tokens.extend(out.new_token_ids)
                finished = out.finish_reason is not None
        assert tokens == echo_tokens([3, 4], 5)
        with pytest.raises(TimeoutError):
            client.get_output(timeout=0.2)
        # utilities, named and raw.
        assert "generate" in client.get_supported_tasks()
        assert client.call_utility("collective_rpc", "echo", None, [7], None) == [[7]]
        tasks = list(client.get_supported_tasks())
        assert client.call_utility_all("get_supported_tasks") == [tasks]
        assert client.reset_prefix_cache() is True
        client.set_weight_version("v2")
        assert client.get_weight_version() == "v2"
        assert client.is_sleeping() is False
        with pytest.raises(UtilityCallError):
            client.call_utility("no_such_method")
        dup = make_request([1], max_tokens=50, request_id="dup")
        with client.generate(dup), pytest.raises(ValueError, match="already live"):
            client.add_request(make_request([2], request_id="dup"))
        assert client.live_requests == []
    assert client.dead
    with pytest.raises(EngineDeadError, match="closed"):
        client.get_supported_tasks()
    assert all(process_gone(pid) for pid in pids)


@pytest.mark.parametrize("how", ["break", "close", "exception"])
def test_leaving_generate_early_aborts_on_the_engine(backend: str, how: str) -> None:
    engines = ReferenceEngines(model="echo", extra_args=LONG)
    with SyncClient(engines, backend=backend, ready_timeout=READY) as client:
        request = make_request([1, 2, 3], max_tokens=900_000)
        if how == "break":
            for _ in client.generate(request):
                break  # CPython drops the stream here, which closes it
        elif how == "close":
            stream = client.generate(request)
            next(stream)
            stream.close()
            assert stream.aborted
        else:

            def consume() -> None:
                with client.generate(request) as stream:
                    next(stream)
                    raise KeyError(stream)

            with pytest.raises(KeyError) as info:
                consume()
            assert info.value.args[0].aborted
        assert client.live_requests == []
        assert engine_is_idle(client)
        # The id is free again and the engine still works.
        again = client.generate(make_request([4], max_tokens=2, request_id=request.request_id))
        assert again.collect() == [4, 4]


def test_unaborted_request_keeps_engine_busy(backend: str) -> None:
    """Control for the test above: the idle probe does detect a running request."""
    engines = ReferenceEngines(model="echo", extra_args=LONG)
    with SyncClient(engines, backend=backend, ready_timeout=READY) as client:
        stream = client.generate(make_request([1, 2, 3], max_tokens=900_000))
        next(stream)
        assert not engine_is_idle(client, probe_s=3)
        # Closing the client with the stream open aborts it and returns promptly, not
        # after the 900,000 tokens (a hang guard: how promptly measures the machine).
        started = time.monotonic()
    assert time.monotonic() - started < 30
    assert stream.closed


def test_engine_death_raises_in_blocked_callers(backend: str) -> None:
    engines = ReferenceEngines(model="echo", extra_args=LONG)
    with SyncClient(engines, backend=backend, ready_timeout=READY) as client:
        (pid,) = client.engine_pids.values()
        stream = client.generate(make_request([1, 2], max_tokens=900_000))
        next(stream)
        errors: list[BaseException] = []

        def blocked_get_output() -> None:
            try:
                while True:  # batches with scheduler stats only may come first
                    client.get_output()
            except BaseException as exc:
                errors.append(exc)

        waiter = threading.Thread(target=blocked_get_output)
        waiter.start()
        time.sleep(0.2)
        os.kill(pid, signal.SIGKILL)
        waiter.join(timeout=30)  # a hang guard
        assert not waiter.is_alive()
        assert len(errors) == 1
        assert isinstance(errors[0], EngineDeadError)
        with pytest.raises(EngineDeadError, match="died"):
            for _ in stream:
                pass
        assert stream.closed
        with pytest.raises(EngineDeadError):
            client.get_supported_tasks()
        with pytest.raises(EngineDeadError):
            client.generate(make_request([1], max_tokens=2))
        assert client.dead


def _wait_until_finished(client: SyncClient, stream: SyncRequestStream) -> None:
    """Until the engine has sent the request's final output (reaches into the async
    stream, which only the client's event loop may touch: through the portal)."""

    async def wait() -> None:
        import anyio

        with anyio.fail_after(30):
            while not stream._stream.finished:  # noqa: ASYNC110
                await anyio.sleep(0.01)

    client.portal.call(wait)


def _wait_until_buffered(client: SyncClient, stream: SyncRequestStream, n: int) -> None:
    """Until the async stream holds ``n`` outputs not yet fetched (a sleep would assume
    how fast a loaded machine runs the engine)."""

    async def wait() -> None:
        import anyio

        with anyio.fail_after(30):
            while len(stream._stream._pending) < n:  # noqa: ASYNC110
                await anyio.sleep(0.005)

    client.portal.call(wait)


def test_buffered_outputs_come_in_batches(backend: str) -> None:
    """Outputs that already arrived are fetched up to 1,024 per portal call, not one
    each, and the stream still hands them out one by one: finish_reason only with the
    last."""
    engines = ReferenceEngines(model="echo", extra_args=LONG)
    n = 3000
    with SyncClient(engines, backend=backend, ready_timeout=READY, stream_buffer=n) as client:
        stream = client.generate(make_request([1, 5, 7], max_tokens=n))
        _wait_until_finished(client, stream)
        calls = 0
        real_call = client._loop.call

        def counting_call(*args: Any, **kwargs: Any) -> Any:
            nonlocal calls
            calls += 1
            return real_call(*args, **kwargs)

        client._loop.call = counting_call  # type: ignore[method-assign]
        outputs = []
        for output in stream:
            outputs.append(output)
            assert (stream.finish_reason is None) == (output.finish_reason is None)
        assert [t for o in outputs for t in o.new_token_ids] == echo_tokens([1, 5, 7], n)
        assert len(outputs) == n  # nothing coalesced: the buffer held them all
        assert calls == 4, calls  # 1,024 + 1,024 + 952 outputs, then one to learn the end
        assert stream.finish_reason == 1
        assert stream.closed
        assert not stream.aborted


def test_abort_requests_stops_a_fetched_batch(backend: str) -> None:
    """abort_requests() ends the stream at once, also when outputs fetched before the
    abort are still waiting in the stream's batch (as the async stream drops its
    buffer)."""
    engines = ReferenceEngines(model="echo", extra_args=LONG)
    with SyncClient(engines, backend=backend, ready_timeout=READY, stream_buffer=100_000) as client:
        stream = client.generate(make_request([1, 2, 3], max_tokens=900_000))
        next(stream)
        while stream._batch:  # hand out what the first fetch brought
            next(stream)
        _wait_until_buffered(client, stream, 50)
        next(stream)  # fetches them as one batch
        assert len(stream._batch) >= 49, len(stream._batch)
        client.abort_requests([stream.request_id])
        assert list(stream) == []
        assert stream.aborted
        assert stream.closed
        assert engine_is_idle(client)


def test_engine_death_after_buffered_outputs(backend: str) -> None:
    """Outputs that arrived before the engine died are all handed out, in order and
    without a gap, then EngineDeadError; none is lost in a fetched batch."""
    engines = ReferenceEngines(model="echo", extra_args=LONG)
    with SyncClient(engines, backend=backend, ready_timeout=READY, stream_buffer=100_000) as client:
        (pid,) = client.engine_pids.values()
        stream = client.generate(make_request([1, 2, 3], max_tokens=900_000))
        tokens = list(next(stream).new_token_ids)
        _wait_until_buffered(client, stream, 100)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError):  # noqa: PT012 - the raise ends the loop
            for output in stream:
                tokens.extend(output.new_token_ids)
        assert len(tokens) > 100, len(tokens)
        assert tokens == echo_tokens([1, 2, 3], len(tokens))
        assert stream.closed


def test_startup_failure_raises_and_leaves_no_thread(backend: str) -> None:
    engines = ReferenceEngines(model="echo", faults=["--crash-on-startup", "no model here"])
    client = SyncClient(engines, backend=backend, ready_timeout=READY)
    with pytest.raises(EngineStartupError, match="no model here"):
        client.__enter__()
    with pytest.raises(RuntimeError, match="not open"):
        client.get_supported_tasks()


def test_methods_from_several_threads(backend: str) -> None:
    with SyncClient(ReferenceEngines(model="echo"), backend=backend, ready_timeout=READY) as client:
        results: dict[int, list[int]] = {}

        def worker(i: int) -> None:
            results[i] = client.generate(make_request([i + 1], max_tokens=20)).collect()

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=20)
        assert results == {i: [i + 1] * 20 for i in range(4)}


def test_no_thread_at_all_after_idle_timeout() -> None:
    """Strict version of the check: wait out trio's thread cache, then nothing is left."""
    before = {t.ident for t in threading.enumerate()}
    with SyncClient(ReferenceEngines(model="echo"), ready_timeout=READY) as client:
        assert any(t.name == "trio-vllm-sync" for t in threading.enumerate())
        assert client.generate(make_request([9], max_tokens=3)).collect() == [9, 9, 9]
    assert not any(t.name == "trio-vllm-sync" for t in threading.enumerate())
    deadline = time.monotonic() + 30  # the cache's 10 s, and a loaded machine's delays
    while time.monotonic() < deadline:
        left = [t for t in threading.enumerate() if t.ident not in before]
        if not left:
            break
        time.sleep(0.25)
    assert left == []


class Interrupted(Exception):
    pass


@contextlib.contextmanager
def interrupt_after(delay: float) -> Iterator[None]:
    """Raise :class:`Interrupted` in the main thread after ``delay`` s, like Ctrl-C would.

    Uses SIGUSR1 sent by a timer thread (SIGALRM belongs to pytest-timeout).
    """

    def handler(signum: int, frame: object) -> None:
        raise Interrupted

    previous = signal.signal(signal.SIGUSR1, handler)
    timer = threading.Timer(delay, os.kill, (os.getpid(), signal.SIGUSR1))
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        timer.join()
        signal.signal(signal.SIGUSR1, previous)


def test_interrupt_while_blocked_cancels_only_that_call(backend: str) -> None:
    """A signal handler raising in the caller (like Ctrl-C) cancels the waiting call."""
    with SyncClient(ReferenceEngines(model="echo"), backend=backend, ready_timeout=READY) as c:
        started = time.monotonic()
        with interrupt_after(0.3), pytest.raises(Interrupted):
            c.get_output()
        assert time.monotonic() - started < 30  # nothing else would end it: a hang guard
        # The cancelled call consumed nothing: the next output reaches the next call.
        request = make_request([8], max_tokens=1)
        c.add_request(request)
        outputs = []
        while not outputs:
            outputs = c.get_output(timeout=10).outputs
        assert outputs[0].request_id == request.request_id
        assert outputs[0].new_token_ids == [8]


def test_interrupted_startup_stops_the_engine_and_the_thread(backend: str) -> None:
    """Ctrl-C (here: a signal handler raising) while waiting for slow engines."""
    engines = ReferenceEngines(model="echo", faults=["--startup-delay", "600"])
    children = set(_children(os.getpid()))
    client = SyncClient(engines, backend=backend, ready_timeout=900)
    started = time.monotonic()
    with interrupt_after(1.0), pytest.raises(Interrupted):
        client.__enter__()
    assert time.monotonic() - started < 30  # not the 600 s of the delay: a hang guard
    assert not any(t.name == "trio-vllm-sync" for t in threading.enumerate())
    assert set(_children(os.getpid())) <= children, "the engine process outlived startup"


def test_interrupt_while_a_stream_is_entered_leaves_no_request(backend: str) -> None:
    """Ctrl-C while ``generate`` waits for its stream's entry (after the request went
    out): the entry is cancelled in the loop and the request aborted, at once, not when
    the facade closes. The entry is made slow on purpose (a real one is a send, too
    short to interrupt reliably); the facades' ``generate`` enters this way."""
    engines = ReferenceEngines(model="echo", extra_args=LONG)
    with SyncClient(engines, backend=backend, ready_timeout=READY) as client:
        request = make_request([1, 2, 3], max_tokens=900_000)
        async_client = client.async_client

        @contextlib.asynccontextmanager
        async def slow_entry() -> Any:
            async with async_client.generate(request) as stream:
                await anyio.sleep_forever()  # the request is on the engine by now
                yield stream  # pragma: no cover

        with interrupt_after(1.0), pytest.raises(Interrupted):
            client._loop.open_stream(slow_entry())
        deadline = time.monotonic() + 30  # a hang guard: the abort is immediate
        while client.live_requests and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.live_requests == []
        assert engine_is_idle(client)
