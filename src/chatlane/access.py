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
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Mapping

from chatlane.errors import ConfigError
from chatlane.secrets import TokenSource

log = logging.getLogger("chatlane.access")


class AccessToken:
    """The gateway's access token (or the absence of one), shared by every route.

    :param source: the token as read at start (:func:`~chatlane.secrets.resolve_secrets`),
        and where :meth:`reload` reads it again.
    """

    def __init__(self, source: TokenSource) -> None:
        self._source = source
        self._value = source.value.encode()
        self._required = bool(self._value)

    @property
    def required(self) -> bool:
        """Whether requests must present the token (never ``False`` again once ``True``)."""
        return self._required

    def matches(self, given: bytes) -> bool:
        """Whether ``given`` is the token; always ``False`` while no usable token is loaded."""
        return bool(self._value) and hmac.compare_digest(given, self._value)

    def admits_bearer(self, headers: Mapping[str, str]) -> bool:
        """No token is required, or ``Authorization: Bearer <token>`` carries it."""
        return self.admits_authorization(headers.get("authorization", ""))

    def admits_authorization(self, authorization: str) -> bool:
        """:meth:`admits_bearer` for the ``Authorization`` header's value (``""`` if absent),
        as Starlette hands it over (decoded as Latin-1)."""
        if not self._required:
            return True
        scheme, _, given = authorization.partition(" ")
        # headers arrive decoded as Latin-1: recover the bytes the client sent (UTF-8 tokens work)
        sent = given.strip().encode("latin-1", errors="replace")
        return scheme.lower() == "bearer" and self.matches(sent)

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
