"""Ctrl-C or SIGTERM before ``chatlane serve`` is ready: one line, one exit status (130 or
143), never a traceback, and what the start opened closed.

Each test holds the start at one point — an import, the store's connect, Telegram's
``getMe`` — waits until the process says it got there, and only then sends the signal.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from chatlane.console import INTERRUPTED, STOPPED_EARLY
from tests.ports import free_port
from tests.serving import reaped

HOLD = """\
import os, signal, sys


class Hold:
    '''Holds the import of $CHATLANE_TEST_HOLD, saying so, until a signal comes. Whichever
    thread the signal reaches writes to the wake-up pipe; the process's own handler takes
    it in the main thread, at the held import.'''

    def find_spec(self, name, path=None, target=None):
        if name == os.environ["CHATLANE_TEST_HOLD"]:
            sys.meta_path.remove(self)
            woken, wake = os.pipe()
            os.set_blocking(wake, False)
            before = signal.set_wakeup_fd(wake)
            try:
                print("holding", name, flush=True)
                os.read(woken, 1)
            finally:
                signal.set_wakeup_fd(before)
        return None


sys.meta_path.insert(0, Hold())
"""
"""A ``sitecustomize`` that holds one import of the process it is loaded into."""

SCRIPT = """\
import re
import sys
from chatlane.console import main
if __name__ == "__main__":
    sys.argv[0] = re.sub(r"(-script\\.pyw|\\.exe)?$", "", sys.argv[0])
    sys.exit(main())
"""
"""What pip writes for the ``chatlane`` script of ``[project.scripts]``."""


SIGNALS = pytest.mark.parametrize(
    ("sent", "status"),
    [(signal.SIGINT, 128 + signal.SIGINT), (signal.SIGTERM, 128 + signal.SIGTERM)],
    ids=["ctrl-c", "sigterm"],
)
"""Each test for Ctrl-C and for SIGTERM, with the exit status each ends with (128 + the
signal's number, as a shell reports a command the signal ended)."""


def interrupted(
    tmp_path: Path,
    command: list[str],
    ready: str,
    env: dict[str, str] | None = None,
    sent: signal.Signals = signal.SIGINT,
) -> tuple[int, str]:
    """Run ``command`` (after the Python executable), send ``sent`` once it prints a line
    starting with ``ready``, and return its exit status and what it printed after that."""
    process = subprocess.Popen(
        [sys.executable, *command],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **(env or {})},
    )
    assert process.stdout is not None
    with reaped(process):
        seen = process.stdout.readline()
        assert seen.startswith(ready), seen + process.stdout.read()
        process.send_signal(sent)
        output, _ = process.communicate(timeout=30)
    return process.returncode, output


def holding(tmp_path: Path, module: str) -> dict[str, str]:
    """The environment of a process whose import of ``module`` is held."""
    hold = tmp_path / "hold"
    hold.mkdir()
    (hold / "sitecustomize.py").write_text(HOLD)
    path = os.pathsep.join(filter(None, [str(hold), os.environ.get("PYTHONPATH")]))
    return {"PYTHONPATH": path, "CHATLANE_TEST_HOLD": module}


def ends_early(code: int, output: str, status: int = INTERRUPTED) -> None:
    assert "Traceback" not in output, output
    assert output.splitlines() == [STOPPED_EARLY], output
    assert code == status


@SIGNALS
@pytest.mark.parametrize(
    ("entry", "module"),
    [
        ("python -m chatlane", "chatlane.errors"),  # Python imports the command line
        ("the chatlane script", "chatlane.errors"),
        ("python -m chatlane", "chatlane.serve"),  # serve imports what it runs with
    ],  # the store open, the app not started: test_a_signal_once_the_store_is_open_closes_it
)
def test_a_signal_during_an_import_stops_the_start_in_one_line(
    tmp_path: Path, entry: str, module: str, sent: signal.Signals, status: int
) -> None:
    if entry == "the chatlane script":
        (tmp_path / "chatlane").write_text(SCRIPT)
        command = ["chatlane"]
    else:
        command = ["-m", "chatlane"]
    serve = ["serve", "--port", str(free_port()), "--store", "sqlite:///chatlane.db"]
    code, output = interrupted(
        tmp_path, [*command, *serve], f"holding {module}", holding(tmp_path, module), sent
    )
    ends_early(code, output, status)


@SIGNALS
def test_a_signal_once_the_store_is_open_closes_it(
    tmp_path: Path, sent: signal.Signals, status: int
) -> None:
    """The start is held after the SQLite store opened, before the app starts: the store is
    closed as the start is called off (SQLite removes the WAL once its last connection
    closes), and what it holds is whole."""
    module = "chatlane.adapters.web"
    serve = ["-m", "chatlane", "serve", "--port", str(free_port()), "--store", "sqlite:///db"]
    held = holding(tmp_path, module)
    code, output = interrupted(tmp_path, serve, f"holding {module}", held, sent)
    ends_early(code, output, status)
    assert not (tmp_path / "db-wal").exists()
    assert not (tmp_path / "db-shm").exists()
    with contextlib.closing(sqlite3.connect(tmp_path / "db")) as store:
        assert store.execute("PRAGMA integrity_check").fetchall() == [("ok",)]


@pytest.fixture
def silent_server() -> Iterator[tuple[int, threading.Event]]:
    """A TCP server that takes connections and never answers: its port, and an event set
    once a connection came."""
    connected = threading.Event()
    with socket.create_server(("127.0.0.1", 0)) as listening:
        accepted: list[socket.socket] = []

        def accept() -> None:
            connection, _ = listening.accept()
            accepted.append(connection)
            connected.set()

        thread = threading.Thread(target=accept, daemon=True)
        thread.start()
        yield listening.getsockname()[1], connected
        for connection in accepted:
            connection.close()


@SIGNALS
def test_a_signal_while_the_store_connects_stops_the_start_in_one_line(
    tmp_path: Path, silent_server: tuple[int, threading.Event], sent: signal.Signals, status: int
) -> None:
    port, connected = silent_server
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "chatlane",
            "serve",
            "--port",
            str(free_port()),
            "--store",
            f"redis://127.0.0.1:{port}/0",
        ],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    with reaped(process):
        assert connected.wait(timeout=30), "chatlane serve never connected to the store"
        process.send_signal(sent)
        output, _ = process.communicate(timeout=30)
    ends_early(process.returncode, output, status)


class HeldBotApi(BaseHTTPRequestHandler):
    """A Bot API that takes ``getMe`` and answers only once the test lets it go."""

    asked: threading.Event
    released: threading.Event

    def do_POST(self) -> None:
        self.asked.set()
        self.released.wait(timeout=30)
        self.send_error(502)

    def log_message(self, format: str, *args: object) -> None:
        pass


@SIGNALS
def test_a_signal_while_telegram_starts_stops_the_start_in_one_line(
    tmp_path: Path, sent: signal.Signals, status: int
) -> None:
    """The signal comes once uvicorn handles it, while the adapters start: the start
    is called off at once, without waiting for Telegram's answer."""
    asked, released = threading.Event(), threading.Event()
    handler = type("Held", (HeldBotApi,), {"asked": asked, "released": released})
    with ThreadingHTTPServer(("127.0.0.1", 0), handler) as api:
        threading.Thread(target=api.serve_forever, daemon=True).start()
        env = {
            "CHATLANE_TELEGRAM__ENABLED": "true",
            "CHATLANE_TELEGRAM__API_URL": f"http://127.0.0.1:{api.server_address[1]}",
            "TELEGRAM_BOT_TOKEN": "1:x",
        }
        process = subprocess.Popen(
            [sys.executable, "-m", "chatlane", "serve", "--port", str(free_port())],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, **env},
        )
        try:
            assert asked.wait(timeout=30), "chatlane serve never asked Telegram's getMe"
            process.send_signal(sent)
            output, _ = process.communicate(timeout=30)
        finally:
            released.set()
            if process.poll() is None:
                process.kill()
                process.communicate()
            api.shutdown()
    ends_early(process.returncode, output, status)
