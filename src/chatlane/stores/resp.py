"""A small Redis client that pipelines on its own: one connection, one write per event-loop tick.

The Redis store's cost per turn is almost all client-side CPU per command; a
general-purpose client spends it on a connection pool, per-command locks and
one write and one wake-up per command. This client sends every command issued
during one iteration of the event loop in a single write over one connection,
and hands each reply to its caller in order (automatic pipelining, as ioredis
and Lettuce do it). Encoding and parsing are hiredis's.

What stays true:

* Replies are matched to commands in the order the commands were written; a
  caller that gave up (cancelled) still has its reply read and thrown away, so
  no later caller ever gets another's reply.
* A connection that drops, sends bytes that are not RESP, or owes replies and
  stays silent for ``reply_timeout`` is closed, and every caller waiting on it
  gets :class:`ConnectionError`. The next command opens a new connection,
  which authenticates, selects the database and sets the client name before
  anything else is sent on it.
* Writes are bounded. When the connection's send buffer passes the
  transport's high-water mark (the server reads slower than commands come),
  new commands wait until it drains below the low-water mark before they are
  queued; memory grows by at most one loop tick's commands past the mark. A
  server that stops reading altogether stops replying too, so the reply
  watchdog closes the connection and the waiting commands fail.
* A server that answers that it cannot serve commands now — ``-LOADING``
  (replaying its data after a restart), ``-READONLY`` (a replica: a failover
  moved the primary behind the same name), ``-MASTERDOWN``, ``-TRYAGAIN``,
  ``-BUSY`` (a script runs too long) — ran nothing of that command: the
  connection is dropped (:class:`ServerNotReady`, a ``ConnectionError``) and
  the command tried again on a new one, as after a lost connection.
* :meth:`RespClient.execute` retries :class:`ConnectionError` and
  :class:`TimeoutError` with jittered exponential backoff. A command may thus
  reach the server twice; callers make such commands idempotent (the store's
  scripts take request ids). Any other error reply raises :class:`ReplyError`
  and is never retried. The :class:`ConnectionError` a caller gets at the
  end says whether any try may have reached the server (:func:`maybe_sent`):
  a server that could not be reached at all ran nothing.
* A half-open connection (the server or the network went away without a
  word) is found before a command waits on it: TCP keepalive probes an idle
  connection after ``keepalive`` seconds, and a connection idle for
  ``health_check`` seconds sends a ``PING`` — unanswered within
  ``reply_timeout``, the connection is closed and the next command opens a
  new one.
"""

from __future__ import annotations

import asyncio
import random
import socket
import ssl
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import hiredis

Arg = str | bytes | int | float
"""What a command argument may be (numbers are sent in decimal)."""

RETRIES = 5
"""Attempts after the first, on ``ConnectionError`` / ``TimeoutError``."""
BACKOFF_BASE = 0.05
"""Seconds; the n-th retry waits a random time up to ``BACKOFF_BASE * 2**n``."""
BACKOFF_CAP = 1.0
"""Seconds; the longest wait between two attempts."""


class ReplyError(Exception):
    """The server answered a command with an error (``-ERR …``, ``-NOSCRIPT …``, …)."""


class ServerNotReady(ConnectionError):
    """The server answered that it cannot serve commands now; the command ran nothing there."""


NOT_READY = frozenset({"LOADING", "READONLY", "MASTERDOWN", "TRYAGAIN", "BUSY"})
"""The error replies of a server that ran nothing and may serve again soon (or elsewhere)."""


def not_ready(reply: ReplyError) -> bool:
    """Whether ``reply`` says the server cannot serve now (:data:`NOT_READY`), not a refusal."""
    return str(reply).partition(" ")[0] in NOT_READY


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where and how to connect: the parts of a ``redis://`` URL this client understands."""

    host: str = "127.0.0.1"
    port: int = 6379
    db: int = 0
    username: str | None = None
    password: str | None = None
    tls: ssl.SSLContext | None = None
    client_name: str = ""
    connect_timeout: float = 2.0
    reply_timeout: float = 5.0
    keepalive: float = 30.0
    """Seconds a connection is idle before TCP keepalive probes it (0: off)."""
    health_check: float = 15.0
    """Seconds a connection is idle before it sends a ``PING`` (0: off)."""
    wait_replicas: int = 0
    """Replicas every write of the store must reach (``WAIT``) before it counts as done."""
    wait_timeout: float = 1.0
    """Seconds a write waits for ``wait_replicas``."""

    def handshake(self) -> list[tuple[Arg, ...]]:
        """The commands that make a fresh connection ready, in the order they are sent."""
        commands: list[tuple[Arg, ...]] = []
        if self.password is not None:
            user = () if self.username is None else (self.username,)
            commands.append(("AUTH", *user, self.password))
        if self.db:
            commands.append(("SELECT", self.db))
        if self.client_name:
            commands.append(("CLIENT", "SETNAME", self.client_name))
        return commands


class _Connection(asyncio.Protocol):
    """One TCP (or TLS) connection: writes batched per loop tick, replies handed out in order."""

    def __init__(self, reply_timeout: float, health_check: float = 0.0) -> None:
        self._reader = hiredis.Reader(replyError=ReplyError)
        self._waiting: deque[asyncio.Future[Any]] = deque()
        self._outgoing: list[bytes] = []
        self._transport: asyncio.Transport | None = None
        self._loop = asyncio.get_running_loop()
        self._reply_timeout = reply_timeout
        self._last_progress = 0.0
        self._watchdog: asyncio.TimerHandle | None = None
        self._health_check = health_check
        self._idle_timer: asyncio.TimerHandle | None = None
        self._writable = asyncio.Event()
        self._writable.set()
        self.closed = False

    # -- asyncio.Protocol ------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        self._last_progress = time.monotonic()
        self._arm_idle_check(self._health_check)

    def data_received(self, data: bytes) -> None:
        self._last_progress = time.monotonic()
        self._reader.feed(data)
        try:
            while not self.closed and (reply := self._reader.gets()) is not False:
                self._resolve(self._waiting.popleft(), reply)
        except (hiredis.ProtocolError, IndexError) as error:
            self.abort(ConnectionError(f"the server sent something that is not RESP: {error}"))

    def connection_lost(self, exc: Exception | None) -> None:
        reason = f"connection lost: {exc}" if exc else "connection closed by the server"
        self._fail_waiting(ConnectionError(reason))

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    # -- back-pressure -----------------------------------------------------------------------

    @property
    def buffered(self) -> int:
        """Bytes written to this connection that the kernel has not taken yet."""
        transport = self._transport
        return 0 if transport is None or self.closed else transport.get_write_buffer_size()

    @property
    def writable(self) -> bool:
        """Whether a command may be queued now (the send buffer is below the high-water mark)."""
        return self._writable.is_set()

    async def wait_writable(self) -> None:
        """Return once the send buffer drained below the low-water mark.

        :raises ConnectionError: if the connection closed meanwhile.
        """
        await self._writable.wait()
        if self.closed:
            raise ConnectionError("connection closed while its send buffer drained")

    # -- sending ---------------------------------------------------------------------------

    def send(self, args: tuple[Arg, ...]) -> asyncio.Future[Any]:
        """Queue one command for this tick's write; the future gets its reply."""
        if self.closed:
            raise ConnectionError("connection closed")
        reply = self._loop.create_future()
        if not self._outgoing:
            self._loop.call_soon(self._flush)
        self._outgoing.append(hiredis.pack_command(args))  # type: ignore[arg-type]  # stub: 1-tuple
        if not self._waiting:
            self._last_progress = time.monotonic()
            self._arm_watchdog(self._reply_timeout)
        self._waiting.append(reply)
        return reply

    def _flush(self) -> None:
        if self._transport is not None and not self.closed and self._outgoing:
            self._transport.write(b"".join(self._outgoing))
        self._outgoing.clear()

    def _resolve(self, waiter: asyncio.Future[Any], reply: Any) -> None:
        if isinstance(reply, ReplyError) and not_ready(reply):
            failure = ServerNotReady(f"the server cannot serve now: {reply}")
            if not waiter.done():
                waiter.set_exception(failure)
            self.abort(failure)  # a new connection may reach a ready server (a new primary)
            return
        if waiter.done():
            return  # its caller gave up; the reply is read and dropped
        if isinstance(reply, ReplyError):
            waiter.set_exception(reply)
        else:
            waiter.set_result(reply)

    # -- health --------------------------------------------------------------------------

    def _arm_idle_check(self, delay: float) -> None:
        if self._health_check > 0 and self._idle_timer is None and not self.closed:
            self._idle_timer = self._loop.call_later(delay, self._check_idle)

    def _check_idle(self) -> None:
        """Send a ``PING`` on a connection idle for ``health_check``: the watchdog times it."""
        self._idle_timer = None
        if self.closed:
            return
        idle_for = time.monotonic() - self._last_progress
        if self._waiting or idle_for < self._health_check:
            self._arm_idle_check(max(self._health_check - idle_for, 0.01))
            return
        self.send(("PING",)).add_done_callback(_retrieved)
        self._arm_idle_check(self._health_check)

    # -- failure -------------------------------------------------------------------------

    def _arm_watchdog(self, delay: float) -> None:
        if self._watchdog is None and not self.closed:
            self._watchdog = self._loop.call_later(delay, self._check_silence)

    def _check_silence(self) -> None:
        self._watchdog = None
        if not self._waiting:
            return
        silent_for = time.monotonic() - self._last_progress
        if silent_for >= self._reply_timeout:
            self.abort(TimeoutError(f"no reply for {self._reply_timeout:g}s"))
        else:
            self._arm_watchdog(self._reply_timeout - silent_for)

    def abort(self, error: Exception) -> None:
        """Close the connection now; every waiting caller gets ``error`` as a ConnectionError."""
        failure = error if isinstance(error, ConnectionError) else ConnectionError(str(error))
        self._fail_waiting(failure)
        if self._transport is not None:
            self._transport.abort()

    def _fail_waiting(self, error: ConnectionError) -> None:
        self.closed = True
        self._writable.set()  # wakes commands waiting for room; they see the close
        self._outgoing.clear()
        for timer in (self._watchdog, self._idle_timer):
            if timer is not None:
                timer.cancel()
        self._watchdog = self._idle_timer = None
        while self._waiting:
            waiter = self._waiting.popleft()
            if not waiter.done():
                waiter.set_exception(error)


Locate = Callable[[], Awaitable[tuple[str, int]]]
"""Where the server to connect to is now (a primary that Sentinel names): host and port."""


class RespClient:
    """Commands to one Redis server over one pipelined connection, reopened when it drops.

    :param locate: where to connect, asked before each new connection (and the
        server reached must then be a primary); without it, the endpoint's host.
    """

    def __init__(
        self, endpoint: Endpoint, *, retries: int = RETRIES, locate: Locate | None = None
    ) -> None:
        self.endpoint = endpoint
        self.retries = retries
        self._locate = locate
        self._connection: _Connection | None = None
        self._connecting: asyncio.Task[_Connection] | None = None
        self._closed = False

    @property
    def buffered(self) -> int:
        """Bytes of commands waiting in the send buffer (bounded by back-pressure)."""
        connection = self._connection
        return 0 if connection is None else connection.buffered

    async def execute(self, *args: Arg) -> Any:
        """Send one command and return its reply (bytes, int, ``None`` or a list of those).

        :raises ReplyError: the server answered with an error.
        :raises ConnectionError: the server could not be reached after every retry.
        """
        connection = self._connection
        if connection is None or connection.closed:
            return await self._execute_retrying(args, 0, False)
        sent = False
        try:
            if not connection.writable:
                await connection.wait_writable()
            reply = connection.send(args)
            sent = True
            return await reply
        except ConnectionError as error:
            sent = sent and not isinstance(error, ServerNotReady)
            if self._closed or self.retries == 0:
                raise _failed(error, sent) from error
        return await self._execute_retrying(args, 1, sent)

    async def _execute_retrying(self, args: tuple[Arg, ...], first: int, sent: bool) -> Any:
        """Try ``args`` from attempt ``first`` on; ``sent``: an earlier attempt may have
        reached the server."""
        for attempt in range(first, self.retries + 1):
            if attempt:
                await asyncio.sleep(random.uniform(0, min(BACKOFF_CAP, BACKOFF_BASE * 2**attempt)))
            queued = False
            try:
                connection = await self._opened_for_caller()
                if not connection.writable:
                    await connection.wait_writable()
                reply = connection.send(args)
                queued = True
                return await reply
            except (ConnectionError, TimeoutError, OSError) as error:
                sent = sent or (queued and not isinstance(error, ServerNotReady))
                if self._closed or attempt == self.retries:
                    raise _failed(error, sent) from error
        raise AssertionError("unreachable")  # pragma: no cover

    async def _opened_for_caller(self) -> _Connection:
        """:meth:`_connected`; a close that cancels the shared connect is a ConnectionError."""
        try:
            return await self._connected()
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self._closed and (task is None or task.cancelling() == 0):
                raise ConnectionError("client closed") from None
            raise  # the caller itself was cancelled

    async def _connected(self) -> _Connection:
        """The open connection, opening one (shared by every caller that waits for it)."""
        if self._closed:
            raise ConnectionError("client closed")
        connection = self._connection
        if connection is not None and not connection.closed:
            return connection
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._open())
            self._connecting.add_done_callback(self._opened)
        return await asyncio.shield(self._connecting)

    def _opened(self, task: asyncio.Task[_Connection]) -> None:
        self._connecting = None
        if not task.cancelled() and task.exception() is None:
            self._connection = task.result()
            if self._closed:
                self._connection.abort(ConnectionError("client closed"))

    async def _open(self) -> _Connection:
        endpoint = self.endpoint
        loop = asyncio.get_running_loop()
        factory = partial(_Connection, endpoint.reply_timeout, endpoint.health_check)
        async with asyncio.timeout(endpoint.connect_timeout):
            host, port = (
                (endpoint.host, endpoint.port) if self._locate is None else await self._locate()
            )
            transport, connection = await loop.create_connection(
                factory,
                host,
                port,
                ssl=endpoint.tls,
                server_hostname=host if endpoint.tls else None,
            )
            keep_alive(transport.get_extra_info("socket"), endpoint.keepalive)
            try:
                handshake = [connection.send(command) for command in endpoint.handshake()]
                replies = await asyncio.gather(*handshake, return_exceptions=True)
                refused = next((r for r in replies if isinstance(r, BaseException)), None)
                if refused is not None:
                    raise refused  # the first refusal (a bad password, say) is the reason
                if self._locate is not None:
                    await _check_primary(connection, f"{host}:{port}")
            except BaseException:
                connection.abort(ConnectionError("handshake failed"))
                raise
        return connection

    async def close(self) -> None:
        """Close the connection; waiting callers get ``ConnectionError``, later ones too."""
        self._closed = True
        if self._connecting is not None:
            self._connecting.cancel()
        if self._connection is not None:
            self._connection.abort(ConnectionError("client closed"))
            self._connection = None


async def _check_primary(connection: _Connection, where: str) -> None:
    """:raises ConnectionError: unless the server ``connection`` reached says it is a primary."""
    role = await connection.send(("ROLE",))
    if not role or role[0] != b"master":
        named = role[0].decode() if role else "nothing"
        raise ConnectionError(f"{where} is not the primary (it says {named}); asking again")


def keep_alive(sock: socket.socket | None, idle: float) -> None:
    """Have the kernel probe ``sock`` after ``idle`` seconds of silence (0: leave it off).

    Probes every ``idle / 3`` seconds (at least 1); three unanswered ones close it.
    """
    if sock is None or idle <= 0:
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    seconds = max(int(idle), 1)
    for option, value in (("TCP_KEEPIDLE", seconds), ("TCP_KEEPINTVL", max(seconds // 3, 1))):
        if hasattr(socket, option):  # Linux names; other systems keep their defaults
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
    if hasattr(socket, "TCP_KEEPCNT"):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)


def _retrieved(future: asyncio.Future[Any]) -> None:
    """Take a health check's outcome: a failure there closed its connection, nothing more."""
    if not future.cancelled():
        future.exception()


def _failed(error: BaseException, sent: bool) -> ConnectionError:
    """What a caller gets once ``error`` ended its command (a not-ready server stays one),
    saying whether the command may have reached the server (:func:`maybe_sent`)."""
    kind = ServerNotReady if isinstance(error, ServerNotReady) else ConnectionError
    failure = kind(_describe(error))
    failure.maybe_sent = sent  # type: ignore[attr-defined]
    return failure


def maybe_sent(error: BaseException) -> bool:
    """Whether the command ``error`` ended may have reached the server, and run there:
    ``False`` only when no try of it was ever written to a connection (or a server
    that answered ``-LOADING`` and the like ran nothing of it)."""
    return bool(getattr(error, "maybe_sent", True))


def _describe(error: BaseException) -> str:
    text = str(error)
    if isinstance(error, TimeoutError):
        return f"timed out{f' ({text})' if text else ''}"
    return text or type(error).__name__


__all__ = [
    "NOT_READY",
    "Arg",
    "Endpoint",
    "ReplyError",
    "RespClient",
    "ServerNotReady",
    "not_ready",
]
