"""Which model endpoints a chat user may choose with ``/model <name> --base-url URL``.

What stays true:

* The operator's configured ``base_url`` is always allowed. Any other URL must
  fall under an entry of ``allowed_base_urls``: the same scheme, host and port,
  and a path equal to the entry's or below it (``/v1`` covers ``/v1/x``, not
  ``/v10``). With no entries, chat users choose no endpoint.
* A URL with userinfo, a query, a fragment, percent escapes or ``.``/``..``
  path segments is refused whatever the entries say; one that carries
  something shaped like a credential is refused as a credential.
* A host given by name must resolve only to public addresses (not loopback,
  link-local, private, shared or reserved ones), unless its entry names the
  host by address or as ``localhost``: the operator allows a private endpoint
  by writing it so.
* A refusal never repeats the URL and says the same whatever the reason, so it
  reveals nothing about the network behind the gateway.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from chatlane.errors import ChatlaneError
from chatlane.redaction import CREDENTIALS_REFUSED, looks_like_credential

NOT_ALLOWED = (
    "That endpoint is not allowed. Chat users may only choose the endpoints the "
    "operator lists (agent.openai.allowed_base_urls)."
)
"""The one reply to every refused endpoint, whatever the reason."""

Resolver = Callable[[str, int], Awaitable[Sequence[str]]]
"""``(host, port)`` → the addresses a connection to it may reach."""

_PORTS = {"http": 80, "https": 443}
_LOCAL_NAMES = frozenset({"localhost"})


class EndpointRefused(ChatlaneError, ValueError):
    """A chat-chosen endpoint the policy refuses; its text repeats nothing of the URL."""


async def system_resolver(host: str, port: int) -> Sequence[str]:
    """The addresses the system resolver gives for ``host``."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


def normal(url: str) -> str:
    """``url`` without surrounding blanks or trailing ``/`` (which name the same endpoint)."""
    return url.strip().rstrip("/")


@dataclass(frozen=True, slots=True)
class Prefix:
    """An endpoint URL taken apart: scheme, lower-cased host, port, and path (no trailing ``/``)."""

    scheme: str
    host: str
    port: int
    path: str

    @classmethod
    def parse(cls, url: str) -> Prefix:
        """:raises EndpointRefused: unless ``url`` is a plain http(s) URL (see the module)."""
        if looks_like_credential(url):
            raise EndpointRefused(CREDENTIALS_REFUSED)
        if not url.isprintable() or any(c in url for c in " \\?#%@"):
            raise EndpointRefused(NOT_ALLOWED)
        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError:
            raise EndpointRefused(NOT_ALLOWED) from None
        scheme, host = parts.scheme.lower(), (parts.hostname or "")
        path = parts.path.rstrip("/")
        if scheme not in _PORTS or not host or {".", ".."} & set(path.split("/")):
            raise EndpointRefused(NOT_ALLOWED)
        return cls(scheme, host.lower(), port or _PORTS[scheme], path)

    def covers(self, other: Prefix) -> bool:
        """Whether ``other`` is this endpoint or lies below its path."""
        same_origin = (self.scheme, self.host, self.port) == (other.scheme, other.host, other.port)
        below = other.path == self.path or other.path.startswith(self.path + "/")
        return same_origin and below

    @property
    def names_address(self) -> bool:
        """Whether the host is written as an address or ``localhost`` (not a name to resolve)."""
        return self.host in _LOCAL_NAMES or _address(self.host) is not None


@dataclass(frozen=True)
class EndpointPolicy:
    """The endpoints chat users may choose (see the module docstring); build it with :meth:`of`.

    :param configured: the operator's ``base_url`` (normalized), always allowed.
    :param allowed: the parsed ``allowed_base_urls``.
    :param resolve: how host names are resolved (the system resolver by default).
    """

    configured: str
    allowed: tuple[Prefix, ...] = ()
    resolve: Resolver = system_resolver

    @classmethod
    def of(
        cls, configured: str, allowed: Sequence[str] = (), resolve: Resolver = system_resolver
    ) -> EndpointPolicy:
        """The policy for ``configured`` and the URLs in ``allowed``.

        :raises EndpointRefused: for an entry that is not a plain http(s) URL.
        """
        return cls(normal(configured), tuple(Prefix.parse(normal(u)) for u in allowed), resolve)

    async def check(self, url: str) -> str:
        """``url`` normalized, if a chat user may choose it.

        :raises EndpointRefused: with :data:`NOT_ALLOWED` or, for a credential,
            :data:`~chatlane.redaction.CREDENTIALS_REFUSED`.
        """
        wanted = normal(url)
        if wanted == self.configured:
            return wanted
        target = Prefix.parse(wanted)
        entry = next((p for p in self.allowed if p.covers(target)), None)
        if entry is None:
            raise EndpointRefused(NOT_ALLOWED)
        if not entry.names_address:
            await self._require_public(target)
        return wanted

    async def _require_public(self, target: Prefix) -> None:
        """:raises EndpointRefused: unless every address ``target``'s host has is public."""
        try:
            found = await self.resolve(target.host, target.port)
        except OSError:
            raise EndpointRefused(NOT_ALLOWED) from None
        addresses = [_address(a) for a in found]
        if not addresses or not all(a is not None and a.is_global for a in addresses):
            raise EndpointRefused(NOT_ALLOWED)


def _address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """``text`` as an address (an IPv4-mapped IPv6 one as IPv4), or ``None`` for a name."""
    try:
        address = ipaddress.ip_address(text.strip("[]").partition("%")[0])
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def endpoint_policy(agent: object) -> EndpointPolicy | None:
    """The policy ``agent`` applies to chat-chosen endpoints, or ``None`` if it takes none."""
    policy = getattr(agent, "endpoints", None)
    return policy if isinstance(policy, EndpointPolicy) else None


__all__ = [
    "NOT_ALLOWED",
    "EndpointPolicy",
    "EndpointRefused",
    "Prefix",
    "endpoint_policy",
    "normal",
    "system_resolver",
]
