"""The command line: key building and parsing, with clear errors."""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import json
import os
import socket
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import uvicorn
from click.testing import CliRunner

from chatlane.adapters.api import ApiAdapter
from chatlane.agents.demo import DemoAgent
from chatlane.cli import main
from chatlane.cli_views import session_lines
from chatlane.config import Config, ServerConfig, gateway_url
from chatlane.hub import Hub, build_app
from chatlane.secrets import resolve_secrets
from chatlane.stores import open_store
from tests.ports import free_port


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output


@pytest.mark.parametrize(
    "args",
    [
        ("inspect", "main:api:dm:\udcff"),  # a byte a Latin-1 terminal typed for "ÿ"
        ("sessions", "--token", "\udcf6"),
        ("chat", "--url", "http://127.0.0.1:1/\udcff"),
    ],
)
def test_an_argument_that_is_not_utf8_is_one_clear_error(args: tuple[str, ...]) -> None:
    code, output = run(*args)
    assert code == 2
    assert "is not valid UTF-8; run chatlane in a UTF-8 locale" in output
    assert "Traceback" not in output


def test_windows_is_told_to_use_wsl(monkeypatch: pytest.MonkeyPatch) -> None:
    """chatlane needs fcntl, resource and POSIX signals: one line, not an ImportError."""
    monkeypatch.setattr(sys, "platform", "win32")
    code, output = run("serve")
    assert code == 1
    assert "on Windows, run it inside WSL" in output
    assert "Traceback" not in output


def test_build_and_parse_round_trip() -> None:
    code, key = run(
        "key",
        "build",
        "--platform",
        "matrix",
        "--chat-type",
        "group",
        "--chat-id",
        "!room:example.org",
        "--user-id",
        "@ada:example.org",
    )
    assert code == 0
    assert key.strip() == "main:matrix:group:!room%3Aexample.org::@ada%3Aexample.org"
    code, parts = run("key", "parse", key.strip())
    assert code == 0
    assert "chat_id=!room:example.org" in parts
    assert "user_id=@ada:example.org" in parts


def test_parse_shows_an_id_with_control_characters_on_its_own_line() -> None:
    code, parts = run("key", "parse", "main:web:dm:two\nlines")
    assert code == 0
    assert parts.splitlines() == [
        "namespace=main",
        "platform=web",
        "chat_type=dm",
        "chat_id='two\\nlines'",
        "thread_id=",
        "user_id=",
    ]


def test_build_without_ids_is_a_clear_error() -> None:
    code, output = run("key", "build", "--platform", "telegram")
    assert code == 1
    assert "Error: a session source needs a chat id or a user id" in output
    assert "Traceback" not in output


def test_parse_garbage_is_a_clear_error() -> None:
    code, output = run("key", "parse", "not-a-key")
    assert code == 1
    assert output.startswith("Error: not a session key")


def test_bad_chat_type_is_refused_by_click() -> None:
    code, output = run("key", "build", "--platform", "x", "--chat-id", "1", "--chat-type", "room")
    assert code == 2
    assert "Invalid value for '--chat-type'" in output


@contextmanager
def not_a_gateway() -> Iterator[str]:
    """An HTTP server that answers every GET with 200 and a page of text."""
    with serving_page(200, b"<html>hello</html>", "") as url:
        yield url


@contextmanager
def another_server() -> Iterator[str]:
    """An HTTP server that answers every request 404 with a web page of several lines."""
    page = b"<!DOCTYPE HTML>\n<html>\n<body>Not Found</body>\n</html>\n"
    with serving_page(404, page, "text/html; charset=utf-8") as url:
        yield url


@contextmanager
def serving_page(status: int, body: bytes, content_type: str) -> Iterator[str]:
    """An HTTP server that answers every GET with ``status`` and ``body`` (of
    ``content_type``, if any); its URL."""

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(status)
            if content_type:
                self.send_header("Content-Type", content_type)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("command", ["sessions", "inspect", "failed"])
def test_an_admin_command_at_another_server_says_so_in_one_line(command: str) -> None:
    key = ["main:api:dm:x"] if command == "inspect" else []
    with another_server() as url:
        code, output = run(command, "--url", url, *key)
    assert code == 1
    assert output.endswith("a web page, not a chatlane gateway's answer (HTTP 404)\n")
    assert "<html>" not in output
    assert output.count("\n") == 1


@pytest.mark.parametrize("command", [["serve"], ["sessions"], ["chat"]])
def test_a_config_path_that_is_no_file_is_one_clear_error(
    command: list[str], tmp_path: Path
) -> None:
    code, output = run(*command, "--config", str(tmp_path))
    assert code == 1, output
    assert output == f"Error: config file {str(tmp_path)!r}: Is a directory\n"


@pytest.mark.parametrize("command", ["sessions", "inspect"])
def test_admin_commands_explain_a_bad_url_or_token(command: str) -> None:
    key = ["main:api:dm:x"] if command == "inspect" else []
    unreachable = f"http://127.0.0.1:{free_port()}"
    for args in (["--url", "http://[::1"], ["--url", unreachable, "--token", "t\u00e9"]):
        code, output = run(command, *args, *key)
        assert code == 1, output
        assert "cannot reach the gateway" in output
    with not_a_gateway() as url:
        code, output = run(command, "--url", url, *key)
    assert code == 1
    assert "did not answer as a chatlane gateway (not JSON)" in output


EVIL = "main:web:dm:x\n\x1b[2J\x1b]0;owned\x07\x9b31m\u202e"


@contextmanager
def gateway_answering(body: object) -> Iterator[str]:
    """An HTTP server that answers every GET and POST with ``body`` as JSON."""

    class Answer(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            payload = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        do_POST = do_GET

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(
    ("command", "body"),
    [
        (
            ["sessions"],
            {
                "sessions": [
                    {
                        "key": EVIL,
                        "activity": "idle\x1b[0m",
                        "generation": 1,
                        "queued": 0,
                        "idle_seconds": 5,
                    }
                ]
            },
        ),
        (["inspect", "main:web:dm:x"], {"key": EVIL, "transcript": [{"content": EVIL}]}),
        (["inspect", "main:web:dm:x", "--json"], {"key": EVIL, "transcript": [{"content": EVIL}]}),
        (["failed"], {"failed": [{"message_id": "m\r1", "key": EVIL, "reason": EVIL}]}),
        (
            ["cron", "list"],
            {
                "jobs": [
                    {
                        "id": "j\x1b[2J1",
                        "schedule": "every 2h\x07",
                        "next_run_text": "soon",
                        "configured": False,
                        "principal": EVIL,
                        "session": EVIL,
                        "target": "",
                        "paused": False,
                        "prompt": "hi",
                    }
                ]
            },
        ),
    ],
)
def test_admin_output_shows_control_characters_escaped(command: list[str], body: object) -> None:
    with gateway_answering(body) as url:
        code, output = run(*command, "--url", url)
    assert code == 0, output
    assert {c for c in output if not c.isprintable()} == {"\n"}
    lines = {"sessions": 2, "failed": 1, "cron": 1}
    if command[0] in lines:
        assert len(output.splitlines()) == lines[command[0]], "a forged row"
    if "--json" in command:
        assert json.loads(output) == body, "the same JSON, its raw bytes escaped"


@pytest.mark.parametrize(
    "command",
    [["sessions"], ["inspect", "main:web:dm:x"], ["failed"], ["deliveries"], ["cron", "list"]],
)
@pytest.mark.parametrize("body", [{"another": "service"}, [1, 2], {"sessions": [{"key": 1}]}])
def test_admin_commands_explain_json_of_another_shape(command: list[str], body: object) -> None:
    """Another service on that address, or another version: one line, not a traceback."""
    with gateway_answering(body) as url:
        code, output = run(*command, "--url", url)
    assert code == 1, output
    assert "the gateway's answer is not what this chatlane expects" in output
    assert "Traceback" not in output


def test_an_admin_url_with_a_port_out_of_range_is_refused() -> None:
    """The system would wrap 99999 round to port 34463, and talk to whatever listens there."""
    code, output = run("sessions", "--url", "http://127.0.0.1:99999")
    assert code == 1
    assert "port 99999 is not between 1 and 65535" in output


# -- finding the gateway as `chatlane serve` is configured, against a real one ------------------


class _Signalling(uvicorn.Server):
    """A uvicorn server that sets :attr:`ready` once it listens (or failed to)."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.ready = asyncio.Event()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        try:
            await super().startup(sockets)
        finally:
            self.ready.set()


@contextlib.asynccontextmanager
async def real_gateway(token: str) -> AsyncIterator[int]:
    """A gateway (API and admin routes) on a free loopback port with ``token``; its port."""
    config = Config()
    secrets = resolve_secrets(config, {"CHATLANE_TOKEN": token})
    hub = Hub(config, await open_store("memory://"), DemoAgent(), secrets=secrets)
    hub.add(ApiAdapter(config, access=hub.access, secrets=secrets))
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP) as sock:
        sock.bind(("127.0.0.1", 0))
        server = _Signalling(uvicorn.Config(build_app(hub), lifespan="on", log_level="warning"))
        task = asyncio.create_task(server.serve(sockets=[sock]))
        try:
            ready = asyncio.create_task(server.ready.wait())
            await asyncio.wait({ready, task}, timeout=20, return_when=asyncio.FIRST_COMPLETED)
            ready.cancel()
            if not server.started:
                raise AssertionError("the gateway did not start")
            yield sock.getsockname()[1]
        finally:
            server.should_exit = True
            await task


async def command(
    *args: str, env: dict[str, str], cwd: Path, stdin: bytes = b""
) -> tuple[int, str, str]:
    """``chatlane ARGS`` in a process of its own: exit status, stdout, stderr."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("CHATLANE_")}
    process = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "chatlane.cli", *args),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**clean, **env},
        cwd=cwd,
    )
    out, err = await asyncio.wait_for(process.communicate(stdin), 40)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def test_python_m_chatlane_is_the_chatlane_command(tmp_path: Path) -> None:
    process = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "chatlane", "--help"),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=tmp_path,
    )
    out, err = await asyncio.wait_for(process.communicate(), 40)
    assert (process.returncode, err) == (0, b"")
    assert out.decode().startswith("Usage: chatlane [OPTIONS] COMMAND")


async def test_clients_find_the_gateway_as_serve_is_configured(tmp_path: Path) -> None:
    async with real_gateway("t0ken") as port:
        configured = {"CHATLANE_SERVER__PORT": str(port), "CHATLANE_TOKEN": "t0ken"}
        code, out, err = await command(
            "chat", "--session", "found", env=configured, cwd=tmp_path, stdin=b"hello\n"
        )
        assert (code, out) == (0, "echo: hello\n"), err
        code, out, err = await command("sessions", env=configured, cwd=tmp_path)
        assert code == 0, err
        assert "main:api:dm:found" in out
        (tmp_path / "chatlane.toml").write_text(
            f'[server]\nport = {port}\ntoken = {{ file = "{tmp_path}/token" }}\n'
        )
        (tmp_path / "token").write_text("t0ken\n")
        code, out, err = await command(
            "inspect", "main:api:dm:found", "--config", "chatlane.toml", env={}, cwd=tmp_path
        )
        assert code == 0, err
        assert "session       main:api:dm:found" in out
        assert "  user: hello" in out
        assert "  assistant: echo: hello" in out
        code, out, _ = await command(
            "inspect", "main:api:dm:found", "--json", env=configured, cwd=tmp_path
        )
        assert json.loads(out)["transcript"][0]["content"] == "hello"
        wrong = {**configured, "CHATLANE_SERVER__PORT": str(free_port())}
        code, out, err = await command(
            "sessions", env={**wrong, "CHATLANE_URL": f"http://127.0.0.1:{port}"}, cwd=tmp_path
        )
        assert code == 0, err  # CHATLANE_URL wins over the configuration
        assert "main:api:dm:found" in out
        code, _, err = await command("sessions", env=wrong, cwd=tmp_path)
        assert code == 1
        assert (
            f"cannot reach the gateway at http://127.0.0.1:{wrong['CHATLANE_SERVER__PORT']}" in err
        )
        code, _, err = await command(
            "sessions", env={**configured, "CHATLANE_TOKEN": "no"}, cwd=tmp_path
        )
        assert code == 1
        assert "HTTP 401" in err


async def test_a_bad_configuration_is_one_clear_error(tmp_path: Path) -> None:
    (tmp_path / "chatlane.toml").write_text("[server]\nport = 'eighty'\n")
    for args in (["sessions"], ["inspect", "main:api:dm:x"], ["chat"]):
        code, _, err = await command(*args, "--config", "chatlane.toml", env={}, cwd=tmp_path)
        assert code == 1
        assert err.startswith("Error: configuration key 'server.port'")
        assert "Traceback" not in err


def test_gateway_url_reads_the_server_address() -> None:
    assert gateway_url(Config(), {}) == "http://127.0.0.1:8080"
    assert gateway_url(Config(server=ServerConfig(port=9000)), {}) == "http://127.0.0.1:9000"
    assert gateway_url(Config(server=ServerConfig(host="0.0.0.0")), {}) == "http://127.0.0.1:8080"
    assert gateway_url(Config(server=ServerConfig(host="::")), {}) == "http://[::1]:8080"
    assert gateway_url(Config(server=ServerConfig(host="::1")), {}) == "http://[::1]:8080"
    named = {"CHATLANE_URL": "https://chat.example.com"}
    assert gateway_url(Config(), named) == "https://chat.example.com"


def test_inspect_reads_a_partial_answer() -> None:
    lines = list(session_lines({"key": "k", "transcript": [{"content": "two\nlines"}]}))
    assert lines == [
        "session       k",
        "state         not active in this gateway process (generation ?)",
        "transcript    last 1 entries",
        "  ?: two",
        "    lines",
    ]


def test_serve_help_names_every_chat_platform_and_store() -> None:
    code, output = run("serve", "--help")
    assert code == 0
    text = " ".join(output.split())  # as wrapped for the terminal
    assert "(and Telegram, Slack and Discord when enabled)" in text
    for scheme in ("memory://", "sqlite://", "redis://", "rediss://", "redis+sentinel://"):
        assert scheme in text
    assert "postgresql://" in text
