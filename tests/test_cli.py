"""The command line: key building and parsing, with clear errors."""

from __future__ import annotations

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
