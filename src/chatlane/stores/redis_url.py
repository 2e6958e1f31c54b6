"""``redis://`` and ``rediss://`` URLs: what they may say, and the :class:`Endpoint` they name.

What stays true:

* Every part of a URL is either understood or refused with a
  :class:`~chatlane.errors.StoreError` naming it — a misspelt option never
  silently falls back to a default.
* Passwords never appear in an error message or a log line (:func:`redact`); a URL
  that cannot be split safely (see :mod:`chatlane.stores.urls`) is refused without
  being shown.
"""

from __future__ import annotations

import re
import ssl
from urllib.parse import parse_qsl, unquote

from chatlane.errors import StoreError
from chatlane.stores import urls
from chatlane.stores.redis_keys import DEFAULT_PREFIX
from chatlane.stores.resp import Endpoint

CLIENT_NAME = "chatlane"
"""What ``CLIENT LIST`` shows for the store's connection (``client_name=`` in the URL wins)."""
CONNECT_TIMEOUT = 2.0
"""Seconds to open a connection (``socket_connect_timeout=`` in the URL wins)."""
REPLY_TIMEOUT = 5.0
"""Seconds a connection that owes replies may stay silent (``socket_timeout=`` wins)."""

_CERT_REQS = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL, "required": ssl.CERT_REQUIRED}
_TLS_OPTIONS = (
    "ssl_cert_reqs",
    "ssl_ca_certs",
    "ssl_certfile",
    "ssl_keyfile",
    "ssl_check_hostname",
)
KEEPALIVE = 30.0
"""Seconds a connection is idle before TCP keepalive probes it (``socket_keepalive=false``: off)."""
HEALTH_CHECK = 15.0
"""Seconds a connection is idle before it sends a ``PING`` (``health_check_interval=``, 0: off)."""
WAIT_TIMEOUT = 1.0
"""Seconds a write waits for ``wait_replicas`` replicas (``wait_timeout=`` wins)."""

_OPTIONS = (
    "prefix",
    "client_name",
    "socket_timeout",
    "socket_connect_timeout",
    "socket_keepalive",
    "health_check_interval",
    "wait_replicas",
    "wait_timeout",
    *_TLS_OPTIONS,
)


def parse_url(url: str) -> tuple[Endpoint, str]:
    """The endpoint ``url`` names and its key prefix.

    :raises StoreError: the URL is malformed, names an unknown option, or has a
        path that is not a database number.
    """
    parts = urls.split(url, "redis store URL")
    port = urls.port(parts, "redis store URL") or 6379
    try:
        options = _options(parts.query)
    except ValueError as error:
        raise StoreError(f"redis store URL {redact(url)!r}: {error}") from None
    if parts.scheme not in ("redis", "rediss"):
        raise StoreError(f"redis store URL {redact(url)!r}: the scheme must be redis or rediss")
    if not re.fullmatch(r"/?[0-9]*", parts.path):
        raise StoreError(f"redis store URL {redact(url)!r}: the path must be /<database number>")
    try:
        tls = _tls(options) if parts.scheme == "rediss" else _refuse_tls_options(options)
        endpoint = Endpoint(
            host=parts.hostname or "127.0.0.1",
            port=port,
            db=int(parts.path.strip("/") or 0),
            username=unquote(parts.username) if parts.username else None,
            password=None if parts.password is None else unquote(parts.password),
            tls=tls,
            client_name=options.get("client_name", CLIENT_NAME),
            connect_timeout=_seconds(options, "socket_connect_timeout", CONNECT_TIMEOUT),
            reply_timeout=_seconds(options, "socket_timeout", REPLY_TIMEOUT),
            keepalive=_keepalive(options),
            health_check=_seconds(options, "health_check_interval", HEALTH_CHECK, zero=True),
            wait_replicas=_count(options, "wait_replicas"),
            wait_timeout=_seconds(options, "wait_timeout", WAIT_TIMEOUT),
        )
    except (ValueError, OSError, ssl.SSLError) as error:
        raise StoreError(f"redis store URL {redact(url)!r}: {error}") from None
    return endpoint, options.get("prefix", DEFAULT_PREFIX)


def redact(url: str) -> str:
    """``url`` with its passwords (if any) replaced by ``***``, fit for messages and logs."""
    return re.sub(r"(sentinel_password=)[^&#]*", r"\1***", urls.mask_userinfo(url))


def refusal(reason: str) -> str:
    """What a server that answered a store's first commands with the error ``reason``
    refused, in its words and, for the URL's password or database, what to change."""
    code = reason.split(" ", 1)[0]
    if code == "NOAUTH":
        return (
            f"the server needs a password ({reason}): give it in the URL, "
            "redis://:<password>@host:port/db"
        )
    if code == "WRONGPASS":
        return f"the server refused the user name or password ({reason})"
    if "DB index is out of range" in reason:
        return f"the server has no database of that number ({reason})"
    return f"the server refused to open the store ({reason})"


def _options(query: str) -> dict[str, str]:
    options: dict[str, str] = {}
    for name, value in parse_qsl(query, keep_blank_values=True):
        if name not in _OPTIONS:
            raise ValueError(f"unknown option {name!r} (known: {', '.join(_OPTIONS)})")
        options[name] = value
    return options


def _seconds(options: dict[str, str], name: str, default: float, *, zero: bool = False) -> float:
    """The option ``name`` in seconds; positive, or 0 (off) where ``zero`` allows it."""
    if name not in options:
        return default
    try:
        value = float(options[name])
    except ValueError:
        value = -1.0
    if value == 0 and zero:
        return value
    if not 0 < value < float("inf"):  # also NaN
        least = "a number of seconds (0: off)" if zero else "a positive number of seconds"
        raise ValueError(f"{name} must be {least}, not {options[name]!r}")
    return value


def _count(options: dict[str, str], name: str) -> int:
    text = options.get(name, "0")
    if not (text.isascii() and text.isdigit()) or len(text) > 2 or int(text) > 64:
        raise ValueError(f"{name} must be a whole number from 0 to 64, not {text!r}")
    return int(text)


def _keepalive(options: dict[str, str]) -> float:
    return KEEPALIVE if _flag(options.get("socket_keepalive", "true"), "socket_keepalive") else 0.0


def _refuse_tls_options(options: dict[str, str]) -> ssl.SSLContext | None:
    """No TLS context for a plain ``redis://`` URL, which must not carry TLS options."""
    given = [name for name in _TLS_OPTIONS if name in options]
    if given:
        raise ValueError(f"{', '.join(given)} need a rediss:// URL")
    return None


def _tls(options: dict[str, str]) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=options.get("ssl_ca_certs") or None)
    certfile = options.get("ssl_certfile")
    if certfile:
        context.load_cert_chain(certfile, options.get("ssl_keyfile") or None)
    check = _flag(options.get("ssl_check_hostname", "true"), "ssl_check_hostname")
    reqs = options.get("ssl_cert_reqs", "required").lower()
    if reqs not in _CERT_REQS:
        raise ValueError(f"ssl_cert_reqs must be one of {', '.join(_CERT_REQS)}")
    context.check_hostname = check and reqs != "none"
    context.verify_mode = _CERT_REQS[reqs]
    return context


def _flag(text: str, name: str) -> bool:
    value = text.lower()
    if value in ("true", "1", "yes"):
        return True
    if value in ("false", "0", "no"):
        return False
    raise ValueError(f"{name} must be true or false")


__all__ = ["CLIENT_NAME", "parse_url", "redact", "refusal"]
