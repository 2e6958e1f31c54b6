"""Structured logs: every line about a turn carries its session key and generation.

Code logs with ``extra=turn_fields(key, generation)``; :func:`configure_logging`
renders those fields as ``session=… gen=…`` after the message, or as JSON
lines with ``--log-format json``. Secrets are never passed to a logger, and
the handler redacts every URL (:mod:`chatlane.redaction`).

What stays true: one record is one line (a traceback follows on lines of its
own, each indented: only a record's first line starts at the first column).
Newlines, ESC and every other non-printable character in a message or a
session key are shown escaped (``\\n``, ``\\x1b``), and an exception's own
text — which may quote user text over several lines — stays inside its
indented traceback, so user text can neither forge a log line nor send a
terminal escape sequence.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

from chatlane.redaction import URL_REDACTOR

FIELDS = ("session_key", "generation")


def escape_controls(text: str, keep: str = "") -> str:
    """``text`` with every non-printable character but those in ``keep`` escaped as in Python.

    ``"a\\nb\\x1b"`` becomes ``a\\nb\\x1b`` (backslash escapes, one line); printable
    text, non-ASCII letters included, is returned as it is.
    """
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c in keep else _escaped(c) for c in text)


def escape_json_controls(dumped: str) -> str:
    """JSON text with the non-printable characters ``json.dumps`` leaves raw written as ``\\u``.

    Valid JSON stays valid and means the same; only its raw bytes change.
    """
    if dumped.isprintable():
        return dumped
    return "".join(c if c.isprintable() else json.dumps(c)[1:-1] for c in dumped)


def _escaped(char: str) -> str:
    return char.encode("unicode_escape").decode("ascii")


def turn_fields(session_key: str, generation: int | None = None) -> dict[str, Any]:
    """The ``extra`` that marks a log line as being about one session (and turn)."""
    return {"session_key": session_key, "generation": generation}


class TextFormatter(logging.Formatter):
    """``time level logger message session=<key> gen=<n>`` (the fields only when known)."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        return escape_controls(super().formatMessage(record))

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        head, newline, rest = text.partition("\n")
        rest = _indented(escape_controls(rest, keep="\n"))
        key = getattr(record, "session_key", None)
        if key is None:
            return head + newline + rest
        generation = getattr(record, "generation", None)
        suffix = f" session={escape_controls(str(key))}"
        suffix += f" gen={generation}" if generation is not None else ""
        return head + suffix + newline + rest


def _indented(lines: str) -> str:
    """``lines`` with every line that starts at the first column indented by two spaces, so
    none can pass for a record of its own (which starts with its time)."""
    if not lines:
        return lines
    return "\n".join(line if line[:1] in ("", " ") else "  " + line for line in lines.split("\n"))


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, session fields, exception."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in FIELDS:
            value = getattr(record, name, None)
            if value is not None:
                entry[name] = value
        if record.exc_info:
            # a filter may have rewritten the cached text (to redact a secret): use it
            entry["exception"] = record.exc_text or self.formatException(record.exc_info)
        return escape_json_controls(json.dumps(entry, ensure_ascii=False))


def configure_logging(fmt: str = "text", level: int = logging.INFO) -> None:
    """Send logs to stderr as text or JSON lines, every URL in them redacted."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(URL_REDACTOR)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
