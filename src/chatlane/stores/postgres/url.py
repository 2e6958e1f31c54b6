"""``postgresql://`` URLs: what they may say, and the :class:`Location` they name.

What stays true:

* chatlane's own options (``schema``, ``pool_min``, ``pool_max``,
  ``connect_timeout``, ``idle_in_transaction_timeout``, ``command_timeout``,
  ``renew_timeout``, and ``keepalives`` and ``keepalives_idle``, which mean what
  they mean to libpq) are taken out of the URL; the rest of it is handed to
  the driver as written. A query option chatlane does not know and libpq's
  connection options do not include is refused with a
  :class:`~chatlane.errors.StoreError` naming it — a misspelt option never
  silently falls back to a default (or becomes a server setting).
* Passwords never appear in an error message or a log line (:func:`redact`); a URL
  that cannot be split safely (see :mod:`chatlane.stores.urls`) is refused without
  being shown.
* A password holding ``@`` reaches the driver percent-encoded (it splits its address at
  the first ``@``, while the host follows the last one).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from urllib.parse import SplitResult, parse_qsl, urlencode, urlunsplit

from chatlane.errors import StoreError
from chatlane.stores import urls

__all__ = ["DEFAULT_SCHEMA", "SCHEMES", "Location", "parse_url", "redact"]

SCHEMES = ("postgresql", "postgres")
DEFAULT_SCHEMA = "chatlane"
"""The schema holding chatlane's tables unless the URL names another (``?schema=``)."""
POOL_MIN, POOL_MAX = 1, 10
"""Connections a store keeps open at least, and opens at most (``pool_min``, ``pool_max``)."""
MAX_POOL = 1000
"""The most ``pool_min`` and ``pool_max`` may say: far above what a server serves one client
(PostgreSQL allows 100 connections by default), and small enough for the driver, which sets
up a pool's every slot at once, to do so without a pause."""
CONNECT_TIMEOUT = 5.0
"""Seconds to open a connection, authentication included (``connect_timeout=`` wins)."""
IDLE_IN_TRANSACTION_TIMEOUT = 5.0
"""Seconds the server lets one of the store's transactions wait for its client before ending it
(``idle_in_transaction_timeout=`` wins). A transaction of chatlane's never waits for anything but
its own next statement: one idle this long belongs to a process that was stopped or frozen
mid-transaction, and ending it frees the session's lock and rows for the process taking over."""
MIN_IDLE_IN_TRANSACTION_TIMEOUT, MAX_IDLE_IN_TRANSACTION_TIMEOUT = 0.1, 2_000_000.0
"""The bounds of ``idle_in_transaction_timeout``: shorter would end a loaded client's live
transactions; longer does not fit the server's setting."""
COMMAND_TIMEOUT = 30.0
"""Seconds a call (one transaction, or one statement) may wait for the server's answer before
its connection is closed and the call fails (``command_timeout=`` wins): far longer than any
of chatlane's calls takes on a server that answers, short of a client's patience."""
RENEW_TIMEOUT = 2.0
"""Seconds a heartbeat or a lease renewal may wait for the server's answer (``renew_timeout=``
wins): a fifth of the default lease TTL, so that after one lost to a dead connection the next,
on a fresh one, still finds the leases alive."""
KEEPALIVES_IDLE = 30
"""Seconds a connection is idle before TCP keepalive probes it (``keepalives_idle=`` wins;
``keepalives=0`` turns them off)."""
MAX_KEEPALIVES_IDLE = 32767
"""The longest idle time the kernel takes (Linux's ``TCP_KEEPIDLE``)."""

_OURS = (
    "schema",
    "pool_min",
    "pool_max",
    "connect_timeout",
    "idle_in_transaction_timeout",
    "command_timeout",
    "renew_timeout",
    "keepalives",
    "keepalives_idle",
)
_DRIVERS = (
    "sslmode",
    "sslrootcert",
    "sslcert",
    "sslkey",
    "sslpassword",
    "sslcrl",
    "application_name",
    "target_session_attrs",
    "passfile",
    "host",
    "port",
    "user",
    "password",
    "dbname",
)
"""libpq connection options the driver reads from the URL's query, passed on as written."""
_IDENTIFIER = re.compile(r"[a-z_][a-z0-9_]{0,62}")
_SYSTEM_SCHEMA = "information_schema"
"""A schema of the server's own, besides the ``pg_…`` ones."""
_WHAT = "postgres store URL"


@dataclass(frozen=True, slots=True)
class Location:
    """Where a PostgreSQL store lives: the driver's URL, the schema, the pool's bounds,
    timeouts and keepalive (``keepalives_idle`` 0: off)."""

    dsn: str
    schema: str = DEFAULT_SCHEMA
    pool_min: int = POOL_MIN
    pool_max: int = POOL_MAX
    connect_timeout: float = CONNECT_TIMEOUT
    idle_in_transaction_timeout: float = IDLE_IN_TRANSACTION_TIMEOUT
    command_timeout: float = COMMAND_TIMEOUT
    renew_timeout: float = RENEW_TIMEOUT
    keepalives_idle: int = KEEPALIVES_IDLE


def parse_url(url: str) -> Location:
    """Read ``postgresql://[user[:password]@]host[:port]/database[?options]``.

    :raises StoreError: the URL is malformed, names an unknown option, or gives
        an option a value it cannot have.
    """
    parts = urls.split(url, _WHAT)
    urls.port(parts, _WHAT)
    try:
        pairs = parse_qsl(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query))
    except ValueError:  # its words quote the field
        raise StoreError(
            f"{_WHAT} {redact(url)!r}: every option must be name=value, joined by &"
        ) from None
    try:
        return _location(parts, pairs)
    except ValueError as error:
        raise StoreError(f"{_WHAT} {redact(url)!r}: {error}") from None


def _location(parts: SplitResult, pairs: list[tuple[str, str]]) -> Location:
    if parts.scheme not in SCHEMES:
        raise ValueError("the scheme must be postgresql or postgres")
    ours = {name: value for name, value in pairs if name in _OURS}
    unknown = [name for name, _ in pairs if name not in _OURS and name not in _DRIVERS]
    if unknown:
        known = ", ".join((*_OURS, *_DRIVERS))
        raise ValueError(f"unknown option {unknown[0]!r} (known: {known})")
    passed = urlencode([(name, value) for name, value in pairs if name not in _OURS])
    dsn = urlunsplit(parts._replace(scheme="postgresql", netloc=_netloc(parts), query=passed))
    pool_min = _count(ours, "pool_min", POOL_MIN, least=0)
    pool_max = _count(ours, "pool_max", POOL_MAX, least=1)
    if pool_min > pool_max:
        raise ValueError(f"pool_min ({pool_min}) must not exceed pool_max ({pool_max})")
    return Location(
        dsn,
        _schema(ours),
        pool_min,
        pool_max,
        _seconds(ours, "connect_timeout", CONNECT_TIMEOUT),
        _idle_timeout(ours),
        _seconds(ours, "command_timeout", COMMAND_TIMEOUT),
        _seconds(ours, "renew_timeout", RENEW_TIMEOUT),
        _keepalives(ours),
    )


def _netloc(parts: SplitResult) -> str:
    """The address, with any ``@`` in its user and password percent-encoded."""
    userinfo, at, host = parts.netloc.rpartition("@")
    return f"{userinfo.replace('@', '%40')}{at}{host}"


def _schema(options: dict[str, str]) -> str:
    schema = options.get("schema", DEFAULT_SCHEMA)
    if not _IDENTIFIER.fullmatch(schema) or schema.startswith("pg_"):
        raise ValueError(
            "schema must be a lower-case SQL name (letters, digits, _; at most 63; not "
            f"starting with the reserved pg_), not {schema!r}"
        )
    if schema == _SYSTEM_SCHEMA:
        raise ValueError(f"schema must not be the server's own {_SYSTEM_SCHEMA}")
    return schema


def _count(options: dict[str, str], name: str, default: int, *, least: int) -> int:
    text = options.get(name, str(default))
    value = int(text) if text.isascii() and text.isdigit() and len(text) < 10 else -1
    if not least <= value <= MAX_POOL:
        shown = text if len(text) <= 20 else f"{text[:20]}…"
        raise ValueError(f"{name} must be a whole number from {least} to {MAX_POOL}, not {shown!r}")
    return value


def _seconds(options: dict[str, str], name: str, default: float) -> float:
    text = options.get(name, str(default))
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < math.inf:  # also NaN
        raise ValueError(f"{name} must be a positive, finite number of seconds, not {text!r}")
    return value


def _idle_timeout(options: dict[str, str]) -> float:
    """``idle_in_transaction_timeout``: long enough for a loaded client's next statement, and
    within what the server's setting can hold (milliseconds in a 32-bit integer)."""
    name = "idle_in_transaction_timeout"
    value = _seconds(options, name, IDLE_IN_TRANSACTION_TIMEOUT)
    if not MIN_IDLE_IN_TRANSACTION_TIMEOUT <= value <= MAX_IDLE_IN_TRANSACTION_TIMEOUT:
        raise ValueError(
            f"{name} must be from {MIN_IDLE_IN_TRANSACTION_TIMEOUT:g} to "
            f"{MAX_IDLE_IN_TRANSACTION_TIMEOUT:.0f} seconds, not {options[name]!r}"
        )
    return value


def _keepalives(options: dict[str, str]) -> int:
    """Seconds of silence before keepalive probes (``keepalives_idle``), or 0 for none
    (``keepalives=0``), as libpq reads the two options."""
    flag = options.get("keepalives", "1")
    if flag not in ("0", "1"):
        raise ValueError(f"keepalives must be 1 (on) or 0 (off), not {flag!r}")
    text = options.get("keepalives_idle", str(KEEPALIVES_IDLE))
    idle = int(text) if text.isascii() and text.isdigit() and len(text) < 10 else 0
    if not 1 <= idle <= MAX_KEEPALIVES_IDLE:
        shown = text if len(text) <= 20 else f"{text[:20]}…"
        raise ValueError(
            f"keepalives_idle must be a whole number of seconds from 1 to "
            f"{MAX_KEEPALIVES_IDLE}, not {shown!r}"
        )
    return idle if flag == "1" else 0


def redact(url: str) -> str:
    """``url`` with its passwords (if any) replaced by ``***``, fit for messages and logs."""
    return re.sub(r"([?&]password=)[^&#]*", r"\1***", urls.mask_userinfo(url))
