"""How the Redis store reaches its server: chatlane's own client, or a redis-py client of yours.

The store needs one thing of a transport: run one command, return its reply
as RESP types (bytes, int, ``None``, lists of those), raise
:class:`~chatlane.stores.resp.ReplyError` for an error reply and
``ConnectionError`` when the server could not be reached. What stays true:

* :class:`~chatlane.stores.resp.RespClient` (what a ``redis://`` URL opens)
  is the fast path: one pipelined connection, retries of its own.
* :class:`RedisPyTransport` carries a configured ``redis.asyncio.Redis``
  (rotating credentials, TLS or Sentinel set up your way) over its own
  connection pool: its error replies keep the code the server sent
  (``NOSCRIPT …``), its connection failures and not-ready replies are
  ``ConnectionError``, and its retry settings are left as you made them.
  Replies are handed over as the server sent them (redis-py's reply parsing
  is not applied), in RESP2's shapes: a RESP3 map is its key/value list, a
  set a list, a boolean 1 or 0, text bytes (numbers stay numbers). A client
  made with ``decode_responses=True`` is refused: the store reads bytes.
* Closing the store closes a transport it opened; a client you handed in is
  yours, and left open (unless you hand it over with ``close_client=True``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from chatlane.errors import ConfigError
from chatlane.stores.resp import Arg, ReplyError, ServerNotReady, not_ready

if TYPE_CHECKING:
    import redis.asyncio


class Transport(Protocol):
    """What the Redis store needs of a client (see the module docstring)."""

    async def execute(self, *args: Arg) -> Any:
        """Run one command; its reply.

        :raises ReplyError: the server answered with an error.
        :raises ConnectionError: the server could not be reached (or cannot serve now).
        """

    async def close(self) -> None:
        """Let go of the connection (nothing, for a client the caller owns)."""


class RedisPyTransport:
    """A ``redis.asyncio.Redis`` client as the store's transport (left open at close)."""

    def __init__(self, client: redis.asyncio.Redis, *, owned: bool = False) -> None:
        """``owned``: closing the transport closes ``client`` too.

        :raises ConfigError: the client decodes replies to text.
        """
        import redis.asyncio as aioredis

        pool = client.connection_pool
        kwargs = pool.connection_kwargs
        if kwargs.get("decode_responses"):
            raise ConfigError(
                "the Redis store needs replies as bytes: "
                "make the redis-py client without decode_responses=True"
            )
        self.client = aioredis.Redis(connection_pool=pool)
        """A client of the same pool (its credentials, TLS, Sentinel and retries) that leaves
        replies as the server sent them: none of redis-py's reply parsing (``HGETALL`` as a
        dict, ``ZSCORE`` as a float) applies, so both transports hand over the same types."""
        self.client.response_callbacks.clear()
        self._owned = client if owned else None

    async def execute(self, *args: Arg) -> Any:
        import redis.exceptions as errors

        try:
            reply = await self.client.execute_command(*args)  # type: ignore[no-untyped-call]
        except (
            errors.BusyLoadingError,
            errors.ReadOnlyError,
            errors.MasterDownError,
            errors.TryAgainError,
        ) as error:
            raise ServerNotReady(f"the server cannot serve now: {error}") from error
        except errors.NoScriptError as error:
            raise ReplyError(f"NOSCRIPT {error}") from error
        except errors.ResponseError as error:
            reply = ReplyError(str(error))
            if not_ready(reply):  # BUSY, which redis-py leaves a plain ResponseError
                raise ServerNotReady(f"the server cannot serve now: {error}") from error
            raise reply from error
        except (errors.ConnectionError, errors.TimeoutError) as error:
            raise ConnectionError(str(error) or type(error).__name__) from error
        return as_resp2(reply)

    async def close(self) -> None:
        if self._owned is not None:
            await self._owned.aclose()

    def describe(self, prefix: str) -> str:
        """The server this client reaches, as a URL without credentials (for names and logs)."""
        kwargs = self.client.connection_pool.connection_kwargs
        host, port, db = kwargs.get("host", "?"), kwargs.get("port", 6379), kwargs.get("db", 0)
        return f"redis://{host}:{port}/{db}?prefix={prefix}"


def as_resp2(reply: Any) -> Any:
    """``reply`` in the shapes RESP2 gives it (see the module docstring)."""
    if isinstance(reply, list | tuple):
        return [as_resp2(item) for item in reply]
    if isinstance(reply, dict):
        return [as_resp2(part) for pair in reply.items() for part in pair]
    if isinstance(reply, set | frozenset):
        return [as_resp2(item) for item in reply]
    if isinstance(reply, bool):
        return int(reply)
    if isinstance(reply, str):
        return reply.encode()
    return reply


__all__ = ["RedisPyTransport", "Transport", "as_resp2"]
