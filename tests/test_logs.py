"""Log lines: user text can neither forge a line nor reach the terminal as an escape."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest

from chatlane.logs import JsonFormatter, TextFormatter, turn_fields

FORGED = "hello\n2030-01-01 00:00:00,000 ERROR chatlane forged line\r\x1b[2J\x9b31m\u202e"
KEY = "main:web:dm:evil\n\x1b]0;title\x07"


@pytest.fixture
def captured(request: pytest.FixtureRequest) -> Iterator[tuple[logging.Logger, io.StringIO]]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(request.param())
    logger = logging.getLogger("chatlane.tests.logs")
    logger.addHandler(handler)
    logger.propagate = False
    logger.setLevel(logging.INFO)
    try:
        yield logger, stream
    finally:
        logger.removeHandler(handler)
        logger.propagate = True


def raw_controls(text: str) -> set[str]:
    return {c for c in text if not c.isprintable()}


@pytest.mark.parametrize("captured", [TextFormatter], indirect=True)
def test_text_lines_show_user_text_escaped(captured: tuple[logging.Logger, io.StringIO]) -> None:
    logger, stream = captured
    logger.info("got %s", FORGED, extra=turn_fields(KEY, 3))
    output = stream.getvalue()
    [line] = output.splitlines()
    assert raw_controls(line) == set()
    assert "hello\\n2030-01-01" in line
    assert "\\x1b[2J" in line
    assert "\\x9b31m" in line
    assert line.endswith(" session=main:web:dm:evil\\n\\x1b]0;title\\x07 gen=3")


@pytest.mark.parametrize("captured", [TextFormatter], indirect=True)
def test_a_traceback_keeps_its_lines_and_escapes_the_rest(
    captured: tuple[logging.Logger, io.StringIO],
) -> None:
    logger, stream = captured
    try:
        raise ValueError("bad \x1b[31m value")
    except ValueError:
        logger.exception("failed on %s", FORGED)
    first, *traceback = stream.getvalue().splitlines()
    assert first.endswith("\\u202e")
    assert traceback[0] == "  Traceback (most recent call last):"
    assert traceback[-1] == "  ValueError: bad \\x1b[31m value"
    assert all(raw_controls(line) == set() for line in traceback)


@pytest.mark.parametrize("captured", [TextFormatter], indirect=True)
def test_an_exception_quoting_user_text_cannot_forge_a_line(
    captured: tuple[logging.Logger, io.StringIO],
) -> None:
    """An exception's text is not the logger's message: an agent's error may quote what a
    user sent, newlines and all. Every line after a record's first is indented."""
    logger, stream = captured
    try:
        raise ValueError(f"the model refused: {FORGED}")
    except ValueError:
        logger.exception("the agent failed", extra=turn_fields(KEY, 3))
    first, *rest = stream.getvalue().splitlines()
    assert first.endswith(" gen=3")
    assert "  2030-01-01 00:00:00,000 ERROR chatlane forged line\\r\\x1b[2J\\x9b31m\\u202e" in rest
    assert all(line.startswith("  ") for line in rest)


@pytest.mark.parametrize("captured", [JsonFormatter], indirect=True)
def test_json_lines_escape_every_control(captured: tuple[logging.Logger, io.StringIO]) -> None:
    logger, stream = captured
    logger.info("got %s", FORGED, extra=turn_fields(KEY, 3))
    [line] = stream.getvalue().splitlines()
    assert raw_controls(line) == set()
    entry = json.loads(line)
    assert (entry["message"], entry["session_key"]) == (f"got {FORGED}", KEY)
