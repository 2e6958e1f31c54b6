"""The command line: key building and parsing, with clear errors."""

from __future__ import annotations

import http.server
import json
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from click.testing import CliRunner

from chatlane.cli import main


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output


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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextmanager
def not_a_gateway() -> Iterator[str]:
    """An HTTP server that answers every GET with 200 and a page of text."""

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"<html>hello</html>")

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
        (["failed"], {"failed": [{"message_id": "m\r1", "key": EVIL, "reason": EVIL}]}),
    ],
)
def test_admin_output_shows_control_characters_escaped(command: list[str], body: object) -> None:
    with gateway_answering(body) as url:
        code, output = run(*command, "--url", url)
    assert code == 0, output
    assert {c for c in output if not c.isprintable()} == {"\n"}
    lines = {"sessions": 2, "failed": 1}
    if command[0] in lines:
        assert len(output.splitlines()) == lines[command[0]], "a forged row"
