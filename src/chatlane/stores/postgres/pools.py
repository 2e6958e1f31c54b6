"""The PostgreSQL store's connections: a pool for transactions, a small one for reads, and one
kept for liveness.

What stays true:

* Transactions that take a session's lock (acquire, commit, enqueue…) share
  the pool of ``pool_min`` to ``pool_max`` connections, waiting their turn for
  one when all are busy.
* Reads that are a single statement (fence checks, persistent fields, queues,
  answers) never wait for a session's lock, and have a pool of their own
  (:data:`QUICK_POOL`): a backlog of turns never delays the reads the
  runtime's upkeep makes between two renewals.
* Heartbeats and lease renewals have a pool of their own too
  (:data:`LIVENESS_POOL`), which nothing else uses: neither a backlog of turns
  nor a burst of reads (the scheduler's checks of thousands of sessions due
  for an auto-reset, say) ever delays them past a TTL, which would make the
  process look dead and its messages be adopted and run elsewhere while it
  still runs them. Neither takes a session's lock.
* Every connection's ``search_path`` is the store's schema, and stays so: the
  store never changes a pooled session's settings, listens on it (its one
  ``LISTEN`` has a connection of its own, outside the pools:
  :mod:`~chatlane.stores.postgres.wakeups`), or holds a lock past its
  transaction, so a connection given back to the pool is not reset by a query
  of its own (a round trip per call); an open transaction is still rolled back.
* The server ends a transaction of the store's left idle longer than the
  location's ``idle_in_transaction_timeout`` (and with it the connection):
  a process stopped mid-transaction (``SIGSTOP``, a debugger, a frozen VM)
  holds a session's lock and rows only that long, never until it runs again,
  so another process can take its sessions over once their leases expire.
* **Every call is bounded** (:class:`Call`): it waits for its pooled connection
  (opening one included) at most its limit or ``connect_timeout``, whichever is
  longer, and a connection that has not answered the call within its limit —
  ``renew_timeout`` for heartbeats and renewals, ``command_timeout`` for the
  rest — is closed by force (never given back to the pool), which fails the
  call with the driver's error. Every idle connection of the store's pools is
  closed with it, as they most likely share its fault (a server, pooler or
  network path that vanished): the calls after it open fresh connections
  instead of each waiting out its limit on another dead one. A half-open
  connection (a pooler, proxy or NAT that keeps this side open while nothing
  answers behind it) therefore costs the calls holding one their limit, never
  the process its store. The bound is kept on this host, with no round trip:
  one watchdog timer looks at every call under way a few times within the
  shortest limit (:class:`Watchdog`), so a call is ended at most an eighth of
  that limit late (one timer more while a call waits for a connection).
* Every TCP connection of the store (the pools', the listener's) has keepalive
  probes (:func:`keep_alive`, unless ``keepalives=0``): a server or network
  that vanished without a word is found while the connection is idle, and
  closed by the kernel.
* Closing never hangs: the pools are closed gracefully for at most
  ``connect_timeout``, then every connection left is closed by force.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from types import TracebackType
from typing import Any, Literal, Protocol

import asyncpg

from chatlane.errors import StoreError
from chatlane.stores.postgres.db import ConnectError
from chatlane.stores.postgres.url import Location

__all__ = [
    "LIVENESS_POOL",
    "QUICK_POOL",
    "Call",
    "PoolName",
    "Pools",
    "Watchdog",
    "keep_alive",
    "open_pools",
]

PoolName = Literal["turns", "quick", "liveness"]
"""The store's pools: for transactions, for single-statement reads, for heartbeats and renewals."""

QUICK_POOL = 2
"""Connections the single-statement reads use at most (one is kept open)."""

LIVENESS_POOL = 2
"""Connections heartbeats and renewals use at most (one is kept open): one each, so that
neither waits for the other."""


class Bounded(Protocol):
    """What the watchdog ends: a :class:`Call`."""

    def expire(self) -> None:
        """Past its limit: end it."""


class Watchdog:
    """Ends every call still holding its connection past its deadline, on one timer for all
    of them (a timer of its own for each call would cost every call more than the rest
    of its bound).

    The timer runs only while calls are watched, every :attr:`tick` seconds: a call is
    ended between its deadline and one tick later.
    """

    __slots__ = ("_calls", "_timer", "tick")

    def __init__(self, tick: float) -> None:
        self.tick = tick
        self._calls: dict[Bounded, float] = {}
        self._timer: asyncio.TimerHandle | None = None

    def watch(self, call: Bounded, deadline: float) -> None:
        """End ``call`` once the loop's clock passes ``deadline``, unless :meth:`forget` is
        called first (a second watch moves its deadline)."""
        self._calls[call] = deadline
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.tick, self._check)

    def forget(self, call: Bounded) -> None:
        self._calls.pop(call, None)

    def stop(self) -> None:
        """Watch nothing more (the store closes)."""
        self._calls.clear()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check(self) -> None:
        loop = asyncio.get_running_loop()
        moment = loop.time()
        self._timer = None
        try:
            late = [call for call, deadline in self._calls.items() if deadline <= moment]
            for call in late:
                del self._calls[call]
                call.expire()
        finally:  # one call's failure to end never leaves the others unwatched
            if self._calls:
                self._timer = loop.call_later(self.tick, self._check)


class Call:
    """One call's connection, as ``async with pools.call(name) as connection``: taken from
    its pool within :attr:`wait` seconds (else ``TimeoutError``), and closed by force if
    the call still holds it :attr:`limit` seconds later (by ``watchdog``, up to its tick
    later; :attr:`expired` then says so, and ``expiring`` is called).

    :param option: the URL option that sets ``limit``, for the error that names it.
    """

    __slots__ = (
        "_connection",
        "_expiring",
        "_pool",
        "_watchdog",
        "expired",
        "limit",
        "option",
        "wait",
    )

    def __init__(
        self,
        pool: Any,
        limit: float,
        wait: float,
        option: str,
        expiring: Callable[[], None],
        watchdog: Watchdog,
    ) -> None:
        self._pool, self._expiring, self._watchdog = pool, expiring, watchdog
        self.limit, self.wait, self.option = limit, wait, option
        self.expired = False
        self._connection: Any = None

    async def __aenter__(self) -> Any:
        pool = self._pool
        if _free(pool):  # taken at once (opening it, if need be, takes connect_timeout at most)
            self._connection = await pool.acquire()
        else:
            try:
                async with asyncio.timeout(self.wait):
                    self._connection = await pool.acquire()
            except TimeoutError:
                raise TimeoutError(f"no connection within {self.wait:g} s") from None
        self._watchdog.watch(self, asyncio.get_running_loop().time() + self.limit)
        return self._connection

    def extend(self, limit: float) -> None:
        """Give the rest of the call ``limit`` seconds from now instead."""
        if self._connection is not None and not self.expired:
            self._watchdog.watch(self, asyncio.get_running_loop().time() + limit)
            self.limit = limit

    def expire(self) -> None:
        """The call is past its limit: its connection is closed (every wait on it ends, and
        its pool replaces it), unless it was given back this moment."""
        try:
            self._connection.terminate()
        except asyncpg.InterfaceError:
            return  # given back to its pool this moment: it answered in time
        self.expired = True
        self._expiring()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            await self._pool.release(self._connection)
        finally:
            self._watchdog.forget(self)


def _free(pool: Any) -> bool:
    """Whether ``pool`` has a connection no call holds, so that taking one does not wait
    (asyncpg's queue of them: the one timer a wait needs is spared on the hot path)."""
    queue = getattr(pool, "_queue", None)
    return queue is not None and queue.qsize() > 0


@dataclass(frozen=True, slots=True)
class Pools:
    """The store's three pools (asyncpg's ``Pool``, untyped), where they connect, and the
    watchdog that bounds their calls."""

    turns: Any
    quick: Any
    liveness: Any
    location: Location
    watchdog: Watchdog

    def __getitem__(self, name: PoolName) -> Any:
        return getattr(self, name)

    def call(self, name: PoolName) -> Call:
        """A bounded call on a connection of pool ``name`` (see :class:`Call`)."""
        location = self.location
        if name == "liveness":
            limit, option = location.renew_timeout, "renew_timeout"
        else:
            limit, option = location.command_timeout, "command_timeout"
        wait = max(limit, location.connect_timeout)
        return Call(self[name], limit, wait, option, self.drop_idle, self.watchdog)

    def drop_idle(self) -> None:
        """Close every connection no call holds now: the next calls open fresh ones."""
        for pool in (self.turns, self.quick, self.liveness):
            for holder in getattr(pool, "_holders", ()):  # asyncpg keeps no public list
                if holder.is_idle():
                    holder.terminate()

    async def close(self) -> None:
        """Close every connection: gracefully for at most ``connect_timeout``, then by force."""
        self.watchdog.stop()
        await _close((self.turns, self.quick, self.liveness), self.location.connect_timeout)


async def _close(pools: tuple[Any, ...], within: float) -> None:
    try:
        async with asyncio.timeout(within):
            await asyncio.gather(*(pool.close() for pool in pools))
    except TimeoutError:
        pass  # a connection that does not answer: closed below
    finally:
        for pool in pools:
            pool.terminate()  # nothing, for a pool closed above


async def open_pools(location: Location, name: str) -> Pools:
    """Open the three pools.

    :raises StoreError: the server cannot be reached, or refuses the credentials.
    """
    opened: list[Any] = []
    try:
        for least, most in ((1, LIVENESS_POOL), (1, QUICK_POOL)):
            opened.append(await _pool(location, name, least, most))
        opened.append(await _pool(location, name, location.pool_min, location.pool_max))
    except BaseException:
        await _close(tuple(opened), location.connect_timeout)
        raise
    liveness, quick, turns = opened
    return Pools(turns, quick, liveness, location, Watchdog(watch_tick(location)))


WATCH_TICKS = 8
"""Ticks of the watchdog within the shortest limit: a call past its limit is ended within
an eighth of that limit more."""


def watch_tick(location: Location) -> float:
    """How often the watchdog looks at the calls under way: :data:`WATCH_TICKS` times within
    the shortest limit (``renew_timeout`` by default: every 0.25 s)."""
    return min(location.command_timeout, location.renew_timeout) / WATCH_TICKS


async def _pool(location: Location, name: str, least: int, most: int) -> Any:
    try:
        return await asyncpg.create_pool(
            location.dsn,
            min_size=least,
            max_size=most,
            timeout=location.connect_timeout,
            server_settings={
                "search_path": f'"{location.schema}"',
                "idle_in_transaction_session_timeout": _milliseconds(
                    location.idle_in_transaction_timeout
                ),
            },
            init=partial(_probed, idle=location.keepalives_idle),
            reset=_keep_session,
        )
    except ConnectError as error:
        raise StoreError(f"{name}: cannot connect ({str(error) or type(error).__name__})") from None


def _milliseconds(seconds: float) -> str:
    """A server setting in milliseconds: at least 1, since 0 would turn the timeout off."""
    return str(max(1, round(seconds * 1000)))


async def _keep_session(connection: Any) -> None:
    """Give a connection back as it is (asyncpg has already rolled back any open transaction)."""


async def _probed(connection: Any, *, idle: int) -> None:
    """A new pooled connection, given keepalive probes (``idle`` 0: none)."""
    keep_alive(connection, idle)


KEEPALIVE_PROBES = 3
"""Unanswered keepalive probes after which the kernel closes a connection."""


def keep_alive(connection: Any, idle: int) -> None:
    """Have the kernel probe ``connection`` (asyncpg's) after ``idle`` seconds of silence.

    It probes every ``idle / 3`` seconds (at least 1), and closes the connection after
    :data:`KEEPALIVE_PROBES` unanswered ones, or once data it sent has gone unacknowledged
    as long (``TCP_USER_TIMEOUT``). The idle time, interval and user timeout are Linux's
    names; other systems probe on their own schedule. A Unix socket, or ``idle`` 0, is
    left as it is.
    """
    transport = getattr(connection, "_transport", None)  # asyncpg keeps no public handle
    sock = None if transport is None else transport.get_extra_info("socket")
    if idle <= 0 or sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    every = max(idle // 3, 1)
    options = {
        "SO_KEEPALIVE": 1,
        "TCP_KEEPIDLE": idle,
        "TCP_KEEPINTVL": every,
        "TCP_KEEPCNT": KEEPALIVE_PROBES,
        "TCP_USER_TIMEOUT": (idle + every * KEEPALIVE_PROBES) * 1000,  # milliseconds
    }
    for option, value in options.items():
        level = socket.SOL_SOCKET if option == "SO_KEEPALIVE" else socket.IPPROTO_TCP
        if hasattr(socket, option):
            with contextlib.suppress(OSError):  # a system that refuses one keeps its default
                sock.setsockopt(level, getattr(socket, option), value)
