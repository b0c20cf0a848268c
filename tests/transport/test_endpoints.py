"""Endpoint helpers: port 0, IPv6 brackets, private ipc directories."""

from __future__ import annotations

import os
import socket
import stat
from typing import Any

import anyio
import pytest
import zmq

from trio_vllm.transport import (
    AsyncSocket,
    PrivateIpcDir,
    is_ipv6_endpoint,
    normalize_endpoint,
    tcp_endpoint,
)


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


def _exists(path: str) -> bool:
    return os.path.exists(path)


def test_tcp_endpoint_brackets_ipv6() -> None:
    assert tcp_endpoint("127.0.0.1", 5555) == "tcp://127.0.0.1:5555"
    assert tcp_endpoint("::1", 5555) == "tcp://[::1]:5555"
    assert tcp_endpoint("[::1]", 0) == "tcp://[::1]:0"
    assert tcp_endpoint("localhost") == "tcp://localhost:*"


def test_normalize_and_detect() -> None:
    assert normalize_endpoint("tcp://127.0.0.1:0", bind=True) == "tcp://127.0.0.1:*"
    assert normalize_endpoint("tcp://127.0.0.1:0", bind=False) == "tcp://127.0.0.1:0"
    assert normalize_endpoint("tcp://::1:0", bind=True) == "tcp://[::1]:*"
    assert normalize_endpoint("tcp://fe80::1:7", bind=False) == "tcp://[fe80::1]:7"
    assert normalize_endpoint("ipc:///tmp/x", bind=True) == "ipc:///tmp/x"
    assert is_ipv6_endpoint("tcp://[::1]:5")
    assert is_ipv6_endpoint("tcp://::1:5")
    assert not is_ipv6_endpoint("tcp://127.0.0.1:5")
    assert not is_ipv6_endpoint("ipc:///tmp/x")


def test_private_ipc_dir_is_private_and_removed() -> None:
    ipc = PrivateIpcDir()
    assert ipc.path is None
    endpoint = ipc.endpoint("engine")
    assert ipc.path is not None
    assert endpoint == f"ipc://{ipc.path}/engine"
    assert stat.S_IMODE(os.stat(ipc.path).st_mode) == 0o700
    path = ipc.path
    ipc.cleanup()
    ipc.cleanup()
    assert not os.path.exists(path)
    with pytest.raises(ValueError, match="too long"):
        PrivateIpcDir().endpoint("x" * 200)


@pytest.mark.anyio
async def test_bind_port_zero_returns_real_endpoint(ctx: zmq.Context[Any]) -> None:
    with AsyncSocket.create(ctx, zmq.PULL) as pull, AsyncSocket.create(ctx, zmq.PUSH) as push:
        endpoint = pull.bind("tcp://127.0.0.1:0")
        host, _, port = endpoint.rpartition(":")
        assert host == "tcp://127.0.0.1"
        assert int(port) > 0
        push.connect(endpoint)
        with anyio.fail_after(30):
            await push.send([b"over tcp"])
            assert await pull.receive() == [b"over tcp"]


@pytest.mark.anyio
@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback on this machine")
async def test_ipv6_bind_and_connect(ctx: zmq.Context[Any]) -> None:
    with AsyncSocket.create(ctx, zmq.PULL) as pull, AsyncSocket.create(ctx, zmq.PUSH) as push:
        endpoint = pull.bind("tcp://::1:0")
        assert endpoint.startswith("tcp://[::1]:")
        assert pull.get_option(zmq.IPV6) == 1
        port = int(endpoint.rpartition(":")[2])
        assert push.connect(tcp_endpoint("::1", port)) == endpoint
        assert push.get_option(zmq.IPV6) == 1
        with anyio.fail_after(30):
            await push.send([b"over ipv6"])
            assert await pull.receive() == [b"over ipv6"]


@pytest.mark.anyio
async def test_bind_ipc_directory_removed_on_close(ctx: zmq.Context[Any]) -> None:
    pull = AsyncSocket.create(ctx, zmq.PULL)
    endpoint = pull.bind_ipc()
    second = pull.bind_ipc("named")
    path = endpoint[len("ipc://") :]
    assert _exists(path)
    assert os.path.dirname(path) == os.path.dirname(second[len("ipc://") :])
    with AsyncSocket.create(ctx, zmq.PUSH) as push:
        push.connect(second)
        with anyio.fail_after(30):
            await push.send([b"over ipc"])
            assert await pull.receive() == [b"over ipc"]
    pull.close()
    assert not _exists(os.path.dirname(path))
