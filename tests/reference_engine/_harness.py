"""Drive a real reference engine process from plain blocking pyzmq (the frontend's side).

:class:`Frontend` binds what vLLM's frontend binds (handshake ROUTER, input ROUTER(s),
output PULL(s), optionally a fake coordinator's XPUB/PULL), spawns
``python -m trio_vllm.reference_engine`` with ``subprocess``, does the handshake and then
sends requests and collects outputs through the protocol layer's ``ClientCodec``.
Every wait has a deadline; ``close()`` kills the process and closes every socket.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import zmq

from trio_vllm.protocol import (
    ClientCodec,
    EngineCoreDead,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreReadyResponse,
    EngineCoreRequest,
    EngineHandshakeMetadata,
    EngineZmqAddresses,
    HandshakeHello,
    HandshakeReady,
    SamplingParams,
    decode_hello,
    decode_ready,
    decode_ready_response,
    encode_handshake_metadata,
    profile_for_version,
)

DEFAULT_TIMEOUT = 15.0
# A hang guard for startup: the tiny model imports torch (1.5-3 s idle), which took more
# than 15 s on a loaded 2-core machine.
STARTUP_TIMEOUT = 60.0
_ids = itertools.count(1)


def ipc_address(tag: str = "") -> str:
    return f"ipc://{tempfile.gettempdir()}/tv-ref-{tag}{uuid.uuid4().hex[:12]}"


def sampling(**kwargs: Any) -> SamplingParams:
    kwargs.setdefault("temperature", 0.0)
    kwargs.setdefault("max_tokens", 8)
    return SamplingParams(**kwargs)


def request(prompt: list[int] | bytes, **kwargs: Any) -> EngineCoreRequest:
    """A generation request with a fresh id; sampling kwargs go to SamplingParams."""
    rid = kwargs.pop("request_id", f"req-{next(_ids)}")
    req_fields = {
        k: kwargs.pop(k)
        for k in list(kwargs)
        if k
        in (
            "client_index",
            "current_wave",
            "lora_request",
            "prompt_embeds",
            "prompt_is_token_ids",
            "pooling_params",
            "trace_headers",
            "cache_salt",
            "abort_immediately",
        )
    }
    tokens = list(prompt) if prompt is not None else None
    sp = sampling(**kwargs) if "pooling_params" not in req_fields else None
    return EngineCoreRequest(rid, prompt_token_ids=tokens, sampling_params=sp, **req_fields)


@dataclass
class Collected:
    tokens: list[int] = field(default_factory=list)
    outputs: list[EngineCoreOutput] = field(default_factory=list)
    finish_reason: int | None = None
    stop_reason: int | str | None = None


class Frontend:
    """One engine process plus the frontend sockets it talks to."""

    def __init__(
        self,
        args: list[str] | None = None,
        *,
        protocol: str = "0.32.0",
        transport: str = "ipc",
        clients: int = 1,
        coordinator: bool = False,
        index: int = 0,
        handshake: bool = True,
        direct: bool = False,
        control: bool = False,
        model: str = "echo",
    ) -> None:
        self.protocol = protocol
        self.codec = ClientCodec(profile_for_version(protocol))
        self.ctx = zmq.Context()
        self._ipc_paths: list[str] = []  # libzmq leaves bound ipc files behind
        self.index = index
        self.identity = index.to_bytes(2, "little")
        self.proc: subprocess.Popen[bytes] | None = None
        self.inputs: list[zmq.Socket[bytes]] = []
        self.outputs: list[zmq.Socket[bytes]] = []
        self.input_addrs: list[str] = []
        self.output_addrs: list[str] = []
        for _ in range(clients):
            self.inputs.append(self._bind(zmq.ROUTER, transport, "in"))
            self.outputs.append(self._bind(zmq.PULL, transport, "out"))
        self.input_addrs = [s.getsockopt_string(zmq.LAST_ENDPOINT) for s in self.inputs]
        self.output_addrs = [s.getsockopt_string(zmq.LAST_ENDPOINT) for s in self.outputs]
        self.coord_pub: zmq.Socket[bytes] | None = None
        self.coord_pull: zmq.Socket[bytes] | None = None
        if coordinator:
            self.coord_pub = self._bind(zmq.XPUB, transport, "cpub")
            self.coord_pub.setsockopt(zmq.XPUB_VERBOSE, 1)
            self.coord_pull = self._bind(zmq.PULL, transport, "cpull")
        self.handshake_sock: zmq.Socket[bytes] | None = None
        self.control_addr = ipc_address("ctl") if control else None
        if self.control_addr:  # the engine binds it; a killed engine cannot remove it
            self._ipc_paths.append(self.control_addr[len("ipc://") :])
        self._control: zmq.Socket[bytes] | None = None
        cmd = [
            sys.executable,
            "-m",
            "trio_vllm.reference_engine",
            "--index",
            str(index),
            "--protocol",
            protocol,
            "--model",
            model,
        ]
        if direct:
            for a in self.input_addrs:
                cmd += ["--input-address", a]
            for a in self.output_addrs:
                cmd += ["--output-address", a]
        else:
            self.handshake_sock = self._bind(zmq.ROUTER, transport, "hs")
            cmd += ["--handshake-address", self.handshake_sock.getsockopt_string(zmq.LAST_ENDPOINT)]
        if self.control_addr:
            cmd += ["--control-address", self.control_addr]
        args = list(args or [])
        if model == "echo" and "--max-model-len" not in args:
            # Long-running requests in tests must not end at the context limit.
            args += ["--max-model-len", "1000000"]
        cmd += args
        self.cmd = cmd
        self.hello: HandshakeHello | None = None
        self.ready: HandshakeReady | None = None
        self.ready_response: EngineCoreReadyResponse | None = None
        self.pending: list[EngineCoreOutputs] = []
        self.replies: dict[int, tuple[str | None, Any]] = {}
        self._call_ids = itertools.count(100)
        self.start_time = 0.0
        self.stderr_path = tempfile.mktemp(prefix="tv-ref-stderr-")
        self._stderr = open(self.stderr_path, "wb")  # noqa: SIM115 - closed in close()
        self._do_handshake = handshake

    def _bind(self, kind: int, transport: str, tag: str) -> zmq.Socket[bytes]:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if transport == "tcp":
            sock.bind("tcp://127.0.0.1:0")
        else:
            address = ipc_address(tag)
            sock.bind(address)
            self._ipc_paths.append(address[len("ipc://") :])
        return sock

    # ---- lifecycle ----

    def start(self) -> Frontend:
        self.start_time = time.monotonic()
        env = dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")
        self.proc = subprocess.Popen(self.cmd, stderr=self._stderr, env=env)
        if self._do_handshake:
            self.do_handshake()
        return self

    def do_handshake(self, timeout: float = STARTUP_TIMEOUT) -> None:
        if self.handshake_sock is not None:
            identity, payload = self._recv(self.handshake_sock, timeout, "HELLO")
            assert identity == self.identity
            self.hello = decode_hello(payload)
            metadata = EngineHandshakeMetadata(
                addresses=EngineZmqAddresses(
                    inputs=self.input_addrs,
                    outputs=self.output_addrs,
                    coordinator_input=(
                        self.coord_pub.getsockopt_string(zmq.LAST_ENDPOINT)
                        if self.coord_pub
                        else None
                    ),
                    coordinator_output=(
                        self.coord_pull.getsockopt_string(zmq.LAST_ENDPOINT)
                        if self.coord_pull
                        else None
                    ),
                ),
                parallel_config={},
            )
            self.handshake_sock.send_multipart([identity, encode_handshake_metadata(metadata)])
            if self.coord_pub is not None:
                sub = self._recv(self.coord_pub, timeout, "coordinator subscription")
                assert sub == [b"\x01"], sub
                self.coord_pub.send(b"READY")
            identity, payload = self._recv(self.handshake_sock, timeout, "READY")
            self.ready = decode_ready(payload)
        for sock in self.inputs:
            identity, payload = self._recv(sock, timeout, "ready response")
            assert identity == self.identity
            self.ready_response = decode_ready_response(payload)
            self.ready_response_raw = payload

    def _recv(self, sock: zmq.Socket[bytes], timeout: float, what: str) -> Any:
        if not sock.poll(timeout * 1000):
            raise TimeoutError(f"no {what} within {timeout} s; stderr: {self.stderr()}")
        return sock.recv_multipart()

    def stderr(self) -> str:
        self._stderr.flush()
        with open(self.stderr_path, "rb") as f:
            return f.read().decode(errors="replace")[-3000:]

    def wait_exit(self, timeout: float = DEFAULT_TIMEOUT) -> int:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            stack = ""
            with contextlib.suppress(OSError), open(f"/proc/{self.proc.pid}/stat") as f:
                stack = f.read()
            raise AssertionError(
                f"engine did not exit within {timeout} s; /proc stat: {stack!r}; "
                f"stderr: {self.stderr()}"
            ) from None

    def signal(self, signum: int = signal.SIGTERM) -> None:
        assert self.proc is not None
        self.proc.send_signal(signum)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        for sock in [
            *self.inputs,
            *self.outputs,
            self.handshake_sock,
            self.coord_pub,
            self.coord_pull,
            self._control,
        ]:
            if sock is not None:
                sock.close(linger=0)
        self.ctx.term()
        for path in self._ipc_paths:
            with contextlib.suppress(OSError):
                os.unlink(path)
        self._stderr.close()
        with contextlib.suppress(OSError):
            os.unlink(self.stderr_path)

    def __enter__(self) -> Frontend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- traffic ----

    def send_raw(self, frames: list[Any], client: int = 0) -> None:
        self.inputs[client].send_multipart([self.identity, *frames])

    def add(self, req: EngineCoreRequest, client: int = 0, validate: bool = True) -> str:
        self.send_raw(self.codec.encode_add(req, validate=validate), client)
        return req.request_id

    def abort(self, ids: list[str], client: int = 0) -> None:
        self.send_raw(self.codec.encode_abort(ids), client)

    def start_wave(self, wave: int, exclude: int | None = None) -> None:
        self.send_raw(self.codec.encode_start_dp_wave(wave, exclude))

    def recv(
        self, timeout: float = DEFAULT_TIMEOUT, client: int = 0
    ) -> EngineCoreOutputs | EngineCoreDead:
        """The next output message (``TimeoutError`` after ``timeout`` seconds)."""
        sock = self.outputs[client]
        if not sock.poll(timeout * 1000):
            raise TimeoutError(f"no output within {timeout} s; stderr: {self.stderr()}")
        return self.codec.decode_outputs(sock.recv_multipart(copy=False))

    def recv_raw(self, timeout: float = DEFAULT_TIMEOUT, client: int = 0) -> list[bytes]:
        sock = self.outputs[client]
        if not sock.poll(timeout * 1000):
            raise TimeoutError(f"no output within {timeout} s; stderr: {self.stderr()}")
        return sock.recv_multipart()

    def no_output(self, seconds: float, client: int = 0) -> bool:
        return not self.outputs[client].poll(seconds * 1000)

    def call(
        self, method: str, *args: Any, client: int = 0, timeout: float = DEFAULT_TIMEOUT
    ) -> tuple[str | None, Any]:
        """Call a utility; returns ``(failure_message, value)``; other outputs are kept."""
        call_id = next(self._call_ids)
        self.send_raw(self.codec.encode_utility(client, call_id, method, list(args)), client)
        return self.wait_reply(call_id, client=client, timeout=timeout)

    def send_call(self, method: str, *args: Any, client: int = 0) -> int:
        call_id = next(self._call_ids)
        self.send_raw(self.codec.encode_utility(client, call_id, method, list(args)), client)
        return call_id

    def wait_reply(
        self, call_id: int, *, client: int = 0, timeout: float = DEFAULT_TIMEOUT
    ) -> tuple[str | None, Any]:
        deadline = time.monotonic() + timeout
        while call_id not in self.replies:
            out = self.recv(max(0.0, deadline - time.monotonic()), client)
            assert isinstance(out, EngineCoreOutputs), out
            if not self._take_reply(out):
                self.pending.append(out)
        return self.replies.pop(call_id)

    def _take_reply(self, out: EngineCoreOutputs) -> bool:
        u = out.utility_output
        if u is None:
            return False
        self.replies[u.call_id] = (
            u.failure_message,
            u.result.result if u.result is not None else None,
        )
        return True

    def collect(
        self, ids: list[str], timeout: float = DEFAULT_TIMEOUT, client: int = 0
    ) -> dict[str, Collected]:
        """Receive until every id finished; returns tokens, outputs and finish reasons."""
        results = {rid: Collected() for rid in ids}
        open_ids = set(ids)
        deadline = time.monotonic() + timeout
        while open_ids:
            if self.pending:
                out: Any = self.pending.pop(0)
            else:
                out = self.recv(max(0.0, deadline - time.monotonic()), client)
            assert isinstance(out, EngineCoreOutputs), out
            self._take_reply(out)
            for o in out.outputs:
                if o.request_id not in results:
                    continue
                c = results[o.request_id]
                c.tokens.extend(o.new_token_ids)
                c.outputs.append(o)
                if o.finish_reason is not None:
                    c.finish_reason = int(o.finish_reason)
                    c.stop_reason = o.stop_reason
                    open_ids.discard(o.request_id)
        return results

    def generate(self, req: EngineCoreRequest, timeout: float = DEFAULT_TIMEOUT) -> Collected:
        rid = self.add(req)
        return self.collect([rid], timeout)[rid]

    # ---- control socket ----

    def control(self, cmd: str, **kwargs: Any) -> dict[str, Any]:
        assert self.control_addr is not None
        if self._control is None:
            self._control = self.ctx.socket(zmq.REQ)
            self._control.setsockopt(zmq.LINGER, 0)
            self._control.connect(self.control_addr)
        self._control.send(json.dumps({"cmd": cmd, **kwargs}).encode())
        if not self._control.poll(DEFAULT_TIMEOUT * 1000):
            raise TimeoutError(f"no control reply to {cmd}")
        return json.loads(self._control.recv())  # type: ignore[no-any-return]
