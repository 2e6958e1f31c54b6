"""The PostgreSQL store's wake-ups: ``NOTIFY`` when a waited-for session may be free, ``LISTEN``
on a connection of the store's own.

What stays true:

* **Only a session someone waits for is notified.** An acquire refused
  because the session is busy (a live lease, or another holder's earlier
  message) marks the session's row ``waiting``, in the transaction that
  refuses. Every transaction that may let such an acquire through — a lease
  released (``release``, ``commit_and_release``), pending records removed (a
  commit's done records, ``drop_pending``, ``park``) — clears the mark in one
  of its own statements and, only where it was set, calls ``pg_notify`` there:
  the notification goes out when that transaction commits, never for one
  rolled back. A commit nobody waits for sends nothing, so turns' commits
  never queue on the server's notification lock (which serialises the commits
  of every transaction that notifies) for no listener.
* The channel is the store's (:func:`channel`, named for its schema); the
  payload is a hash of the session key (:func:`token`: 32 hex digits, far
  below ``NOTIFY``'s 8000 bytes whatever the key holds). Two keys of one hash
  would only wake each other's waiters for nothing.
* Records adopted from a dead process wake this process's own waiters
  directly: their owner is now this process, which nobody else waits for
  (other processes' waiters are woken when the adopter's turns release).
* One connection outside the pools ``LISTEN``\\ s (:class:`Listener`). When it
  drops (a server restart, ``pg_terminate_backend``, a network cut, found by a
  ``SELECT 1`` every :data:`CHECK_EVERY` seconds that must answer within
  ``connect_timeout``, or by TCP keepalive) it is reopened, at once and then
  with a growing delay; opening it (connecting and ``LISTEN``) is bounded by
  ``connect_timeout`` too, so a connection that goes half-open on the way never
  stops it from being reopened. While it is down waiters poll, and once it is
  back every waiter is woken to ask again, as a release may have gone unheard.
  Closing the store closes it. No wake-up is ever needed for correctness.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from typing import Any

import asyncpg

from chatlane.stores.postgres.db import ConnectError, DriverError
from chatlane.stores.postgres.pools import keep_alive
from chatlane.stores.postgres.url import Location
from chatlane.stores.wakeups import WakeupHub, Watch
from chatlane.types import SessionKey

__all__ = ["CHECK_EVERY", "Listener", "channel", "token"]

log = logging.getLogger("chatlane.stores.postgres")

CHECK_EVERY = 10.0
"""Seconds between two checks that the listening connection still answers."""

RETRY_FIRST = 0.05
RETRY_MAX = 5.0
"""The first and the longest wait before opening the listening connection again after it failed."""

connect = asyncpg.connect
"""How the listening connection is opened (the driver's own ``connect``)."""

_NAME_LIMIT = 63
"""The longest identifier (a channel name) the server keeps."""


def channel(schema: str) -> str:
    """The channel a store in ``schema`` notifies and listens on."""
    named = f"{schema}.wakeups"
    if len(named) <= _NAME_LIMIT:
        return named
    return f"chatlane.wakeups.{hashlib.blake2b(schema.encode(), digest_size=8).hexdigest()}"


def token(key: SessionKey | str) -> str:
    """The payload that names ``key`` in a notification: a hash, whatever the key holds."""
    return hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


class Listener:
    """The store's listening connection, and the watches it wakes.

    :param name: the store's name, for the log (its password masked).
    """

    def __init__(self, location: Location, name: str) -> None:
        self.channel = channel(location.schema)
        self.hub = WakeupHub(lambda: self.listening)
        self.opened = 0
        """How many times the listening connection was opened (it is reopened after a drop)."""
        self._location = location
        self._name = name
        self._connection: Any = None
        self._lost = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def listening(self) -> bool:
        """Whether the listening connection is open (while it is not, waiters poll)."""
        connection = self._connection
        return connection is not None and not connection.is_closed()

    @property
    def server_pid(self) -> int | None:
        """The server process of the listening connection, while it is open."""
        return int(self._connection.get_server_pid()) if self.listening else None

    def watch(self, key: SessionKey) -> Watch:
        """A watch on ``key``, woken by the notifications for it."""
        return self.hub.watch(token(key))

    def wake(self, keys: set[SessionKey]) -> None:
        """Wake this process's watches on ``keys`` (no notification is sent)."""
        for key in keys:
            self.hub.wake(token(key))

    async def start(self) -> None:
        """Open the connection (a failure is logged: waiters poll until it opens) and keep it."""
        await self._open()
        self._task = asyncio.create_task(self._keep(), name="chatlane-postgres-listener")

    async def close(self) -> None:
        """Stop listening and close the connection; every waiter is woken (idempotent)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._drop()
        self.hub.wake_all()

    async def _open(self) -> bool:
        location = self._location
        connection: Any = None
        try:
            async with asyncio.timeout(location.connect_timeout):  # LISTEN's answer too
                connection = await connect(location.dsn, timeout=location.connect_timeout)
                keep_alive(connection, location.keepalives_idle)
                await connection.add_listener(self.channel, self._heard)
        except ConnectError as error:
            if connection is not None:
                connection.terminate()
            log.warning("%s: cannot listen for wake-ups, polling: %s", self._name, _reason(error))
            return False
        connection.add_termination_listener(self._dropped)
        self._connection = connection
        self._lost.clear()
        self.opened += 1
        self.hub.wake_all()  # what was released while no one listened went unheard
        return True

    def _heard(self, connection: Any, pid: int, channel: str, payload: str) -> None:
        self.hub.wake(payload)

    def _dropped(self, connection: Any) -> None:
        if connection is self._connection:
            self._connection = None
            self._lost.set()
            log.warning("%s: the wake-up connection closed; polling until it is back", self._name)

    def _drop(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None and not connection.is_closed():
            connection.terminate()

    async def _keep(self) -> None:
        """Reopen the connection whenever it drops; check it answers every :data:`CHECK_EVERY`."""
        delay = RETRY_FIRST
        while True:
            if not self.listening:
                self._drop()
                if not await self._open():
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, RETRY_MAX)
                    continue
                delay = RETRY_FIRST
            try:
                async with asyncio.timeout(CHECK_EVERY):
                    await self._lost.wait()
            except TimeoutError:
                await self._check()

    async def _check(self) -> None:
        connection = self._connection
        if connection is None:
            return
        try:
            await connection.fetchval("SELECT 1", timeout=self._location.connect_timeout)
        except DriverError as error:
            log.warning("%s: the wake-up connection failed: %s", self._name, _reason(error))
            self._drop()


def _reason(error: BaseException) -> str:
    return str(error) or type(error).__name__
