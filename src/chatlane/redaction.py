"""Credentials kept out of what chat users store and out of every log line.

What stays true:

* :func:`looks_like_credential` is true for text that carries a key, a token
  or a password in a shape services use (``sk-…``, ``Bearer …``, ``key=…``,
  a URL with ``user:password@``); commands refuse such text without echoing it.
* :class:`UrlRedactor` rewrites every URL in a log record — its message and
  its traceback — without userinfo, query values or fragment, so neither
  chatlane's own lines nor the HTTP client's request log (httpx logs each
  request URL at INFO) carry credentials a URL held.
"""

from __future__ import annotations

import logging
import re

CREDENTIALS_REFUSED = (
    "That looks like a credential. Keys, tokens and passwords are never stored or "
    "sent from a chat; the operator sets them in the configuration."
)
"""The one reply to any refused credential: it repeats nothing of what was sent."""

_CREDENTIAL = re.compile(
    r"""
      \bsk-[A-Za-z0-9_-]{16,}                                  # OpenAI, Anthropic
    | \b(?:gh[pousr]_|github_pat_)[A-Za-z0-9_]{20,}            # GitHub
    | \bxox[abprs]-[A-Za-z0-9-]{10,}                           # Slack
    | \bAKIA[0-9A-Z]{16}\b                                     # AWS access key id
    | \bAIza[0-9A-Za-z_-]{35}                                  # Google API key
    | \b\d{6,}:[A-Za-z0-9_-]{30,}                              # Telegram bot token
    | \beyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.              # a JWT
    | -----BEGIN[A-Z ]*PRIVATE\ KEY-----
    | \bbearer\s+[A-Za-z0-9._~+/=-]{12,}
    | [a-z][a-z0-9+.-]*://[^/\s?#@]*@                          # userinfo in a URL
    | [\w-]*(?:key|token|secret|passw(?:or)?d|pwd|credential|signature|sig|auth)
      [\w-]*=[^\s&]                                            # key=… (queries, env lines)
    """,
    re.IGNORECASE | re.VERBOSE,
)

_URL = re.compile(
    r"""(?P<scheme>\b[a-z][a-z0-9+.-]*://)
        (?P<userinfo>[^/\s"'<>]*@)?    # to the last @ before the path: a password may hold @
        (?P<rest>[^\s?#"'<>]*)
        (?P<query>\?[^\s#"'<>]*)?
        (?P<fragment>\#[^\s"'<>]*)?""",
    re.IGNORECASE | re.VERBOSE,
)


def looks_like_credential(text: str) -> bool:
    """Whether ``text`` holds something shaped like a key, token or password."""
    return _CREDENTIAL.search(text) is not None


def redact_urls(text: str) -> str:
    """``text`` with each URL's userinfo, query values and fragment replaced by ``***``."""
    return _URL.sub(_redacted, text) if "://" in text else text


_SENTENCE = ":;,.)"
"""Punctuation that, ending a URL's query or fragment before a space, is the sentence's,
not the URL's (``…?sslmode=require: no answer``): kept after it, unredacted."""


def _redacted(match: re.Match[str]) -> str:
    query, fragment = match.group("query") or "", match.group("fragment") or ""
    last = fragment or query
    spaced = match.string[match.end() : match.end() + 1].isspace()
    tail = last[len(last.rstrip(_SENTENCE)) :] if spaced else ""
    if query:
        query = query[: len(query) - len(tail)] if not fragment else query
        names = [part.partition("=")[0] for part in query[1:].split("&")]
        query = "?" + "&".join(f"{name}=***" for name in names if name)
    userinfo = "***@" if match.group("userinfo") else ""
    fragment = "#***" if fragment else ""
    redacted = f"{match.group('scheme')}{userinfo}{match.group('rest')}{query}{fragment}"
    return redacted + tail


class UrlRedactor(logging.Filter):
    """Rewrites the URLs in a record's message and traceback with :func:`redact_urls`."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except (TypeError, ValueError):  # a malformed record: logging reports it later
            return True
        redacted = redact_urls(message)
        if redacted != message:
            record.msg, record.args = redacted, None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact_urls(record.exc_text)
        return True


URL_REDACTOR = UrlRedactor()
"""The one instance: adding it to a logger or handler twice is a no-op."""

CLIENT_LOGGERS = ("httpx", "httpcore", "openai")
"""The HTTP client's loggers, which log request URLs."""


def redact_client_logs() -> None:
    """Filter the HTTP client's loggers through :data:`URL_REDACTOR` (idempotent)."""
    for name in CLIENT_LOGGERS:
        logging.getLogger(name).addFilter(URL_REDACTOR)
