"""The PostgreSQL store on half-open connections: every call bounded, the process recovers.

A proxy between the store and a real server (:mod:`tests.stores.half_open`) keeps the
store's side of its connections open while nothing answers behind them, as a pooler
whose backend died, a failed-over virtual IP or a dropped NAT entry does. Each call
that meets such a connection fails within its limit (``command_timeout``,
``renew_timeout``) as a store failure the runtime already handles, the connection is
closed, and the calls after it open fresh ones: a gateway on the store answers again
once the server can be reached, without a restart, and closing never hangs.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import asyncpg
import openai
import pytest

from chatlane.errors import StoreError
from chatlane.stores import Lease, WriteBatch
from chatlane.stores.postgres import PostgresStore, wakeups
from chatlane.stores.postgres.pools import Call
from chatlane.stores.postgres.url import parse_url
from chatlane.testing import GatewayHarness
from chatlane.types import OutboundKind
from tests.adapters.test_api import eventually, make_config, serve
from tests.keys import chat_key
from tests.runtime.agents import EchoAgent
from tests.runtime.test_outage import HeldFirst
from tests.stores.conftest import forget_store, own_schema
from tests.stores.half_open import HalfOpenProxy, half_open_proxy, through

KEY, HELD = chat_key("c1"), chat_key("held")

BOUND = 20.0
"""Seconds a call or a close may take at most here: generous beside the limits the stores
below are given (about 1 s), short of the test's own timeout; without the bounds, they
never return."""

SHORT = "command_timeout=1&renew_timeout=0.5&connect_timeout=1"
"""The limits of the stores below: short, so that a call on a dead connection fails soon."""


@pytest.fixture
def url(postgres_url: str) -> str:
    return own_schema(postgres_url, "halfopen")


@pytest.fixture
async def proxy(postgres_url: str, url: str) -> AsyncIterator[HalfOpenProxy]:
    async with half_open_proxy(postgres_url) as opened:
        yield opened
    await forget_store(url)


async def open_through(proxy: HalfOpenProxy, url: str, options: str = SHORT) -> PostgresStore:
    return await PostgresStore.open(f"{through(url, proxy)}&{options}")


async def fill(store: PostgresStore) -> None:
    """Open every connection each of the store's pools may hold, so that all are cut."""
    for pool in (store._pools.turns, store._pools.quick, store._pools.liveness):
        held = [await pool.acquire() for _ in range(pool.get_max_size())]
        for connection in held:
            await pool.release(connection)


Way = Callable[[PostgresStore, Lease], Awaitable[object]]

WAYS: dict[str, tuple[Way, bool, str]] = {
    # a read on the quick pool: it wrote nothing
    "read": (lambda store, _: store.pending(KEY), False, "command_timeout"),
    # a transaction: cut before its COMMIT was sent, so it wrote nothing
    "transaction": (lambda store, _: store.bump_generation(KEY), False, "command_timeout"),
    # a routine's one statement: sent, so it may have applied
    "routine": (
        lambda store, _: store.enqueue_and_acquire(KEY, "m1", "p1", b"hi", 5),
        True,
        "command_timeout",
    ),
    "renewal": (lambda store, lease: store.renew_many([lease], 30), False, "renew_timeout"),
    "heartbeat": (lambda store, _: store.heartbeat("p1", 30), False, "renew_timeout"),
}


@pytest.mark.parametrize("way", list(WAYS))
async def test_a_call_on_a_half_open_connection_fails_within_its_limit_and_the_next_opens_one(
    proxy: HalfOpenProxy, url: str, way: str
) -> None:
    call, maybe_applied, option = WAYS[way]
    store = await open_through(proxy, url, f"{SHORT}&pool_max=2")
    try:
        lease = await store.acquire(HELD, "p1", 30)
        await fill(store)
        assert proxy.cut() >= 5  # every pooled connection, and the listener's
        opened = proxy.accepted
        async with asyncio.timeout(BOUND):  # never, without the bounds
            with pytest.raises(StoreError) as failed:
                await call(store, lease)
        assert f"({option}); its connection was closed" in str(failed.value)
        assert failed.value.maybe_applied is maybe_applied
        async with asyncio.timeout(BOUND):
            await call(store, lease)  # every connection it had is dead: a fresh one
        assert proxy.accepted > opened
    finally:
        async with asyncio.timeout(BOUND):
            await store.close()


async def test_closing_does_not_wait_for_connections_that_never_answer(
    proxy: HalfOpenProxy, url: str
) -> None:
    """Idle connections, and a call still waiting on its own (its limit far off), are closed
    by force once the close's own bound (``connect_timeout``) has passed."""
    store = await open_through(proxy, url, "command_timeout=600&connect_timeout=1")
    await fill(store)
    proxy.cut()
    waiting = asyncio.create_task(store.pending(KEY))
    await proxy.until_swallowed(1)  # its statement went into a black hole
    async with asyncio.timeout(BOUND):  # never, without the bound
        await store.close()
        with pytest.raises(StoreError):
            await waiting


async def test_the_wakeup_listener_reopens_when_its_listen_is_never_answered(
    proxy: HalfOpenProxy, url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The listening connection goes half-open between connecting and ``LISTEN``: opening it
    is given up after ``connect_timeout``, and the next try listens."""
    connect = wakeups.connect
    tries = 0

    async def cut_after_first_connect(*args: Any, **options: Any) -> Any:
        nonlocal tries
        tries += 1
        connection = await connect(*args, **options)
        if tries == 1:
            proxy.cut()  # its LISTEN is never answered
        return connection

    monkeypatch.setattr(wakeups, "connect", cut_after_first_connect)
    async with asyncio.timeout(BOUND):  # never, without the bound: open waits for the listener
        store = await PostgresStore.open(f"{through(url, proxy)}&connect_timeout=1")
    try:
        watch = store.watch_wakeups(KEY)  # woken once it listens again
        listening = [watch.listening]  # not: polling meanwhile
        assert await watch.wait(BOUND)
        listening.append(watch.listening)
        assert listening == [False, True]
        assert tries == 2
        assert store.listener.opened == 1
    finally:
        await store.close()


async def test_a_heartbeat_has_the_renewal_limit_until_the_server_answers_it(
    proxy: HalfOpenProxy, url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A heartbeat gets ``renew_timeout`` until the server answers it, then
    ``command_timeout``: pruning a backlog (after a long stop) never fails every heartbeat.
    Here its ``DELETE`` of long-expired heartbeats first waits for a row another client
    locked (and is not cut short); then its connection goes half-open (and it is)."""
    store = await open_through(proxy, url, "renew_timeout=0.2&command_timeout=60")
    limits: list[float] = []
    extend = Call.extend

    def noted(call: Call, limit: float) -> None:
        limits.append(limit)
        extend(call, limit)

    monkeypatch.setattr(Call, "extend", noted)
    location = parse_url(url)
    locker = await asyncpg.connect(location.dsn)
    try:
        await locker.execute(f'SET search_path = "{location.schema}"')
        await locker.execute("INSERT INTO heartbeats (holder, expires_at) VALUES ('gone', 0)")
        locking = locker.transaction()
        await locking.start()
        await locker.execute("SELECT 1 FROM heartbeats WHERE holder = 'gone' FOR UPDATE")
        beating = asyncio.create_task(store.heartbeat("p1", 30))
        await eventually(lambda: _waiting_for_a_row(store, "DELETE FROM heartbeats"))
        assert limits == [60.0]  # answered, it had its renewal limit lifted before its DELETE
        assert not beating.done()
        await locking.rollback()
        async with asyncio.timeout(BOUND):
            await beating
        assert await store.alive(["p1", "gone"]) == {"p1": True, "gone": False}
        await fill(store)
        proxy.cut()
        async with asyncio.timeout(BOUND):  # never, without the bound
            with pytest.raises(StoreError, match=r"\(renew_timeout\)"):
                await store.heartbeat("p1", 30)
    finally:
        await locker.close()
        await store.close()


async def _waiting_for_a_row(store: PostgresStore, statement: str) -> bool:
    rows = await store._fetch(
        "SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
        "AND datname = current_database() AND query LIKE $1",
        f"{statement}%",
    )
    return bool(rows)


@pytest.mark.skipif(not hasattr(socket, "TCP_KEEPIDLE"), reason="Linux's keepalive options")
async def test_every_connection_has_keepalive_probes(url: str) -> None:
    store = await PostgresStore.open(f"{url}&keepalives_idle=45")
    plain = await PostgresStore.open(f"{url}&keepalives=0")
    try:
        async with store._pools.turns.acquire() as pooled:
            probed = [_socket(pooled._con), _socket(store.listener._connection)]
        for sock in probed:
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 45
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == 15
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == 3
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 90_000
        async with plain._pools.quick.acquire() as unprobed:
            assert _socket(unprobed._con).getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 0
    finally:
        await store.close()
        await plain.close()


def _socket(connection: Any) -> socket.socket:
    found: socket.socket = connection._transport.get_extra_info("socket")
    return found


async def test_a_message_accepted_before_the_connections_went_dead_is_answered_after(
    proxy: HalfOpenProxy, url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every connection goes half-open, and new ones are not served, while a turn runs: its
    commit fails within its limit (and is retried), a message arriving meanwhile is
    refused, and once the server can be reached again the turn's answer is committed and
    delivered, and new sessions run, in the same process."""
    store = await open_through(proxy, url)
    failed = asyncio.Event()
    commit = store.commit_and_release

    async def watched(lease: Lease, batch: WriteBatch) -> bool:
        try:
            return await commit(lease, batch)
        except StoreError:
            failed.set()
            raise

    monkeypatch.setattr(store, "commit_and_release", watched)
    agent = HeldFirst()
    try:
        async with GatewayHarness(agent, store=store) as h:
            await h.send("first", chat_id="c")
            await agent.running.wait()
            proxy.stalled = True
            proxy.cut()
            agent.go.set()
            async with asyncio.timeout(BOUND):  # never, without the bounds
                await failed.wait()
                with pytest.raises(StoreError):  # the API's 503
                    await h.send("during", chat_id="new")
            proxy.stalled = False  # the server answers again
            assert await h.replies(chat_id="c", count=1, timeout=BOUND) == ["answer first"]
            await h.send("after", chat_id="new")
            assert await h.replies(chat_id="new", count=1, timeout=BOUND) == ["answer after"]
            await h.settle(timeout=BOUND)
            assert [o.text for o in h.outbox if o.kind is OutboundKind.REPLY] == [
                "answer first",
                "answer after",
            ]
            assert await store.pending(h.session_key(chat_id="c")) == []
            assert await store.failed() == []
    finally:
        async with asyncio.timeout(BOUND):
            await store.close()


async def test_a_gateway_answers_503_while_its_connections_are_dead_and_recovers(
    proxy: HalfOpenProxy, url: str, tmp_path: Path
) -> None:
    """What the review saw hang for good: requests to new sessions, and the shutdown."""
    async with asyncio.timeout(2 * BOUND):
        async with serve(
            make_config(tmp_path), EchoAgent(), store=f"{through(url, proxy)}&{SHORT}"
        ) as s:
            assert await s.ask("before", "a") == "echo: before"
            proxy.stalled = True
            proxy.cut()
            with pytest.raises(openai.InternalServerError) as refused:
                await s.ask("during", "b")
            assert refused.value.status_code == 503
            proxy.stalled = False
            assert await s.ask("after", "b") == "echo: after"
            assert await s.ask("again", "a") == "echo: again"
