"""The access token: read once at start, swapped only by an explicit reload.

What stays true:

* The token is read when the gateway starts and kept in memory: no request
  rereads its file, so changing, emptying or deleting the file changes nothing
  until the operator asks for a reload (``chatlane serve`` reloads on SIGHUP).
* One :class:`AccessToken` serves every route of a gateway (admin, metrics,
  the API, the web chat), so a reload changes the token for all of them at once.
* Edges fail closed: once a gateway has a token, a reload that finds the
  secret empty or unreadable refuses every request until a reload finds a
  token again. It never falls back to "no token, no check".
* Comparisons are constant-time, on the bytes the client sent.
* Wrong tokens are limited per client address (:class:`GuessLimiter`), alike
  on every route that takes a token: a bearer token on the admin routes,
  ``/metrics``, the API and the web chat, and the web sign-in form share one
  count. A token is counted as wrong from the moment it arrives, before it is
  judged, and uncounted once it proved right, so requests that arrive
  together are counted together: one address has at most :data:`GUESSES`
  different wrong tokens judged within :data:`GUESS_WINDOW` seconds, however
  many it sends at once. The same wrong token sent again counts once (a tab
  or script still holding the old token does not block its address); wrong
  tokens are remembered only as HMACs under a key of the process's own.
  While it is blocked, no token of its is judged, the right one included
  (answer 429 with ``Retry-After``). Only a token is counted: an
  ``Authorization`` header of another scheme than ``Bearer`` (the ``Basic``
  credentials a proxy's own password check forwards), an empty bearer token
  and a sign-in that posts no token present none (:func:`bearer_token`); and
  while no usable token is loaded (a reload locked the gateway) nothing is
  counted, as there is nothing to guess.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import math
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from chatlane.errors import ChatlaneError, ConfigError
from chatlane.secrets import TokenSource

if TYPE_CHECKING:
    from starlette.requests import HTTPConnection

log = logging.getLogger("chatlane.access")

GUESSES = 5
"""Wrong tokens one client address may present within :data:`GUESS_WINDOW` seconds."""
GUESS_WINDOW = 60.0

T = TypeVar("T")


def client_address(connection: HTTPConnection) -> str:
    """The address wrong tokens are counted under: the IP address the request came from,
    an IPv6 one as its ``/64`` (:func:`counted_address`).

    That is the peer's address, or, when the peer is a proxy uvicorn trusts
    (``forwarded_allow_ips``: ``127.0.0.1`` and ``::1`` unless the environment
    sets ``FORWARDED_ALLOW_IPS``), the nearest address its ``X-Forwarded-For``
    names that is not itself trusted: clients behind a trusted proxy are counted
    apart, and none can choose its address by sending the header itself. ``""``
    when the server knows no address (all such requests share one count).
    """
    return counted_address(connection.client.host) if connection.client is not None else ""


NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
"""The well-known NAT64 prefix (RFC 6052): each address in it stands for the IPv4 address
in its last 32 bits, one translated IPv4 client each."""


def counted_address(host: str) -> str:
    """The address ``host``'s wrong tokens count under.

    An IPv6 address counts as the ``/64`` network holding it, the block a single
    home or host is given, so its owner cannot try five more tokens from each of its
    2⁶⁴ addresses — except the IPv6 addresses that stand for one IPv4 client each,
    which count as that IPv4 address: IPv4-mapped (``::ffff:a.b.c.d``), the
    well-known NAT64 prefix (:data:`NAT64`) and Teredo (its client's address); and
    link-local ones, whose ``/64`` is every host of every link (as they are, zone
    included). An IPv4 address, and anything else (a host name, a Unix socket's
    path), counts as it is.
    """
    if ":" not in host:
        return host
    try:
        address = ipaddress.IPv6Address(host)
    except ValueError:
        return host
    ipv4 = _ipv4_of(address)
    if ipv4 is not None:
        return str(ipv4)
    if address.is_link_local:
        return str(address)
    return str(ipaddress.IPv6Network((address, 64), strict=False))


def _ipv4_of(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 client ``address`` stands for, if it is one that does (mapped, NAT64, Teredo)."""
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address in NAT64:
        return ipaddress.IPv4Address(int(address) & 0xFFFF_FFFF)
    teredo = address.teredo
    return None if teredo is None else teredo[1]


def bearer_token(authorization: str) -> bytes | None:
    """The token an ``Authorization`` header's value (as Starlette hands it over, decoded
    as Latin-1) carries as ``Bearer <token>``, as the bytes the client sent (so UTF-8
    tokens work); ``None`` when it carries none: no header, another scheme (``Basic``),
    or an empty token. Only what this returns is a token to judge, or to count."""
    scheme, _, given = authorization.partition(" ")
    sent = given.strip().encode("latin-1", errors="replace")
    return sent if scheme.lower() == "bearer" and sent else None


class TooManyGuesses(ChatlaneError):
    """The client address presented too many wrong tokens: none of its tokens is judged
    for :attr:`retry_after` seconds."""

    def __init__(self, retry_after: float) -> None:
        self.retry_after = retry_after
        super().__init__(f"too many wrong tokens: try again in {self.seconds} s")

    @property
    def seconds(self) -> int:
        """:attr:`retry_after` in whole seconds, rounded up (a ``Retry-After`` header's value)."""
        return max(1, math.ceil(self.retry_after))


@dataclass(frozen=True, eq=False)
class Attempt:
    """A token of ``client``'s, counted as wrong since ``at`` until it is judged (each
    attempt is its own count: two at one time are two)."""

    client: str
    at: float


Counted = Attempt | bytes
"""What one count of an address stands for: an attempt not judged yet, or a wrong token
(its keyed digest, :meth:`GuessLimiter.digest`)."""


class GuessLimiter:
    """Counts the distinct wrong tokens of each client address; once ``attempts`` are
    counted within ``window`` seconds, that address may not try again until the oldest
    count is ``window`` old.

    :meth:`reserve` counts an attempt before its token is judged; :meth:`wrong` turns it
    into a count of that token, :meth:`release` uncounts it (the token was right, or none
    was presented). A token is remembered only as an HMAC of it under a random key of
    this limiter's (never the token itself), so the same wrong token sent again (a tab
    left open after a token change, a script with an old key) counts once per window,
    while every different one counts anew. Attempts in flight at once count against each
    other, so no more than ``attempts`` different wrong tokens of one address are ever
    judged within ``window`` seconds.

    At most ``max_clients`` addresses are remembered (the longest-known is forgotten
    first), each with at most ``attempts`` counts, so the table cannot grow without bound.
    """

    def __init__(
        self,
        attempts: int = GUESSES,
        window: float = GUESS_WINDOW,
        *,
        clock: Callable[[], float] = time.monotonic,
        max_clients: int = 10_000,
    ) -> None:
        self.attempts = attempts
        self.window = window
        self._clock = clock
        self._max_clients = max_clients
        self._key = secrets.token_bytes(32)
        self._counts: dict[str, dict[Counted, float]] = {}

    def retry_after(self, client: str) -> float:
        """Seconds until ``client`` may try again; ``0`` if it may now."""
        counts = self._recent(client)
        if len(counts) < self.attempts:
            return 0.0
        return min(counts.values()) + self.window - self._clock()

    def reserve(self, client: str) -> Attempt:
        """Count an attempt of ``client``'s as wrong, now, before its token is judged.

        :raises TooManyGuesses: while ``client`` may not try (nothing is counted then).
        """
        wait = self.retry_after(client)
        if wait > 0:
            raise TooManyGuesses(wait)
        attempt = Attempt(client, self._clock())
        self._table(client)[attempt] = attempt.at
        return attempt

    def wrong(self, attempt: Attempt, token: bytes) -> None:
        """``attempt`` presented ``token`` and it was wrong: it counts as that token from
        the attempt's time, or, if ``client`` was already counted for it within the window,
        not again."""
        self._table(attempt.client).setdefault(self.digest(token), attempt.at)
        self.release(attempt)

    def release(self, attempt: Attempt, token: bytes = b"") -> None:
        """Uncount ``attempt``: its ``token`` was right (no longer counted for its address
        either), or it presented none."""
        counts = self._counts.get(attempt.client)
        if counts is None:
            return
        counts.pop(attempt, None)
        if token:
            counts.pop(self.digest(token), None)
        if not counts:
            del self._counts[attempt.client]

    def judge(self, client: str, token: bytes, identify: Callable[[], T]) -> T:
        """What ``identify`` finds for ``token``, which ``client`` presented; a falsy
        finding (a wrong token) stays counted against ``client``, as that token.

        :raises TooManyGuesses: while ``client`` may not try (``identify`` is not called).
        """
        attempt = self.reserve(client)
        found = identify()
        if found:
            self.release(attempt, token)
        else:
            self.wrong(attempt, token)
        return found

    def digest(self, token: bytes) -> bytes:
        """What a wrong ``token`` is remembered as: an HMAC of it under this limiter's
        random key, which no one outside this process can match to a token."""
        return hmac.new(self._key, token, hashlib.sha256).digest()[:16]

    def _table(self, client: str) -> dict[Counted, float]:
        """``client``'s counts, made (forgetting the longest-known address if full) if none."""
        counts = self._counts.get(client)
        if counts is None:
            if len(self._counts) >= self._max_clients:
                del self._counts[next(iter(self._counts))]
            counts = self._counts[client] = {}
        return counts

    def _recent(self, client: str) -> dict[Counted, float]:
        """``client``'s counts of the last ``window`` seconds (older ones dropped)."""
        counts = self._counts.get(client, {})
        since = self._clock() - self.window
        for counted in [c for c, at in counts.items() if at <= since]:
            del counts[counted]
        if not counts:
            self._counts.pop(client, None)
        return counts


class AccessToken:
    """The gateway's access token (or the absence of one), shared by every route.

    :param source: the token as read at start (:func:`~chatlane.secrets.resolve_secrets`),
        and where :meth:`reload` reads it again.
    :param guesses: the wrong tokens counted per client address, on every route that
        takes this token (a fresh :class:`GuessLimiter` by default).
    """

    def __init__(self, source: TokenSource, guesses: GuessLimiter | None = None) -> None:
        self._source = source
        self._value = source.value.encode()
        self._required = bool(self._value)
        self.guesses = guesses or GuessLimiter()

    @property
    def required(self) -> bool:
        """Whether requests must present the token (never ``False`` again once ``True``)."""
        return self._required

    def matches(self, given: bytes) -> bool:
        """Whether ``given`` is the token; always ``False`` while no usable token is loaded."""
        return bool(self._value) and hmac.compare_digest(given, self._value)

    def check_bearer(self, headers: Mapping[str, str], client: str) -> bool:
        """No token is required, or ``Authorization: Bearer <token>`` carries it; a wrong
        token counts against the address ``client`` (:class:`GuessLimiter`).

        :raises TooManyGuesses: for a token presented while ``client`` is blocked.
        """
        return self.check_authorization(headers.get("authorization", ""), client)

    def check_authorization(self, authorization: str, client: str) -> bool:
        """:meth:`check_bearer` for the ``Authorization`` header's value (``""`` if absent),
        as Starlette hands it over (decoded as Latin-1). Only a bearer token is counted
        (:func:`bearer_token`): a header of another scheme is refused uncounted."""
        if not self._required:
            return True
        given = bearer_token(authorization)
        if given is None:
            return False  # nothing presented, nothing guessed
        attempt = self.guesses.reserve(client)
        return self.settle(attempt, given, self.matches(given))

    def settle(self, attempt: Attempt, given: bytes, right: bool) -> bool:
        """``right``, for the token ``given``; ``attempt`` stays counted, as ``given``, only
        if it was a wrong guess: a token was given, it was not right, and a token was loaded
        to guess."""
        if right or not given or not self._value:
            self.guesses.release(attempt, given)
        else:
            self.guesses.wrong(attempt, given)
        return right

    def admits_authorization(self, authorization: str) -> bool:
        """No token is required, or the ``Authorization`` header's value is ``Bearer
        <token>`` (nothing is counted: :meth:`check_authorization` counts)."""
        if not self._required:
            return True
        given = bearer_token(authorization)
        return given is not None and self.matches(given)

    def derive(self, purpose: bytes) -> bytes | None:
        """A key for ``purpose`` derived from the token; ``None`` while none is loaded.

        Keys change with the token, so whatever they sign ends with a rotation.
        """
        if not self._value:
            return None
        return hmac.new(self._value, purpose, hashlib.sha256).digest()

    def reload(self) -> None:
        """Read the secret again and use it from now on, for every route.

        A token file is read again; a token from an environment variable keeps
        its value from start. An empty or unreadable secret on a gateway that
        had a token locks it: every request is refused until a later reload
        finds a token.
        """
        try:
            value = self._source.reread().encode()
        except ConfigError as error:
            log.error("access token not reloaded, refusing all requests: %s", error)
            value = b""
        if not value and self._required:
            log.error("access token is empty: refusing all requests until it is set and reloaded")
        elif value:
            log.warning("access token reloaded")
        self._value = value
        self._required = self._required or bool(value)
