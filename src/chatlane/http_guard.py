"""Connection limits under the ASGI app: a deadline for request headers, a cap on connections.

What stays true:

* A client has ``header_timeout`` seconds to send a request's headers: from
  connecting, and from the first byte of each later request on a kept-alive
  connection. A WebSocket handshake is an HTTP request, so it is bound too.
  A client that is late is disconnected.
* An idle kept-alive connection is closed after ``server.keep_alive`` seconds
  (uvicorn's ``timeout_keep_alive``); the header deadline never shortens it.
* At most ``max_connections`` connections (HTTP and WebSocket together) are
  open: one more is answered ``503`` at once, without reading its request, and
  closed — after at most :data:`LINGER` seconds for the first
  :data:`MAX_LINGERING` of them, at once beyond — so held sockets can never
  use up the process's file descriptors.

Why a protocol class: uvicorn's h11 protocol waits for headers forever once a
byte arrived (the first byte of a request cancels the keep-alive timer), and
an ASGI middleware only runs once the headers are complete, which is too late.
The protocol is the one place that sees bytes arrive, the request start and
the WebSocket upgrade, for every connection; a socket-level wrapper would have
to parse HTTP a second time. The class overrides uvicorn's public
``asyncio.Protocol`` methods and the two hooks where a request begins and ends,
and keeps uvicorn's parser, flow control and shutdown.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import ClassVar

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("chatlane.server")

OVER_CAPACITY = (
    b"HTTP/1.1 503 Service Unavailable\r\n"
    b"content-type: text/plain; charset=utf-8\r\n"
    b"content-length: 37\r\n"
    b"retry-after: 5\r\n"
    b"connection: close\r\n\r\n"
    b"too many connections: try again later\n"
)
LINGER = 1.0
"""Seconds a refused connection is kept half-closed, reading and dropping what the client
still sends, so closing it does not reset the connection before the 503 is read."""
MAX_LINGERING = 32
"""Refused connections lingering at once; more are closed at once (a client may then see
a reset instead of the 503), so a flood cannot hold more files than the cap plus these."""
WARN_EVERY = 60.0
"""Seconds between two warnings that connections were refused (one per flood, not per socket)."""


@dataclass(frozen=True)
class ConnectionLimits:
    """How long headers may take, and how many connections may be open at once."""

    header_timeout: float = 10.0
    max_connections: int = 1000


class _Refusals:
    """Refusals of one served app: when the last warning was logged, how many linger."""

    warned: float = -WARN_EVERY
    lingering: int = 0


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header deadline and a connection cap.

    Use :func:`guarded_protocol` to bind the limits; uvicorn builds one
    instance per connection.
    """

    limits: ClassVar[ConnectionLimits] = ConnectionLimits()
    refusals: ClassVar[type[_Refusals]] = _Refusals
    _deadline: asyncio.TimerHandle | None = None
    _armed_for: object = None
    _refused = False
    _lingering = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            self._refuse()
            return
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # a refused request is dropped unread
        starts = self._deadline is None and self._between_requests()
        before = self.cycle
        super().data_received(data)
        if starts and self.cycle is before:
            self._arm()  # a request's first bytes came, but not all its headers
        self._settle()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._settle()

    def handle_websocket_upgrade(self, event: h11.Request) -> None:
        self._disarm()  # the handshake's headers are complete; the socket is handed over
        super().handle_websocket_upgrade(event)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._lingering:
            self._lingering = False
            self.refusals.lingering -= 1
        super().connection_lost(exc)

    def _between_requests(self) -> bool:
        """No request is being read or answered (a fresh or kept-alive connection)."""
        return self.cycle is None or self.cycle.response_complete

    def _arm(self) -> None:
        """Start the clock for the next request's headers."""
        self._armed_for = self.cycle
        self._deadline = self.loop.call_later(self.limits.header_timeout, self._late)

    def _settle(self) -> None:
        """Stop the clock once a new request's headers were read (a new cycle began)."""
        if self._deadline is not None and self.cycle is not self._armed_for:
            self._disarm()

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _late(self) -> None:
        """The headers did not arrive in time (or a refusal lingered long enough): disconnect."""
        self._deadline = None
        if not self.transport.is_closing():
            log.debug("headers not complete within %ss; closing", self.limits.header_timeout)
            self.transport.close()

    def _refuse(self) -> None:
        """Answer 503 without reading the request; close when the client does, or soon after."""
        self._refused = True
        self._warn()
        self.transport.write(OVER_CAPACITY)
        if self.refusals.lingering >= MAX_LINGERING or not self.transport.can_write_eof():
            self.transport.close()
            return
        self._lingering = True
        self.refusals.lingering += 1
        self.transport.write_eof()
        self._deadline = self.loop.call_later(LINGER, self._late)

    def _warn(self) -> None:
        """Log that connections are refused, at most once every :data:`WARN_EVERY` seconds."""
        now = self.loop.time()
        if now - self.refusals.warned >= WARN_EVERY:
            self.refusals.warned = now
            log.warning(
                "%d connections open: refusing more (server.max_connections)",
                self.limits.max_connections,
            )


def guarded_protocol(limits: ConnectionLimits) -> type[GuardedH11Protocol]:
    """A protocol class for ``uvicorn.Config(http=…)`` that enforces ``limits``."""

    class Refusals(_Refusals):
        pass

    class Guarded(GuardedH11Protocol):
        pass

    Guarded.limits = limits
    Guarded.refusals = Refusals
    return Guarded
