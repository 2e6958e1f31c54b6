"""Per-client identity for the API: ``[api.clients]``, each with its own token and names.

Without clients, the API trusts its callers' session names (anyone with the
access token may name any session). With them, what stays true:

* Every ``/v1`` request must carry one client's token (``Authorization:
  Bearer …``); the gateway's access token is not a client token. The token
  is compared with every client's, in constant time, with no early exit.
* A client names only sessions whose name starts with its prefix (``<client
  name>:`` unless configured); no prefix starts another's (checked at start),
  so a client can never name another client's session — it gets 403.
* The client, not the session name, is the sender: its name is the message's
  user id, so ``[allow] api = [...]`` lists client names and the ``/cron``
  cap per user counts per client.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass

from chatlane.adapters.api_wire import ApiRequestError
from chatlane.config import Config, client_prefix
from chatlane.errors import ConfigError
from chatlane.secrets import why_empty


@dataclass(frozen=True, slots=True)
class ApiClient:
    """One configured client: its name (the sender's user id) and its session-name prefix."""

    name: str
    prefix: str

    def check_session(self, session: str) -> None:
        """:raises ApiRequestError: (403) unless ``session`` is one this client may name."""
        if not session.startswith(self.prefix):
            raise ApiRequestError(
                403,
                f"client {self.name!r} may only use session names that start with {self.prefix!r}",
                "permission_error",
                "session_not_allowed",
            )


class ApiClients:
    """The configured clients, found by their token (see the module docstring)."""

    def __init__(self, tokens: Mapping[str, ApiClient]) -> None:
        self._by_digest = [(_digest(token), client) for token, client in tokens.items()]

    @classmethod
    def from_config(cls, config: Config, tokens: Mapping[str, str]) -> ApiClients:
        """Every configured client, with its token from ``tokens`` (by client name, read at
        start: :attr:`~chatlane.secrets.Secrets.api_client_tokens`).

        :raises ConfigError: for a client whose token is empty, or two clients sharing one.
        """
        clients: dict[str, ApiClient] = {}
        for name, client in config.api.clients.items():
            token = tokens.get(name, "")
            if not token:
                raise ConfigError(
                    f"configuration key 'api.clients.{name}.token': no token: "
                    f"{why_empty(client.token)}"
                )
            if token in clients:
                other = clients[token].name
                raise ConfigError(f"api clients {other!r} and {name!r} have the same token")
            clients[token] = ApiClient(name, client_prefix(name, client))
        return cls(clients)

    @property
    def enabled(self) -> bool:
        """Whether any client is configured (then every request needs a client token)."""
        return bool(self._by_digest)

    def identify(self, presented: bytes) -> ApiClient | None:
        """The client whose token is ``presented``, or ``None``."""
        given = _digest_bytes(presented)
        found = None
        for digest, client in self._by_digest:
            if hmac.compare_digest(given, digest):
                found = client
        return found


def _digest(token: str) -> bytes:
    return _digest_bytes(token.encode())


def _digest_bytes(token: bytes) -> bytes:
    return hashlib.sha256(token).digest()
