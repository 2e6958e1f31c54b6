"""Redis with Sentinel: find the primary by asking the sentinels, and follow it through failovers.

A ``redis+sentinel://`` URL names sentinels and a primary's name instead of a
server: ``redis+sentinel://[[user]:password@]host[:port][,host[:port]…]/<name>[/<db>]``
(port 26379 by default), with ``sentinel_username=`` and ``sentinel_password=``
for sentinels that need their own credentials and every option a
``redis://`` URL takes. What stays true:

* Every new connection first asks the sentinels, in turn, where the primary
  named ``<name>`` is (``SENTINEL get-master-addr-by-name``); the first that
  answers is asked first next time. The connection then checks with ``ROLE``
  that the server it reached is a primary, so a stale answer during a
  failover is a failed connection (tried again), never writes to a replica.
* A failover reaches the store as a dropped connection or a ``-READONLY``
  reply (:mod:`chatlane.stores.resp` drops the connection for it); the next
  connection asks the sentinels again and reaches the promoted replica.
* Credentials are the data nodes' (``user:password@``) and the sentinels'
  own (the query options); neither appears in a message.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from urllib.parse import parse_qsl, unquote, urlencode

from chatlane.errors import StoreError
from chatlane.stores import urls
from chatlane.stores.redis_url import redact
from chatlane.stores.resp import Endpoint, ReplyError, RespClient

SCHEME = "redis+sentinel"
SENTINEL_PORT = 26379
_SENTINEL_OPTIONS = ("sentinel_username", "sentinel_password")


@dataclass(frozen=True, slots=True)
class SentinelUrl:
    """What a ``redis+sentinel://`` URL names: the sentinels, the primary's name, the rest."""

    sentinels: tuple[tuple[str, int], ...]
    primary: str
    redis_url: str
    """An equivalent ``redis://`` URL for the data nodes (its host a placeholder)."""
    username: str | None = None
    password: str | None = None


def parse_sentinel_url(url: str) -> SentinelUrl:
    """:raises StoreError: naming what is wrong (passwords never shown)."""
    urls.split(url, "sentinel store URL")
    shown = redact(url)
    rest = url.removeprefix(f"{SCHEME}://")
    if rest == url:
        raise StoreError(f"sentinel store URL {shown!r}: the scheme must be {SCHEME}")
    location, _, query = rest.partition("?")
    netloc, _, path = location.partition("/")
    credentials, at, hosts = netloc.rpartition("@")
    name, _, db = path.partition("/")
    if not name:
        raise StoreError(f"sentinel store URL {shown!r}: name the primary: …/<name>[/<db>]")
    try:
        sentinels = tuple(_address(n, host) for n, host in enumerate(hosts.split(","), 1))
    except ValueError as error:
        raise StoreError(f"sentinel store URL {shown!r}: {error}") from None
    options = dict(parse_qsl(query, keep_blank_values=True))
    username, password = (options.pop(o, None) for o in _SENTINEL_OPTIONS)
    redis_url = f"redis://{credentials}{at}sentinel-primary/{db or 0}"
    if options:
        redis_url += "?" + urlencode(options)
    return SentinelUrl(sentinels, unquote(name), redis_url, username, password)


def _address(number: int, host: str) -> tuple[str, int]:
    """The ``number``-th sentinel's host and port; the error does not quote it (a password
    with an unencoded ``?`` would put its start there)."""
    name, colon, port = host.rpartition(":")
    if not colon:
        name, port = host, str(SENTINEL_PORT)
    numeric = port.isascii() and port.isdigit() and len(port) <= 5
    if not name or not numeric or not 0 < int(port) < 65536:
        raise ValueError(f"sentinel {number} is not host[:port] (a port from 1 to 65535)")
    return name, int(port)


class Sentinels:
    """Where the primary named ``primary`` is now, as the sentinels say (module docstring)."""

    def __init__(self, parsed: SentinelUrl, template: Endpoint) -> None:
        """``template``: the timeouts to ask the sentinels with."""
        self._addresses = list(parsed.sentinels)
        self.primary = parsed.primary
        self._asking = replace(
            template,
            username=parsed.username,
            password=parsed.password,
            db=0,
            client_name="",
            tls=None,
            keepalive=0.0,
            health_check=0.0,
        )

    async def locate(self) -> tuple[str, int]:
        """The primary's host and port.

        :raises ConnectionError: no sentinel could be reached or named it.
        """
        failures: list[str] = []
        for index, (host, port) in enumerate(list(self._addresses)):
            try:
                reply = await self._ask(host, port)
            except (ConnectionError, TimeoutError, OSError, ReplyError) as error:
                failures.append(f"{host}:{port}: {error}")
                continue
            if not reply:
                failures.append(f"{host}:{port} knows no primary named {self.primary!r}")
                continue
            self._addresses.insert(0, self._addresses.pop(index))  # ask it first next time
            return reply[0].decode(), int(reply[1])
        raise ConnectionError(f"no sentinel named primary {self.primary!r}: {'; '.join(failures)}")

    async def _ask(self, host: str, port: int) -> list[bytes] | None:
        client = RespClient(replace(self._asking, host=host, port=port), retries=0)
        try:
            reply: list[bytes] | None = await client.execute(
                "SENTINEL", "get-master-addr-by-name", self.primary
            )
            return reply
        finally:
            await client.close()


__all__ = ["SCHEME", "SENTINEL_PORT", "SentinelUrl", "Sentinels", "parse_sentinel_url"]
