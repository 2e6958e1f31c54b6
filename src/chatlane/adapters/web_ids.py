"""Browser ids: issued and signed by the server, so no client can invent one.

A browser's id is its chat id and user id, so one browser is one session and
its tabs are counted together. What stays true:

* The identity cookie holds ``<id>.<mac>``: a random id (144 bits, issued as
  36 hex digits, so it reads and renders the same everywhere — no ``_`` or
  ``-`` for Markdown to take as emphasis, or a double click to stop at) and an
  HMAC-SHA256 of it under the server's secret. Ids issued earlier in
  URL-safe base64 stay valid. A value is that id only when
  the whole value has this shape and the MAC matches (compared in constant
  time); anything else — an invented id, an old unsigned one, a value with
  anything around it — is no id at all.
* The secret is never stored in the store (nothing secret is; the admin
  routes show stored fields). It comes from ``web.id_secret`` when
  configured; else, with a SQLite store, from a file next to the database
  (``<database>.web-secret``, created with mode 0600, so ids outlive restarts);
  else it is made at start and dies with the process (a memory store forgets
  its sessions anyway).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import logging
import os
import re
import secrets
from pathlib import Path

from starlette.requests import HTTPConnection

from chatlane.config import Config
from chatlane.errors import ConfigError
from chatlane.secrets import read_secret

log = logging.getLogger("chatlane.adapters.web")

IDENTITY_COOKIE = "chatlane_web"
"""Holds the browser's signed id."""
SECRET_SUFFIX = ".web-secret"
_SIGNED = re.compile(r"([A-Za-z0-9_-]{16,64})\.([A-Za-z0-9_-]{43})")
_DOMAIN = b"chatlane browser id\0"


class BrowserIds:
    """Issues signed browser ids and reads them back (see the module docstring)."""

    def __init__(self, secret: bytes) -> None:
        if len(secret) < 16:
            raise ConfigError("the web id secret must hold at least 16 bytes")
        self._secret = secret

    def issue(self) -> str:
        """A fresh cookie value: a random id and its MAC."""
        return self.signed(secrets.token_hex(18))

    def signed(self, bid: str) -> str:
        """The cookie value that carries ``bid``: the id and its MAC."""
        return f"{bid}.{self._mac(bid)}"

    def verify(self, value: str) -> str | None:
        """The id ``value`` carries, or ``None`` unless it is exactly one this server signed."""
        match = _SIGNED.fullmatch(value)
        if match is None:
            return None
        bid, mac = match.groups()
        return bid if hmac.compare_digest(mac.encode(), self._mac(bid).encode()) else None

    def read(self, connection: HTTPConnection) -> str | None:
        """The browser id of ``connection``'s identity cookie, or ``None``.

        The ``Cookie`` header is read here, not through Starlette's parser, which
        strips whitespace and quotes from values: a value with anything around
        an id is not that id, never trimmed into it.
        """
        value = _identity_cookie(connection.headers.get("cookie", ""))
        return None if value is None else self.verify(value)

    def _mac(self, bid: str) -> str:
        digest = hmac.new(self._secret, _DOMAIN + bid.encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).decode().rstrip("=")


def _identity_cookie(header: str) -> str | None:
    """The raw value of the last identity cookie in ``header`` (``name=value; name=value``)."""
    found = None
    for pair in header.split(";"):
        name, equals, value = pair.partition("=")
        if equals and name.lstrip(" \t") == IDENTITY_COOKIE:
            found = value
    return found


def id_secret(config: Config, configured: str | None = None) -> bytes:
    """The secret browser ids are signed with, for ``config`` (see the module docstring).

    :param configured: ``web.id_secret`` as read at start (``""``: not configured);
        default: read now (:func:`~chatlane.secrets.read_secret`).
    :raises ConfigError: if the configured secret or the secret file cannot be read.
    """
    if configured is None:
        configured = read_secret(config.web.id_secret)
    if configured:
        return configured.encode()
    path = secret_path(config.store.url)
    if path is None:
        if not config.store.url.startswith("memory:"):
            log.warning(
                "web.id_secret is not set: browser ids last until this process stops "
                "and are not shared with other processes"
            )
        return secrets.token_bytes(32)
    return _file_secret(path)


def secret_path(store_url: str) -> Path | None:
    """``<database>.web-secret`` for a SQLite store URL, else ``None``."""
    if not store_url.startswith("sqlite:///"):
        return None
    database = store_url.removeprefix("sqlite:///").partition("?")[0]
    return Path(database + SECRET_SUFFIX) if database and database != ":memory:" else None


def _file_secret(path: Path) -> bytes:
    """The secret in ``path``, made first (mode 0600, never replaced) if it does not exist.

    The file appears whole or not at all: it is written under a temporary
    name and linked into place, so a second process starting at the same
    moment reads either nothing (and makes its own, which loses the link) or
    the whole secret — never an empty file.
    """
    if not path.exists():
        _publish_secret(path)
    return _read_secret(path)


def _publish_secret(path: Path) -> None:
    """Write a new secret to ``path`` unless one appeared meanwhile (the first one wins)."""
    draft = path.with_name(f"{path.name}.{secrets.token_hex(8)}.tmp")
    try:
        descriptor = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "w") as file:
            file.write(secrets.token_hex(32))
        with contextlib.suppress(FileExistsError):
            os.link(draft, path)
    except OSError as error:
        raise ConfigError(f"web id secret {str(path)!r}: {error.strerror}") from None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(draft)


def _read_secret(path: Path) -> bytes:
    try:
        text = path.read_text().strip()
    except OSError as error:
        raise ConfigError(f"web id secret {str(path)!r}: {error.strerror}") from None
    if path.stat().st_mode & 0o077:
        log.warning("web id secret %s is readable by others; chmod 600 it", path)
    return bytes.fromhex(text) if _is_hex(text) else text.encode()


def _is_hex(text: str) -> bool:
    return len(text) % 2 == 0 and all(c in "0123456789abcdef" for c in text)
