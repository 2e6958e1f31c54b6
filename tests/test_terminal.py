"""``chatlane chat``: a real terminal (a pseudo-terminal), a real gateway, real HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import pty
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import uvicorn
from click.testing import CliRunner

from chatlane.adapters.api import ApiAdapter
from chatlane.agents.demo import DemoAgent
from chatlane.cli import main
from chatlane.config import Config
from chatlane.hub import Hub, build_app
from chatlane.runtime.busy import BusyPolicy, BusySettings
from chatlane.runtime.settings import RuntimeSettings
from chatlane.runtime.turn import Turn
from chatlane.secrets import resolve_secrets
from chatlane.stores import open_store
from chatlane.terminal import (
    RemoteGateway,
    TokenRefused,
    check_session,
    converse,
    default_session,
    parse_event,
)
from chatlane.types import Agent

TOKEN = "terminal-t\u00f8ken"
"""Not ASCII: the client sends it as UTF-8, as the API compares it."""
LAUNCH = (
    "import fcntl, os, sys, termios; fcntl.ioctl(0, termios.TIOCSCTTY, 0); "
    "os.execv(sys.executable, [sys.executable, '-m', 'chatlane.cli', *sys.argv[1:]])"
)
"""Makes the pseudo-terminal the controlling terminal, so a typed Ctrl-C sends SIGINT."""


def clean_env() -> dict[str, str]:
    """The environment without ``CHATLANE_…`` settings that would change the gateway."""
    return {k: v for k, v in os.environ.items() if not k.startswith("CHATLANE_")}


class Terminal:
    """``chatlane chat …`` running under a pseudo-terminal, typed into like a person would."""

    def __init__(self, *args: str, cwd: Path) -> None:
        master, slave = pty.openpty()
        self.master = master
        self.process = subprocess.Popen(
            [sys.executable, "-c", LAUNCH, "chat", *args],
            stdin=slave,
            stdout=slave,
            stderr=slave,
            start_new_session=True,
            cwd=cwd,
            env=clean_env(),
        )
        os.close(slave)
        self.output = b""
        self.seen = 0

    def type(self, keys: str) -> None:
        os.write(self.master, keys.encode())

    def expect(self, text: str, timeout: float = 30) -> str:
        """Wait for ``text`` after what was already matched; the output up to its end."""
        deadline = time.monotonic() + timeout
        while (found := self.output.find(text.encode(), self.seen)) < 0:
            left = deadline - time.monotonic()
            if left <= 0 or not self._read(left):
                raise AssertionError(f"no {text!r} in {self.output[self.seen :].decode()!r}")
        end = found + len(text.encode())
        before, self.seen = self.output[self.seen : end], end
        return before.decode(errors="replace")

    def _read(self, timeout: float) -> bool:
        ready, _, _ = select.select([self.master], [], [], min(timeout, 0.5))
        if not ready:
            return True
        try:
            data = os.read(self.master, 65536)
        except OSError:  # EIO: the program closed the terminal
            return False
        self.output += data
        return bool(data)

    def wait(self, timeout: float = 30) -> int:
        return self.process.wait(timeout)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(10)
        os.close(self.master)


@contextlib.contextmanager
def running_terminal(*args: str, cwd: Path) -> Iterator[Terminal]:
    term = Terminal(*args, cwd=cwd)
    try:
        yield term
    finally:
        term.close()


# -- a real gateway in this process -------------------------------------------------------


@contextlib.asynccontextmanager
async def serving(
    agent: Agent | None = None, config: Config | None = None, token: str = ""
) -> AsyncIterator[str]:
    """A gateway with the API adapter on a free loopback port; yields its URL."""
    config = config or Config()
    hub = Hub(config, await open_store("memory://"), agent or DemoAgent())
    hub.add(ApiAdapter(config, secrets=resolve_secrets(config, {"CHATLANE_TOKEN": token})))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        app = build_app(hub)
        server = uvicorn.Server(uvicorn.Config(app, lifespan="on", log_level="warning"))
        task = asyncio.create_task(server.serve(sockets=[sock]))
        try:
            async with asyncio.timeout(20):
                while not server.started:
                    if task.done():
                        raise AssertionError("the gateway did not start")
                    await asyncio.sleep(0.02)
            yield f"http://127.0.0.1:{sock.getsockname()[1]}"
        finally:
            server.should_exit = True
            await task


async def chat_command(*args: str, stdin: bytes) -> tuple[int, str, str]:
    """``chatlane chat ARGS`` with ``stdin`` piped in; exit status, stdout, stderr."""
    process = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "chatlane.cli", "chat", *args),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=clean_env(),
    )
    out, err = await asyncio.wait_for(process.communicate(stdin), 40)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def converse_with(
    url: str, lines: str | bytes, tmp_path: Path, session: str = "t", token: str = ""
) -> tuple[int, str, str]:
    """:func:`converse` in this process, reading ``lines`` from a file; status, out, err."""
    path = tmp_path / "stdin.txt"
    path.write_bytes(lines.encode() if isinstance(lines, str) else lines)
    out, err = io.StringIO(), io.StringIO()
    fd = os.open(path, os.O_RDONLY)
    try:
        code = await converse(RemoteGateway(url, session, token), fd, out, err)
    finally:
        os.close(fd)
    return code, out.getvalue(), err.getvalue()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


# -- in a pseudo-terminal -------------------------------------------------------------------


def test_a_conversation_in_a_terminal(tmp_path: Path) -> None:
    with running_terminal("--local", cwd=tmp_path) as term:
        term.expect("> ")
        term.type("hello\n")
        assert "echo: hello" in term.expect("> ")
        term.type("whoami\n")
        assert "platform=api chat=terminal-" in term.expect("> ")
        term.type("/status\n")
        assert "Status: idle" in term.expect("> ")
        term.type("\x04")  # Ctrl-D
        assert term.wait() == 0
    assert not list(tmp_path.iterdir()), "--local keeps its store in memory"


def test_ctrl_c_cancels_a_streaming_reply_then_leaves_from_the_prompt(tmp_path: Path) -> None:
    with running_terminal("--local", "--session", "ctrl-c", cwd=tmp_path) as term:
        term.expect("> ")
        term.type("approve ls -l\n")
        term.expect("Approval needed")
        term.type("/approve\n")  # sent while the first reply is still open
        assert "approved: ls -l" in term.expect("> ")
        term.type("sleep 30\nhello again\n")
        term.expect("Queued")
        term.type("\x03")  # Ctrl-C while both replies are open
        term.expect("cancelled")
        term.expect("> ")
        term.type("/stop\n")
        term.expect("Stopped the running turn")
        term.expect("> ")
        term.type("hello\n")
        assert "echo: hello" in term.expect("> ")
        term.type("\x03")  # Ctrl-C at the prompt
        assert term.wait() == 128 + signal.SIGINT
        assert b"Traceback" not in term.output


def test_quit_leaves_with_status_0(tmp_path: Path) -> None:
    with running_terminal("--local", "--store", f"sqlite:///{tmp_path}/c.db", cwd=tmp_path) as term:
        term.expect("> ")
        term.type("/quit\n")
        assert term.wait() == 0


# -- against a gateway running in the test ---------------------------------------------------


async def test_the_reply_streams_in_pieces(tmp_path: Path) -> None:
    printed = asyncio.Event()

    class Screen(io.StringIO):
        def write(self, text: str) -> int:
            if "first piece" in text:
                printed.set()
            return super().write(text)

    async def two_pieces(turn: Turn) -> AsyncIterator[str]:
        yield "first piece, "
        await asyncio.wait_for(printed.wait(), 20)  # only once the terminal showed it
        yield "second piece"

    path = tmp_path / "stdin.txt"
    path.write_text("go\n")
    screen, err = Screen(), io.StringIO()
    fd = os.open(path, os.O_RDONLY)
    try:
        async with serving(two_pieces) as url:
            assert await converse(RemoteGateway(url, "pieces"), fd, screen, err) == 0
    finally:
        os.close(fd)
    assert screen.getvalue() == "first piece, second piece\n"
    assert err.getvalue() == ""


class Gate:
    """An agent whose ``hold`` turn runs until released."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.release = asyncio.Event()

    async def __call__(self, turn: Turn) -> str:
        if turn.text == "hold":
            self.entered.set()
            await self.release.wait()
            return "released"
        return f"echo: {turn.text}"


async def test_a_busy_rejection_prints_the_gateway_message(tmp_path: Path) -> None:
    gate = Gate()
    config = Config(runtime=RuntimeSettings(busy=BusySettings(BusyPolicy.REJECT)))
    async with serving(gate, config) as url:
        holding = asyncio.create_task(
            chat_command("--url", url, "--session", "busy", stdin=b"hold\n")
        )
        await asyncio.wait_for(gate.entered.wait(), 30)
        code, out, err = await converse_with(url, "hello\n", tmp_path, session="busy")
        gate.release.set()
        assert (await holding)[:2] == (0, "released\n")
    assert code == 0
    assert out == ""
    assert "session 'busy' is busy and its busy policy is reject" in err
    assert "(HTTP 409)" in err


async def test_piped_stdin_gets_every_reply_in_order() -> None:
    async with serving() as url:
        code, out, err = await chat_command(
            "--url", url, "--session", "pipe", stdin=b"hello\nwhoami\n\n/status\nlast"
        )
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == "echo: hello"
    assert lines[1].startswith("platform=api chat=pipe ")
    assert lines[2] == "Status: idle"
    assert lines[-1] == "echo: last"
    assert "> " not in out, "no prompt without a terminal"


async def test_an_unreachable_gateway_is_a_clear_error() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    code, _, err = await chat_command("--url", url, stdin=b"hello\n")
    assert code == 1
    assert f"Error: cannot reach the gateway at {url}: " in err
    assert "Traceback" not in err


@pytest.mark.parametrize("url", ["http://127.0.0.1:99999", "http://[::1"])
async def test_a_malformed_url_is_a_clear_error(url: str) -> None:
    code, _, err = await chat_command("--url", url, stdin=b"hello\n")
    assert code == 1
    assert f"Error: cannot reach the gateway at {url}: " in err
    assert "Traceback" not in err


async def test_a_url_where_no_gateway_answers_is_a_clear_error() -> None:
    async with serving() as url:
        code, _, err = await chat_command("--url", url + "/v1", stdin=b"hello\n")
    assert code == 1
    assert f"Error: no chatlane gateway answers at {url}/v1 (" in err
    assert "(HTTP 404)" in err
    assert "Traceback" not in err


async def test_a_wrong_token_is_a_clear_error_and_the_right_one_works(tmp_path: Path) -> None:
    async with serving(token=TOKEN) as url:
        code, _, err = await chat_command("--url", url, "--token", "wrong", stdin=b"hi\n")
        assert code == 1
        assert "Error: missing or invalid bearer token (HTTP 401)" in err
        with pytest.raises(TokenRefused):
            await converse_with(url, "hi\n", tmp_path)
        assert await converse_with(url, "hi\n", tmp_path, token=TOKEN) == (0, "echo: hi\n", "")


async def test_oversized_and_odd_input_get_clear_answers(tmp_path: Path) -> None:
    odd = "h\u00e9llo \U0001f600 \u202etxt.exe \u0000 ".encode() + b"\xed\xa0\x80 \xff end"
    big = b"x" * ((1 << 20) + 1)
    async with serving() as url:
        code, out, err = await converse_with(url, big + b"\n" + odd + b"\n", tmp_path)
    assert code == 0
    assert "larger than 1048576 bytes (HTTP 413)" in err
    shown = odd.decode(errors="replace").replace("\u0000", "")
    assert out == f"echo: {shown}\n"


async def test_a_reply_cannot_drive_the_terminal(tmp_path: Path) -> None:
    async def painter(turn: Turn) -> str:
        return "\x1b[2J\x1b]0;owned\x07plain \u00fcn\u00efc\u00f8de \U0001f600\tend"

    async with serving(painter) as url:
        code, out, _ = await converse_with(url, "paint\n", tmp_path)
    assert code == 0
    assert out == "[2J]0;ownedplain \u00fcn\u00efc\u00f8de \U0001f600\tend\n"


# -- pieces ------------------------------------------------------------------------------------


def test_stream_lines_are_classified() -> None:
    assert parse_event('data: {"choices":[{"delta":{"content":"hi"}}]}').text == "hi"
    assert parse_event('data: {"choices":[{"delta":{"role":"assistant"}}]}').text == ""
    assert parse_event(": Queued for the next turn").status == "Queued for the next turn"
    assert parse_event("data: [DONE]").done
    assert parse_event('data: {"error":{"message":"no"}}').error == "no"
    assert "unreadable" in parse_event("data: {nope").error
    assert parse_event("data: [1, 2]") == parse_event("") == parse_event("event: x")


def test_bad_options_are_usage_errors() -> None:
    assert default_session().startswith("terminal-")
    for name in ("ops.team-1@example", "two words", "caf\u00e9", "x:y"):
        assert check_session(name) == name  # the gateway's rule, so any name it accepts
    runner = CliRunner()
    for bad, problem in [
        ("", "is empty"),
        (" x:y", "U+0020 (SPACE), whitespace at the start, at position 0"),
        ("x:y\x1c", "U+001C, a control character, at position 3"),
        ("x:y\u0085", "U+0085, a control character, at position 3"),
        ("x" * 300, "longer than 256"),
    ]:
        result = runner.invoke(main, ["chat", "--session", bad])
        assert result.exit_code == 2, bad
        assert "Invalid value for --session" in result.output
        assert problem in result.output
    result = runner.invoke(main, ["chat", "--token", "s3cret\n"])
    assert result.exit_code == 2
    assert "Invalid value for --token" in result.output
    result = runner.invoke(main, ["chat", "--store", "memory://"])
    assert result.exit_code == 2
    assert "--store needs --local" in result.output
