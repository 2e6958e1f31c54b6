"""``chatlane chat``: a real terminal (a pseudo-terminal), a real gateway, real HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import io
import os
import pty
import re
import select
import signal
import socket
import stat
import struct
import subprocess
import sys
import termios
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pyte
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
from tests.ports import free_port

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


ANSI = re.compile(rb"\x1b(\[[0-?]*[ -/]*[@-~]|\][^\x07]*\x07|[()][0-9A-Za-z]|[=>78])")
"""Terminal control sequences (cursor moves, colours, titles), left out when reading the text."""
COLUMNS, ROWS = 200, 50


class Screen(pyte.Screen):
    """What a terminal of :data:`COLUMNS` by :data:`ROWS` shows; it answers the program's
    queries (the cursor position the line editor asks for) as a terminal does."""

    def __init__(self, master: int) -> None:
        super().__init__(COLUMNS, ROWS)
        self.master = master

    def write_process_input(self, data: str) -> None:
        os.write(self.master, data.encode())


class Terminal:
    """``chatlane chat …`` running under a pseudo-terminal, typed into like a person would.

    Its output is read two ways: as text (control sequences left out), and as
    the screen a terminal emulator draws of it. The line history is kept in
    ``state`` (``$XDG_STATE_HOME``).
    """

    def __init__(self, *args: str, cwd: Path, state: Path, env: dict[str, str]) -> None:
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", ROWS, COLUMNS, 0, 0))
        self.master = master
        self.screen = Screen(master)
        self.stream = pyte.ByteStream(self.screen)
        self.process = subprocess.Popen(
            [sys.executable, "-c", LAUNCH, "chat", *args],
            stdin=slave,
            stdout=slave,
            stderr=slave,
            start_new_session=True,
            cwd=cwd,
            env={**clean_env(), "TERM": "xterm", "XDG_STATE_HOME": str(state), **env},
        )
        os.close(slave)
        self.output = b""
        self.seen = 0

    def type(self, keys: str) -> None:
        os.write(self.master, keys.encode())

    @property
    def text(self) -> str:
        """Everything printed so far, without control sequences."""
        return ANSI.sub(b"", self.output).decode(errors="replace")

    def expect(self, text: str, timeout: float = 30) -> str:
        """Wait for ``text`` after what was already matched; the output up to its end."""
        deadline = time.monotonic() + timeout
        while (found := self.text.find(text, self.seen)) < 0:
            self._read_until(deadline, f"no {text!r} in {self.text[self.seen :]!r}")
        end = found + len(text)
        before, self.seen = self.text[self.seen : end], end
        return before

    def expect_prompt(self, above: str = "", timeout: float = 30) -> None:
        """Wait until the screen shows an empty prompt at the cursor, with ``above`` on a
        line over it."""
        deadline = time.monotonic() + timeout
        while not self.prompting(above):
            self._read_until(deadline, "no empty prompt under " + repr(above))

    def expect_input(self, line: str, timeout: float = 30) -> None:
        """Wait until the prompt at the cursor holds ``line``, as typed or recalled."""
        deadline = time.monotonic() + timeout
        while self.screen.display[self.screen.cursor.y].rstrip() != f"> {line}":
            self._read_until(deadline, f"no {line!r} at the prompt")

    def prompting(self, above: str) -> bool:
        lines, cursor = self.screen.display, self.screen.cursor
        at_prompt = lines[cursor.y].rstrip() == ">" and cursor.x == 2
        return at_prompt and (not above or any(above in line for line in lines[: cursor.y]))

    def _read_until(self, deadline: float, failure: str) -> None:
        left = deadline - time.monotonic()
        if left <= 0 or not self._read(left):
            raise AssertionError(f"{failure}; the screen:\n" + "\n".join(self.screen.display))

    def _read(self, timeout: float) -> bool:
        ready, _, _ = select.select([self.master], [], [], min(timeout, 0.5))
        if not ready:
            return True
        try:
            data = os.read(self.master, 65536)
        except OSError:  # EIO: the program closed the terminal
            return False
        self.output += data
        self.stream.feed(data)
        return bool(data)

    def wait(self, timeout: float = 30) -> int:
        """The exit status, once the program ended (its output read meanwhile, as a terminal
        does, so it is never held up writing or waiting for an answer to a query)."""
        deadline = time.monotonic() + timeout
        while self._read(max(0.0, deadline - time.monotonic())) and time.monotonic() < deadline:
            pass
        return self.process.wait(max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(10)
        os.close(self.master)


@contextlib.contextmanager
def running_terminal(
    *args: str, cwd: Path, state: Path | None = None, env: dict[str, str] | None = None
) -> Iterator[Terminal]:
    state = state or cwd.with_name(cwd.name + "-state")
    term = Terminal(*args, cwd=cwd, state=state, env=env or {})
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


# -- in a pseudo-terminal -------------------------------------------------------------------


def test_a_conversation_in_a_terminal(tmp_path: Path) -> None:
    with running_terminal("--local", cwd=tmp_path) as term:
        term.expect_prompt()
        term.type("hello\r")
        term.expect_prompt(above="echo: hello")  # typing waits for the prompt, as a person does
        term.type("whoami\r")
        term.expect_prompt(above="platform=api chat=terminal-")
        term.type("/status\r")
        term.expect("Status: idle")
        term.expect_prompt(above="Status: idle")
        term.type("\x04")  # Ctrl-D
        assert term.wait() == 0
    assert not list(tmp_path.iterdir()), "--local keeps its store in memory"


def test_ctrl_c_stops_the_turn_and_the_prompt_stays_after_an_approval(tmp_path: Path) -> None:
    with running_terminal("--local", "--session", "ctrl-c", cwd=tmp_path) as term:
        term.expect_prompt()
        term.type("approve ls -l\r")
        term.expect("Approval needed")
        # drawn again under the approval request, whose turn waits for the answer
        term.expect_prompt(above="Reply /approve")
        term.type("/approve\r")  # sent while the first reply is still open
        term.expect_prompt(above="approved: ls -l")
        term.type("sleep 30\r")
        term.expect_prompt(above="sleep 30")
        term.type("hello again\r")
        term.expect_prompt(above="Queued")
        term.type("\x03")  # Ctrl-C while both replies are open: the client sends /stop
        term.expect("Ctrl-C: stopping the turn")
        term.expect("Stopped the running turn. Dropped 1 queued message.")
        term.expect_prompt(above="Stopped the running turn")
        term.type("hello\r")
        term.expect_prompt(above="echo: hello")
        term.type("\x03")  # Ctrl-C at an empty prompt
        assert term.wait() == 128 + signal.SIGINT
        assert "Traceback" not in term.text


def test_bytes_that_are_no_utf8_are_sent_replaced_and_the_conversation_goes_on(
    tmp_path: Path,
) -> None:
    """A Latin-1 terminal's ``é``, or pasted binary: the line is sent with U+FFFD in their
    place, as from a pipe, instead of ending the conversation."""
    with running_terminal("--local", cwd=tmp_path) as term:
        term.expect_prompt()
        os.write(term.master, b"hello \xff\xfe world\r")
        term.expect_prompt(above="echo: hello \ufffd\ufffd world")
        term.type("whoami\r")
        term.expect_prompt(above="platform=api")
        term.type("\x04")
        assert term.wait() == 0
        assert "failed" not in term.text


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_and_sighup_put_the_terminal_back_and_shut_down_the_local_gateway(
    tmp_path: Path, signum: signal.Signals
) -> None:
    """Killed by their default action, the client left the terminal in raw mode, and a
    ``--local`` gateway's lease held: the next conversation found its session busy."""
    store = f"sqlite:///{tmp_path / 'chat.db'}"
    local = ("--local", "--store", store, "--session", "kept")
    with running_terminal(*local, cwd=tmp_path) as term:
        term.expect_prompt()
        term.type("sleep 2\r")  # a turn holds the session's lease
        term.expect_prompt(above="sleep 2")
        term.process.send_signal(signum)
        assert term.wait() == 128 + signum
        modes = termios.tcgetattr(term.master)[3]
        assert modes & termios.ECHO
        assert modes & termios.ICANON
        assert "Traceback" not in term.text
    with running_terminal(*local, cwd=tmp_path) as term:
        term.expect_prompt()
        term.type("hello\r")
        term.expect_prompt(above="echo: hello")  # Ctrl-D while a line prints may be lost
        term.type("\x04")
        assert term.wait() == 0
        assert "busy" not in term.text


def test_history_is_kept_and_searched_and_commands_complete(tmp_path: Path) -> None:
    state = tmp_path / "state"
    (tmp_path / "cwd").mkdir()
    with running_terminal("--local", cwd=tmp_path / "cwd", state=state) as term:
        term.expect_prompt()
        term.type("hello from before\r")
        term.expect_prompt(above="echo: hello from before")
        term.type("whoami\r")
        term.expect_prompt(above="platform=api")
        term.type("\x04")
        assert term.wait() == 0
    history = state / "chatlane" / "chat_history"
    assert stat.S_IMODE(history.stat().st_mode) == 0o600
    assert stat.S_IMODE(history.parent.stat().st_mode) == 0o700
    with running_terminal("--local", cwd=tmp_path / "cwd", state=state) as term:
        term.expect_prompt()
        term.type("\x1b[A\x1b[A")  # up, up: the line before the last
        term.expect_input("hello from before")
        term.type("\r")
        term.expect("echo: hello from before")
        term.expect_prompt(above="echo: hello from before")
        term.type("\x12from bef")  # Ctrl-R, then part of a line
        term.expect("reverse-i-search")
        term.type("\r")  # takes the line found
        term.expect_input("hello from before")
        term.type("\r")
        term.expect("echo: hello from before")
        term.expect_prompt(above="echo: hello from before")
        term.type("/sta\t")  # Tab completes the gateway's /status
        term.expect_input("/status")
        term.type("\r")
        term.expect_prompt(above="Status: idle")
        term.type("\x04")
        assert term.wait() == 0


def test_a_line_typed_halfway_is_dropped_by_ctrl_c_not_sent(tmp_path: Path) -> None:
    with running_terminal("--local", "--session", "half", cwd=tmp_path) as term:
        term.expect_prompt()
        term.type("do not send this\x03")
        term.type("/status\r")
        term.expect_prompt(above="Status: idle")
        term.type("\x04")
        assert term.wait() == 0
    assert "echo: do not send this" not in term.text


async def test_a_reply_line_shows_while_it_streams(tmp_path: Path) -> None:
    shown = asyncio.Event()

    async def two_pieces(turn: Turn) -> AsyncIterator[str]:
        yield "first piece, "
        await asyncio.wait_for(shown.wait(), 30)  # only once the terminal showed it
        yield "second piece"

    async with serving(two_pieces) as url:
        with running_terminal("--url", url, "--session", "pieces", cwd=tmp_path) as term:
            await asyncio.to_thread(term.expect_prompt)
            term.type("go\r")
            await asyncio.to_thread(term.expect, "first piece,")
            shown.set()
            await asyncio.to_thread(term.expect, "second piece")
            await asyncio.to_thread(term.expect_prompt, "first piece, second piece")
            assert "first piece, second piece" in term.text, "one line, in two pieces"
            term.type("\x04")
            assert await asyncio.to_thread(term.wait) == 0


def test_quit_leaves_with_status_0(tmp_path: Path) -> None:
    with running_terminal("--local", "--store", f"sqlite:///{tmp_path}/c.db", cwd=tmp_path) as term:
        term.expect_prompt()
        term.type("/quit\r")
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
