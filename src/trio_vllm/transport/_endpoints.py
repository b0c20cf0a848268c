"""ZeroMQ endpoint strings: port-0 binds, IPv6 brackets, private ipc directories.

Pure helpers with no event-loop code; `AsyncSocket` uses
them in ``bind``/``connect``/``bind_ipc``.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import tempfile
import weakref

__all__ = [
    "PrivateIpcDir",
    "is_ipv6_endpoint",
    "normalize_endpoint",
    "tcp_endpoint",
]

# sockaddr_un.sun_path is 108 bytes on Linux, including the terminating NUL.
_MAX_IPC_PATH = 107


def _is_ipv6_literal(host: str) -> bool:
    try:
        return isinstance(ipaddress.ip_address(host), ipaddress.IPv6Address)
    except ValueError:
        return False


def tcp_endpoint(host: str, port: int | str = "*") -> str:
    """Return ``tcp://host:port``, bracketing an IPv6 literal (``tcp://[::1]:5555``).

    ``port`` may be an int, ``"*"`` or ``0`` (both mean "any free port" on a bind).
    A host that is already bracketed is kept as it is.
    """
    if host.startswith("[") and host.endswith("]"):
        bracketed = host
    elif _is_ipv6_literal(host):
        bracketed = f"[{host}]"
    else:
        bracketed = host
    return f"tcp://{bracketed}:{port}"


def is_ipv6_endpoint(endpoint: str) -> bool:
    """True for a ``tcp://`` endpoint whose host is an IPv6 literal (bracketed or not).

    ZeroMQ needs ``IPV6=1`` on the socket before it binds or connects to one.
    """
    if not endpoint.startswith("tcp://"):
        return False
    rest = endpoint[len("tcp://") :]
    # "source;destination" syntax: the destination decides.
    rest = rest.rsplit(";", 1)[-1]
    if rest.startswith("["):
        return True
    host, _, _port = rest.rpartition(":")
    return _is_ipv6_literal(host)


def normalize_endpoint(endpoint: str, *, bind: bool) -> str:
    """Bracket a bare IPv6 host and, for binds, turn port ``0`` into ZeroMQ's ``*``.

    ``tcp://::1:0`` becomes ``tcp://[::1]:*`` for a bind. Anything that is not
    ``tcp://`` is returned unchanged.
    """
    if not endpoint.startswith("tcp://"):
        return endpoint
    rest = endpoint[len("tcp://") :]
    if ";" in rest:
        # "source;destination": leave the source part alone.
        return endpoint
    host, sep, port = rest.rpartition(":")
    if not sep:
        return endpoint
    if bind and port == "0":
        port = "*"
    if not host.startswith("[") and _is_ipv6_literal(host):
        host = f"[{host}]"
    return f"tcp://{host}:{port}"


class PrivateIpcDir:
    """A private (mode 0700) temporary directory holding ipc socket files.

    Created on first use of `endpoint`; `cleanup` removes it with
    everything in it. A finalizer removes it too if the owner is garbage-collected
    or the interpreter exits without calling `cleanup`.
    """

    def __init__(self, prefix: str = "trio-vllm-") -> None:
        self._prefix = prefix
        self._path: str | None = None
        self._finalizer: weakref.finalize[..., PrivateIpcDir] | None = None
        self._counter = 0

    @property
    def path(self) -> str | None:
        """The directory, or None before the first `endpoint` call."""
        return self._path

    def endpoint(self, name: str | None = None) -> str:
        """Return a fresh ``ipc://`` endpoint inside the directory.

        Raises:
            ValueError: the resulting path is too long for a unix socket address.
        """
        if self._path is None:
            # mkdtemp creates the directory with mode 0700.
            self._path = tempfile.mkdtemp(prefix=self._prefix)
            self._finalizer = weakref.finalize(self, shutil.rmtree, self._path, True)
        if name is None:
            self._counter += 1
            name = f"s{self._counter}"
        full = os.path.join(self._path, name)
        if len(full.encode()) > _MAX_IPC_PATH:
            raise ValueError(f"ipc path too long for a unix socket ({len(full)} bytes): {full}")
        return f"ipc://{full}"

    def cleanup(self) -> None:
        """Remove the directory and its contents; idempotent, never raises."""
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None
