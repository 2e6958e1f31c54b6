"""The processes that run on the hosts: a store (Redis or PostgreSQL) and ``chatlane serve``.

Each runs inside its host's namespace with its output in a file of its own
(no pipe can fill and stall it) and is stopped by its pid: SIGTERM, then
SIGKILL if it has not exited in time. Readiness is awaited by polling a
condition (a port that answers, a line in the output), bounded in time.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tests.multihost.agent import LOG_VARIABLE
from tests.multihost.network import Host

ROOT = Path(__file__).resolve().parents[2]
SERVE_PORT = 8080
READY_TIMEOUT = 60.0


@dataclass
class Server:
    """One process on one host, its output going to ``output``."""

    name: str
    process: subprocess.Popen[bytes]
    output: Path

    def tail(self, lines: int = 30) -> str:
        text = self.output.read_text(errors="replace") if self.output.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM, then SIGKILL after ``timeout`` seconds; the exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait(timeout=timeout)


def launch(
    name: str, command: list[str], output: Path, env: dict[str, str] | None = None
) -> Server:
    """Start ``command`` in ``output``'s directory, its output going to ``output``."""
    with output.open("wb") as sink:
        process = subprocess.Popen(
            command,
            cwd=output.parent,
            stdin=subprocess.DEVNULL,
            stdout=sink,
            stderr=subprocess.STDOUT,
            env=env,
        )
    return Server(name, process, output)


def wait_until(server: Server, ready: Callable[[], bool], what: str) -> None:
    """Return once ``ready()``; fail with the server's output if it exits or takes too long."""
    deadline = time.monotonic() + READY_TIMEOUT
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise AssertionError(f"{server.name} exited before {what}:\n{server.tail()}")
        if ready():
            return
        time.sleep(0.1)
    raise AssertionError(f"{server.name}: no {what} in {READY_TIMEOUT} s:\n{server.tail()}")


def answers_tcp(address: str, port: int) -> bool:
    try:
        with socket.create_connection((address, port), timeout=0.5):
            return True
    except OSError:
        return False


def start_redis(host: Host, binary: str, directory: Path) -> tuple[Server, str]:
    """``redis-server`` on ``host``'s address, nothing on disk; it and its URL."""
    command = host.command(
        binary, "--bind", host.address, "--port", "6379", "--save", "", "--appendonly", "no",
        "--protected-mode", "no", "--dir", str(directory),
    )  # fmt: skip
    server = launch("redis", command, directory / "redis.out")
    wait_until(server, lambda: answers_tcp(host.address, 6379), "Redis listening")
    return server, f"redis://{host.address}:6379/0"


def postgres_binaries() -> Path | None:
    """The newest ``/usr/lib/postgresql/<version>/bin`` holding initdb and postgres."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=lambda p: p.parent.name)
    usable = [b for b in found if (b / "initdb").exists() and (b / "postgres").exists()]
    return usable[-1] if usable else None


def as_postgres(*args: str) -> list[str]:
    """``args`` run as the ``postgres`` user (initdb and postgres refuse to run as root)."""
    return ["setpriv", "--reuid=postgres", "--regid=postgres", "--init-groups", *args]


def start_postgres(host: Host, binaries: Path) -> tuple[Server, str, Path]:
    """A fresh cluster listening on ``host``'s address only; it, its URL and its data directory."""
    data = Path(tempfile.mkdtemp(prefix="chatlane-mh-pg-"))
    shutil.chown(data, "postgres", "postgres")
    pgdata = data / "pgdata"
    subprocess.run(
        as_postgres(str(binaries / "initdb"), "-D", str(pgdata), "-A", "trust", "-U", "postgres"),
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    with (pgdata / "pg_hba.conf").open("a") as hba:
        hba.write(f"host all all {host.address.rsplit('.', 1)[0]}.0/24 trust\n")
    command = host.command(*as_postgres(
        str(binaries / "postgres"), "-D", str(pgdata), "-k", str(data),
        "-c", f"listen_addresses={host.address}", "-c", "port=5432", "-c", "fsync=off",
        "-c", "synchronous_commit=off", "-c", "max_connections=300",
    ))  # fmt: skip
    server = launch("postgres", command, data / "postgres.out")
    wait_until(server, lambda: "ready to accept" in server.tail(200), "PostgreSQL ready")
    return server, f"postgresql://postgres@{host.address}:5432/postgres", data


def start_serve(host: Host, store_url: str, token: str, directory: Path, log: Path) -> Server:
    """``chatlane serve`` on ``host``'s address with the logging agent, ready for requests."""
    directory.mkdir(parents=True, exist_ok=True)
    python_path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": python_path, "CHATLANE_TOKEN": token, LOG_VARIABLE: str(log)}
    command = host.command(
        sys.executable, "-m", "chatlane.cli", "serve", "--host", host.address,
        "--port", str(SERVE_PORT), "--store", store_url, "--busy", "queue",
        "--agent", "python:tests.multihost.agent:answer",
    )  # fmt: skip
    server = launch(f"serve {host.name}", command, directory / "serve.out", env)
    wait_until(server, lambda: "store:" in server.tail(200), "ready banner")
    return server
