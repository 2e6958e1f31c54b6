"""What only the Redis store promises: scripts, round trips, retries, lost servers, keys."""

from __future__ import annotations

import asyncio
import os
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any, TypeVar

import pytest
from hypothesis import given
from hypothesis import strategies as st
from redis.asyncio import Redis

from chatlane.errors import AlreadyAnswered, LeaseLost, SessionBusy, StoreError
from chatlane.identity import SessionKey
from chatlane.runtime.settings import LeaseSettings
from chatlane.stores import (
    Delivery,
    DeliveryDraft,
    Settlement,
    SettlementKind,
    TranscriptEntry,
    WriteBatch,
    open_store,
)
from chatlane.stores import redis as redis_store_module
from chatlane.stores import redis_scripts as lua
from chatlane.stores.base import DEAD, DELIVERED, PENDING, AnsweredMark
from chatlane.stores.ids import new_conversation_id
from chatlane.stores.redis import RedisStore
from chatlane.stores.redis_keys import SESSION_PARTS, Keyspace, escape
from chatlane.stores.redis_url import parse_url
from chatlane.stores.resp import Arg, RespClient, _Connection, _failed
from chatlane.testing import GatewayHarness
from tests.keys import chat_key, odd_keys
from tests.runtime.agents import EchoAgent
from tests.stores.servers import redis_server
from tests.stores.taken_back import check_taken_back

T = TypeVar("T")

KEY = chat_key("c1")
BRACED_KEYS = odd_keys(
    "a}b", "a", "a}", "{a}", "a%7Db", "a%7db", "%", "", "}{", "a}:gen", "{", "}", "%25"
)


@contextmanager
def throwaway_server() -> Iterator[str]:
    """A server of our own (even when ``REDIS_URL`` is set), stopped when the block ends."""
    with ExitStack() as stack:
        with pytest.MonkeyPatch.context() as patch:
            patch.delenv("REDIS_URL", raising=False)
            url = stack.enter_context(redis_server())
        yield url


def namespaced(base: str, prefix: str, **params: str) -> str:
    query = "&".join(f"{name}={value}" for name, value in {"prefix": prefix, **params}.items())
    return f"{base}{'&' if '?' in base else '?'}{query}"


async def purge(base: str, prefix: str) -> None:
    """Delete every key of ``prefix`` (never anything else: the server may be shared)."""
    admin = Redis.from_url(base)
    try:
        keys = [key async for key in admin.scan_iter(match=f"{prefix}:*", count=500)]
        if keys:
            await admin.unlink(*keys)
    finally:
        await admin.aclose()


@pytest.fixture(scope="module")
def private_url() -> Iterator[str]:
    """For tests that touch the whole server (``SCRIPT FLUSH``)."""
    with throwaway_server() as url:
        yield url


@pytest.fixture
def prefix() -> str:
    return f"test-redis-{secrets.token_hex(6)}"


@pytest.fixture
async def admin(redis_url: str) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_url)
    yield client
    await client.aclose()


@pytest.fixture
async def store(redis_url: str, prefix: str) -> AsyncIterator[RedisStore]:
    opened = await RedisStore.open(namespaced(redis_url, prefix))
    yield opened
    await opened.close()
    await purge(redis_url, prefix)


def entry(content: str, generation: int) -> TranscriptEntry:
    return TranscriptEntry("user", content, generation)


class TestScripts:
    async def test_a_flushed_script_cache_is_reloaded(self, private_url: str, prefix: str) -> None:
        store = await RedisStore.open(namespaced(private_url, prefix))
        admin = Redis.from_url(private_url)
        try:
            lease = await store.acquire(KEY, "p1", 5)
            await admin.script_flush()
            await store.commit(KEY, lease.generation, WriteBatch([entry("hi", 1)]))
            await store.release(lease)
            await admin.script_flush()
            keys = [chat_key(f"k{i}") for i in range(30)]
            acquired = asyncio.gather(*(store.acquire(k, "p1", 5) for k in keys))
            leases, _ = await asyncio.gather(acquired, flush_scripts(admin))
            assert [lease.generation for lease in leases] == [1] * 30
            assert [e.content for e in await store.transcript(KEY)] == ["hi"]
        finally:
            await store.close()
            await admin.aclose()

    async def test_each_check_and_set_is_one_round_trip(
        self, store: RedisStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        await scenario(store, chat_key("warm-up"), lambda name: None)
        sent = RoundTrips(monkeypatch)
        await scenario(store, KEY, sent.start)
        assert sent.counts == dict.fromkeys(STEPS, 1)


async def flush_scripts(admin: Redis) -> None:
    await asyncio.sleep(0)
    await admin.script_flush()


class RoundTrips:
    """Counts the commands each named step sends."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.counts: dict[str, int] = {}
        self.step = ""
        original = _Connection.send

        def counted(connection: _Connection, args: tuple[Arg, ...]) -> asyncio.Future[Any]:
            self.counts[self.step] = self.counts.get(self.step, 0) + 1
            return original(connection, args)

        monkeypatch.setattr(_Connection, "send", counted)

    def start(self, step: str) -> None:
        self.step = step


STEPS = [
    *("acquire", "renew", "enqueue", "adopt", "commit", "bump_generation", "release"),
    *("conversation", "new_conversation", "resume_conversation", "drop_pending", "drop_own"),
    *("enqueue_and_acquire", "commit_and_release", "acquire_and_read"),
    *("conversations", "transcript", "pending", "active_sessions", "generation"),
]


async def scenario(store: RedisStore, key: SessionKey, step: Callable[[str], None]) -> None:
    """Every store operation once, each announced to ``step`` before it runs (see STEPS)."""
    step("acquire")
    lease = await store.acquire(key, "p1", 5, head_seq=10**9, max_active=100)
    step("renew")
    lease = await store.renew(lease, 5)
    step("enqueue")
    seq = await store.enqueue(key, f"{key}-m1", "dead", b"payload")
    step("adopt")
    await store.adopt(key, [seq], "dead", "p1")
    step("commit")
    batch = WriteBatch([entry("hi", 1)], {"model": "m"}, [f"{key}-m1"], [seq])
    await store.commit(key, lease.generation, batch)
    step("bump_generation")
    await store.bump_generation(key)
    step("release")
    await store.release(lease)
    step("conversation")
    old = await store.conversation(key)
    step("new_conversation")
    await store.new_conversation(key, "t")
    step("resume_conversation")
    await store.resume_conversation(key, old.id)
    step("drop_pending")
    await store.drop_pending(key, [seq])
    step("drop_own")
    await store.drop_own(key, [seq], "p1")
    step("enqueue_and_acquire")
    admission = await store.enqueue_and_acquire(key, f"{key}-m2", "p1", b"", 5, max_active=100)
    assert admission.lease is not None
    step("commit_and_release")
    await store.commit_and_release(admission.lease, WriteBatch(done=[admission.seq]))
    step("acquire_and_read")
    await store.acquire_and_read(key, "p1", 5, head_seq=10**9, max_active=100)
    for name, read in reads(store, key).items():
        step(name)
        await read()


def reads(store: RedisStore, key: SessionKey) -> dict[str, Callable[[], Awaitable[object]]]:
    return {
        "conversations": lambda: store.conversations(key),
        "transcript": lambda: store.transcript(key),
        "pending": lambda: store.pending(key),
        "active_sessions": store.active_sessions,
        "generation": lambda: store.generation(key),
    }


class TestDroppedConnections:
    async def test_killed_connections_are_replaced_mid_use(
        self, redis_url: str, prefix: str, admin: Redis
    ) -> None:
        name = f"chatlane-{prefix}"
        store = await RedisStore.open(namespaced(redis_url, prefix, client_name=name))
        stop = asyncio.Event()
        killer = asyncio.create_task(kill_until(admin, name, stop))
        try:
            await asyncio.gather(*(turns(store, chat_key(f"k{i}"), 25) for i in range(10)))
        finally:
            stop.set()
            killed = await killer
            await store.close()
        assert killed > 0
        check = await RedisStore.open(namespaced(redis_url, prefix))
        for i in range(10):
            assert await check.generation(chat_key(f"k{i}")) == 25
            assert len(await check.transcript(chat_key(f"k{i}"), limit=100)) == 25
        await check.close()
        await purge(redis_url, prefix)

    async def test_a_reply_lost_after_the_script_ran_is_applied_once(
        self, store: RedisStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        await scenario(store, chat_key("warm-up"), lambda step: None)
        lose = LostReply(monkeypatch)
        seq = await store.enqueue(KEY, "m1", "dead", b"")
        lease = await lose.next(store.acquire(KEY, "p1", 5))
        assert lease.generation == 1
        assert await lose.next(store.adopt(KEY, [seq], "dead", "p1")) == [seq]
        batch = WriteBatch([entry("once", 1)], answered=["m1"], done=[seq])
        await lose.next(store.commit(KEY, lease.generation, batch))
        assert await lose.next(store.bump_generation(KEY)) == 2
        await lose.next(store.release(lease))
        first = await store.conversation(KEY)
        second = await lose.next(store.new_conversation(KEY))
        assert lose.lost == 6
        assert [e.content for e in await store.transcript(KEY, first.id)] == ["once"]
        assert [c.id for c in await store.conversations(KEY)] == [second.id, first.id]
        assert await store.pending(KEY) == []
        assert (await store.acquire(KEY, "p2", 5)).generation == 3

    async def test_a_lost_reply_to_a_fused_call_is_applied_once(
        self, store: RedisStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        await scenario(store, chat_key("warm-up"), lambda step: None)
        lose = LostReply(monkeypatch)
        await store.set_persistent(KEY, None, busy_policy="queue")
        admission = await lose.next(store.enqueue_and_acquire(KEY, "m1", "p1", b"", 5))
        assert admission.lease is not None
        assert (admission.lease.generation, admission.persistent) == (1, {"busy_policy": "queue"})
        assert [r.message_id for r in await store.pending(KEY)] == ["m1"]
        batch = WriteBatch([entry("once", 1)], answered=["m1"], done=[admission.seq])
        assert await lose.next(store.commit_and_release(admission.lease, batch)) is True
        taken = await lose.next(store.acquire_and_read(KEY, "p2", 5))
        assert (taken.lease.generation, taken.persistent) == (2, {"busy_policy": "queue"})
        assert lose.lost == 3
        assert [e.content for e in await store.transcript(KEY)] == ["once"]
        assert await store.pending(KEY) == []
        with pytest.raises(SessionBusy):
            await store.acquire(KEY, "p3", 5)

    async def test_a_commit_that_failed_after_it_applied_is_applied_once_when_made_again(
        self, store: RedisStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """As when the runtime retries a commit through an outage longer than the client's."""
        await scenario(store, chat_key("warm-up"), lambda step: None)
        admission = await store.enqueue_and_acquire(KEY, "m1", "p1", b"", 5)
        assert admission.lease is not None
        batch = WriteBatch([entry("once", 1)], answered=["m1"], done=[admission.seq], answer="hi")
        client = store._client
        assert isinstance(client, RespClient)
        client.retries = 0  # as past its retries: the lost reply reaches the caller
        lose = LostReply(monkeypatch)
        with pytest.raises(StoreError, match="reply lost") as lost:
            await lose.next(store.commit_and_release(admission.lease, batch))
        assert lost.value.maybe_applied
        assert await store.answer("m1") == "hi"  # it applied all the same
        assert await store.commit_and_release(admission.lease, batch) is True
        assert [e.content for e in await store.transcript(KEY)] == ["once"]
        assert await store.pending(KEY) == []
        with pytest.raises(AlreadyAnswered):  # another batch answering m1 is still refused
            await store.commit(KEY, None, WriteBatch(answered=["m1"], answer="again"))

    async def test_a_script_that_ran_before_its_wait_for_replicas_failed_may_have_applied(
        self, store: RedisStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        async def replicas_out_of_reach() -> None:
            raise _failed(ConnectionError("connection refused"), False)  # WAIT never sent

        store._wait_replicas = 1
        monkeypatch.setattr(store, "_replicated", replicas_out_of_reach)
        with pytest.raises(StoreError) as failed:
            await store.acquire(KEY, "p1", 5)
        assert failed.value.maybe_applied  # the script had run: the lease is there
        assert await store.generation(KEY) == 1

    async def test_a_message_whose_admission_reply_was_lost_is_taken_back(
        self, store: RedisStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A gateway on the real server: the reply to a message's admission is lost past
        the client's retries, so its sender is told it was not taken; the store, which
        queued it and leased its session all the same, is brought to agree."""
        client = store._client
        assert isinstance(client, RespClient)
        lasting = LeaseSettings(ttl=3600)  # a lease left behind would hold the session for good
        async with GatewayHarness(EchoAgent(), store=store, leases=lasting) as h:
            await h.send("warm-up", chat_id="c")
            await h.replies(chat_id="c", count=1)
            client.retries = 0  # as past its retries: the lost reply reaches the gateway
            lose = LostReply(monkeypatch)
            with pytest.raises(StoreError):
                await lose.next(h.send("lost", chat_id="c"))
            client.retries = 5
            assert lose.lost == 1
            await check_taken_back(h, store, ["echo: warm-up", "echo: next"])

    async def test_a_message_whose_drop_reply_was_lost_is_queued_again_and_outlives_it(
        self, store: RedisStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A gateway on the real server: ``/stop``'s drop of a queued message applies and
        its reply is lost past the client's retries, so the message is told it still
        waits; it is queued again under its seq, and runs after the gateway's end."""
        client = store._client
        assert isinstance(client, RespClient)
        lasting = LeaseSettings(ttl=3600)  # a lease left behind would hold the session for good
        async with GatewayHarness(EchoAgent(), store=store, leases=lasting) as h:
            key = h.session_key(chat_id="c")
            elsewhere = await store.acquire(key, "another process", 3600)
            await h.send("a", chat_id="c")  # its turn waits: the session runs elsewhere
            await h.send("b", chat_id="c")  # queued behind it
            [_, b] = [record.seq for record in await store.pending(key)]
            await store.drop_own(chat_key("warm-up"), [b], "p")  # the server knows the script
            client.retries = 0  # as past its retries: the lost reply reaches the gateway
            lose = LostReply(monkeypatch, digest=store._digests[lua.DROP_OWN])
            await lose.next(h.send("/stop", chat_id="c"))
            client.retries = 5
            assert lose.lost == 1
            assert [record.seq for record in await store.pending(key)] == [b]
            assert any("It still waits." in sent.text for sent in h.outbox)
        await store.release(elsewhere)
        async with GatewayHarness(EchoAgent(), store=store, leases=lasting) as restarted:
            assert await restarted.replies(chat_id="c", count=1) == ["echo: b"]

    async def test_an_adoption_whose_reply_was_lost_is_read_back_by_the_next(
        self, store: RedisStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The reply to a session's adoption is lost past the client's retries: the
        adoption fails, and the next one returns the records the lost one made ours."""
        client = store._client
        assert isinstance(client, RespClient)
        await store.enqueue(KEY, "m1", "a process that died", b"left")
        await store.adopt(chat_key("warm-up"), [1], "x", "y")  # the server knows the script
        client.retries = 0  # as past its retries: the lost reply reaches the caller
        lose = LostReply(monkeypatch, digest=store._digests[lua.ADOPT])
        with pytest.raises(StoreError):
            await lose.next(store.adopt_orphans("me", 10))
        client.retries = 5
        assert lose.lost == 1
        assert [record.owner for record in await store.pending(KEY)] == ["me"]  # it applied
        adopted = await store.adopt_orphans("me", 10)
        assert [(r.message_id, r.owner, r.payload) for r in adopted] == [("m1", "me", b"left")]
        assert await store.adopt_orphans("me", 10) == []


async def kill_until(admin: Redis, name: str, stop: asyncio.Event) -> int:
    """Kill the connections named ``name`` every few milliseconds; how many were killed."""
    killed = 0
    while not stop.is_set():
        for client in await admin.client_list():
            if client.get("name") == name:
                killed += int(await admin.client_kill_filter(_id=client["id"]))
        await asyncio.sleep(0.01)
    return killed


async def turns(store: RedisStore, key: SessionKey, count: int) -> None:
    """``count`` full turns on ``key``: acquire, commit one entry, release."""
    for _ in range(count):
        lease = await store.acquire(key, "p1", 5)
        await store.commit(key, lease.generation, WriteBatch([entry("x", lease.generation)]))
        await store.release(lease)


class LostReply:
    """Loses the reply to the next script call after the server has run the script.

    The reply arrives, and instead of reaching its caller the connection is
    dropped: the caller sees a lost connection and sends the script again.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch, digest: str = "") -> None:
        """:param digest: lose only the reply to this script (``""``: to any)."""
        self.armed = False
        self.lost = 0
        self.doomed: asyncio.Future[Any] | None = None
        send, resolve = _Connection.send, _Connection._resolve

        def sending(connection: _Connection, args: tuple[Arg, ...]) -> asyncio.Future[Any]:
            waiter = send(connection, args)
            if self.armed and args[0] == "EVALSHA" and (not digest or args[1] == digest):
                self.armed, self.doomed = False, waiter
            return waiter

        def lossy(connection: _Connection, waiter: asyncio.Future[Any], reply: Any) -> None:
            if waiter is self.doomed:
                self.doomed = None
                self.lost += 1
                lost = ConnectionError("reply lost (test)")
                waiter.set_exception(lost)
                connection.abort(lost)
                return
            resolve(connection, waiter, reply)

        monkeypatch.setattr(_Connection, "send", sending)
        monkeypatch.setattr(_Connection, "_resolve", lossy)

    async def next(self, operation: Awaitable[T]) -> T:
        self.armed = True
        return await operation


class TestConnections:
    async def test_a_burst_shares_one_connection_and_each_caller_gets_its_own_reply(
        self, redis_url: str, prefix: str, admin: Redis
    ) -> None:
        name = f"chatlane-{prefix}"
        store = await RedisStore.open(namespaced(redis_url, prefix, client_name=name))
        try:
            seqs = await asyncio.gather(
                *(store.enqueue(chat_key(f"k{i}"), f"m{i}", "p", b"") for i in range(200))
            )
            assert len(set(seqs)) == 200
            echoes = await asyncio.gather(*(store._command("ECHO", i) for i in range(500)))
            assert echoes == [str(i).encode() for i in range(500)]
            named = [c for c in await admin.client_list() if c.get("name") == name]
            assert len(named) == 1
        finally:
            await store.close()
            await purge(redis_url, prefix)

    async def test_callers_that_give_up_do_not_shift_the_replies(self, store: RedisStore) -> None:
        calls = [asyncio.ensure_future(store._command("ECHO", i)) for i in range(300)]
        await asyncio.sleep(0)
        for call in calls[::3]:
            call.cancel()
        await asyncio.gather(*calls, return_exceptions=True)
        for i, call in enumerate(calls):
            assert call.cancelled() if i % 3 == 0 else call.result() == str(i).encode()
        assert await store._command("ECHO", "after") == b"after"


class TestLostServer:
    async def test_renew_after_the_server_went_away_is_lease_lost(self, prefix: str) -> None:
        with throwaway_server() as url:
            store = await RedisStore.open(namespaced(url, prefix))
            lease = await store.acquire(KEY, "p1", 30)
        started = time.monotonic()
        with pytest.raises(LeaseLost, match="could not be renewed") as raised:
            await store.renew(lease, 30)
        assert isinstance(raised.value.__cause__, StoreError)
        assert (raised.value.key, raised.value.generation) == (KEY, lease.generation)
        with pytest.raises(StoreError) as failed:
            await store.generation(KEY)
        assert not failed.value.maybe_applied  # the server was never reached: nothing ran
        assert time.monotonic() - started < 15
        await store.close()

    async def test_a_closed_store_refuses_work(self, store: RedisStore) -> None:
        await store.close()
        with pytest.raises(StoreError, match="closed"):
            await store.acquire(KEY, "p1", 5)


class TestAnswers:
    async def test_a_heartbeat_forgets_answers_with_their_marks(
        self, store: RedisStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        for n in range(5):
            await store.commit(KEY, None, WriteBatch(answered=[f"m{n}"], answer=f"answer {n}"))
        monkeypatch.setattr("chatlane.stores.redis.FORGET_AT_ONCE", 2)
        store.answered_retention = -1.0  # every mark is past its retention now
        await store.heartbeat("p1", 5)
        assert await stored_answers(store) == (["m2", "m3", "m4"], ["m2", "m3", "m4"])
        await store.heartbeat("p1", 5)
        await store.heartbeat("p1", 5)
        assert await stored_answers(store) == ([], [])

    async def test_a_mark_set_before_marks_kept_their_session_reads_as_answered(
        self, store: RedisStore
    ) -> None:
        moment = int(time.time() * 1000)
        await store._command("ZADD", store._keys.one("answered_at"), moment, "m1")
        await store._command("HSET", store._keys.one("answers"), "m1", "hi")
        assert await store.mark("m1") == AnsweredMark("hi")

    async def test_a_heartbeat_forgets_what_marks_keep_beside_their_answers(
        self, store: RedisStore
    ) -> None:
        await store.commit(KEY, None, WriteBatch(answered=["m1"], answer="a", failure="Boom"))
        store.answered_retention = -1.0
        await store.heartbeat("p1", 5)
        assert await store._command("HKEYS", store._keys.one("answer_marks")) == []


async def stored_answers(store: RedisStore) -> tuple[list[str], list[str]]:
    """The ids of the answered marks (oldest first) and of the kept answers (sorted)."""
    marks = await store._command("ZRANGE", store._keys.one("answered_at"), 0, -1)
    answers = await store._command("HKEYS", store._keys.one("answers"))
    return [m.decode() for m in marks], sorted(a.decode() for a in answers)


LANE = "telegram"


def draft(delivery_id: str, target: str = "chat-1", lane: str = LANE) -> DeliveryDraft:
    return DeliveryDraft(delivery_id, lane, target, delivery_id.encode())


def settle(delivery: Delivery, kind: SettlementKind, **fields: Any) -> Settlement:
    return Settlement(delivery.id, delivery.claim, kind, **fields)


def ids(deliveries: list[Delivery]) -> list[str]:
    return [delivery.id for delivery in deliveries]


async def ledger_calls(store: RedisStore, lane: str, step: Callable[[str], None]) -> None:
    """Every ledger call once on ``lane``, each announced to ``step`` before it runs."""
    step("record_deliveries")
    await store.record_deliveries([draft(f"{lane}-1", lane, lane), draft(f"{lane}-2", lane, lane)])
    step("claim_deliveries")
    [first] = await store.claim_deliveries([lane], "p1", 5, 10)
    step("settle_deliveries")
    await store.settle_deliveries([settle(first, SettlementKind.DEAD, reason="gone")])
    step("retry_dead")
    assert await store.retry_dead(first.id)
    step("deliveries")
    await store.deliveries(PENDING)
    step("delivery")
    await store.delivery(first.id)
    step("delivery_stats")
    await store.delivery_stats()
    step("commit")
    await store.commit(KEY, None, WriteBatch(deliveries=[draft(f"{lane}-3", lane, lane)]))


class TestLedger:
    async def test_each_ledger_call_is_one_round_trip(
        self, store: RedisStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        await ledger_calls(store, "warm-up", lambda step: None)
        sent = RoundTrips(monkeypatch)
        await ledger_calls(store, LANE, sent.start)
        assert sent.counts == dict.fromkeys(sent.counts, 1)
        assert len(sent.counts) == 8

    async def test_a_lost_reply_is_applied_once_and_says_so(
        self, store: RedisStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        await ledger_calls(store, "warm-up", lambda step: None)
        lose = LostReply(monkeypatch)
        await lose.next(store.record_deliveries([draft("a1"), draft("b1", "B")]))
        claimed = await lose.next(store.claim_deliveries([LANE], "p1", 30, 10))
        assert ids(claimed) == ["a1", "b1"]  # handed back by the claim sent again
        assert not any(d.uncertain for d in claimed)
        assert await store.claim_deliveries([LANE], "p2", 30, 10) == []
        a1, b1 = claimed
        settled = store.settle_deliveries(
            [settle(a1, SettlementKind.DELIVERED), settle(b1, SettlementKind.DEAD, reason="x")]
        )
        assert await lose.next(settled) == [True, True]
        assert await lose.next(store.retry_dead("b1")) is True
        batch = WriteBatch(deliveries=[draft("a2"), draft("b2", "B")])
        await lose.next(store.commit(KEY, None, batch))
        assert lose.lost == 5
        pending = [d for d in await store.deliveries(PENDING) if d.lane == LANE]
        assert ids(pending) == ["b1", "a2", "b2"]
        assert pending[2].seq == pending[1].seq + 1  # recorded once
        again = await store.claim_deliveries([LANE], "p2", 30, 10)
        assert [(d.id, d.attempts, d.uncertain) for d in again] == [
            ("b1", 0, False),
            ("a2", 0, False),
        ]

    async def test_a_commit_refused_as_answered_records_nothing(self, store: RedisStore) -> None:
        await store.commit(KEY, None, WriteBatch(answered=["m1"], answer="hi"))
        with pytest.raises(AlreadyAnswered):
            await store.commit(KEY, None, WriteBatch(answered=["m1"], deliveries=[draft("r1")]))
        assert await store.delivery("r1") is None
        assert (await store.delivery_stats()).pending == 0

    async def test_braced_ids_targets_and_lanes_never_collide(self, store: RedisStore) -> None:
        odd = [str(key) for key in BRACED_KEYS]
        await store.record_deliveries([draft(text, text, lane=text) for text in odd])
        for text in odd:
            found = await store.delivery(text)
            assert found is not None
            assert (found.id, found.lane, found.target, found.payload) == (
                text,
                text,
                text,
                text.encode(),
            )
            [claimed] = await store.claim_deliveries([text], "p1", 5, 10)
            assert claimed.id == text
            assert await store.settle_deliveries([settle(claimed, SettlementKind.DELIVERED)])
        assert sorted(ids(await store.deliveries(DELIVERED))) == sorted(odd)

    async def test_each_target_waits_in_one_of_its_lanes_sets(self, store: RedisStore) -> None:
        await store.record_deliveries([draft("a1", "A"), draft("a2", "A")])
        await store.record_deliveries([draft("b1", "B"), draft("c1", "C"), draft("d1", "D")])
        a1, b1 = await store.claim_deliveries([LANE], "p1", 30, 2)
        await store.settle_deliveries([settle(b1, SettlementKind.RELEASE, delay=60)])
        ready, waiting = await lane_sets(store, LANE)
        assert ready == {"C": float(a1.seq + 3), "D": float(a1.seq + 4)}
        assert set(waiting) == {"A", "B"}
        assert waiting["A"] == pytest.approx(a1.claim_expires * 1e6)
        await store.settle_deliveries([settle(a1, SettlementKind.DELIVERED)])
        ready, waiting = await lane_sets(store, LANE)
        assert ready == {"A": float(a1.seq + 1), "C": float(a1.seq + 3), "D": float(a1.seq + 4)}
        assert set(waiting) == {"B"}

    async def test_an_evicted_delivery_never_stalls_its_chat(
        self, store: RedisStore, admin: Redis
    ) -> None:
        await store.record_deliveries([draft("a1", "A"), draft("a2", "A"), draft("b1", "B")])
        await admin.delete(store._keys.delivery("a1"))  # as a server that evicts keys would
        claimed = []  # the claim that meets the stray drops it; A's next one is claimed after
        while more := await store.claim_deliveries([LANE], "p1", 30, 10):
            claimed += more
        assert sorted(ids(claimed)) == ["a2", "b1"]
        assert "a1" not in ids(await store.deliveries(PENDING))
        await store.settle_deliveries([settle(d, SettlementKind.DELIVERED) for d in claimed])
        assert await lane_sets(store, LANE) == ({}, {})

    async def test_nothing_is_left_behind_once_everything_is_settled_and_pruned(
        self, store: RedisStore, admin: Redis
    ) -> None:
        await store.record_deliveries([draft(f"d{n}", f"T{n % 4}", f"L{n % 2}") for n in range(12)])
        while claimed := await store.claim_deliveries(["L0", "L1"], "p1", 30, 100):
            kinds = [SettlementKind.DELIVERED, SettlementKind.DEAD]
            await store.settle_deliveries([settle(d, kinds[d.seq % 2]) for d in claimed])
        store.delivered_retention = store.answered_retention = -1.0
        await store.heartbeat("p1", 5)
        prefix = store._keys.prefix
        names = {name.decode() async for name in admin.scan_iter(match=f"{prefix}:*")}
        claims = {name for name in names if name.startswith(f"{prefix}:dc:")}
        assert claims  # each claim's record, gone with its TTL
        assert all([0 < await admin.pttl(name) <= 30_000 for name in claims])
        assert names - claims == {f"{prefix}:{part}" for part in ("dseq", "holders", "hb:{p1}")}

    async def test_claims_and_prunes_go_in_bounded_steps(
        self, store: RedisStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setattr("chatlane.stores.redis_ledger.CLAIM_AT_ONCE", 2)
        monkeypatch.setattr("chatlane.stores.redis_ledger.FORGET_AT_ONCE", 2)
        await store.record_deliveries([draft(f"d{n}", f"T{n}") for n in range(5)])
        first = await store.claim_deliveries([LANE], "p1", 30, 10)
        assert ids(first) == ["d0", "d1"]
        rest = await store.claim_deliveries([LANE], "p1", 30, 10)
        rest += await store.claim_deliveries([LANE], "p1", 30, 10)
        assert ids(rest) == ["d2", "d3", "d4"]
        await store.settle_deliveries([settle(d, SettlementKind.DELIVERED) for d in first + rest])
        store.delivered_retention = -1.0
        await store.heartbeat("p1", 5)
        assert ids(await store.deliveries(DELIVERED)) == ["d2", "d3", "d4"]
        await store.heartbeat("p1", 5)
        await store.heartbeat("p1", 5)
        assert await store.deliveries(DELIVERED) == []
        assert await store.deliveries(DEAD) == []

    async def test_a_backlog_found_due_at_once_is_moved_over_several_claims(
        self, store: RedisStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setattr("chatlane.stores.redis_ledger.PROMOTE_AT_ONCE", 2)
        await store.record_deliveries([draft(f"d{n}", f"T{n}") for n in range(5)])
        lapsed = await store.claim_deliveries([LANE], "p1", 1e-6, 10)  # expired by the next
        assert ids(lapsed) == ["d0", "d1", "d2", "d3", "d4"]
        rounds = [ids(await store.claim_deliveries([LANE], "p2", 30, 10)) for _ in range(4)]
        assert rounds == [["d0", "d1"], ["d2", "d3"], ["d4"], []]


async def lane_sets(store: RedisStore, lane: str) -> tuple[dict[str, float], dict[str, float]]:
    """A lane's ready targets (by their head's seq) and waiting ones (by when, µs)."""
    _, _, ready, waiting, _, tail = store._keys.ledger_affixes()
    found = []
    for head in (ready, waiting):
        flat = await store._command("ZRANGE", f"{head}{escape(lane)}{tail}", 0, -1, "WITHSCORES")
        pairs = zip(flat[::2], flat[1::2], strict=True)
        found.append({name.decode(): float(score) for name, score in pairs})
    return found[0], found[1]


class TestShortcuts:
    """What a store remembers to send less stays a shortcut: the server has the last word."""

    async def test_a_session_seen_with_a_conversation_gets_no_new_id(
        self, store: RedisStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        made: list[str] = []

        def counted() -> str:
            made.append(new_conversation_id())
            return made[-1]

        monkeypatch.setattr("chatlane.stores.redis.new_conversation_id", counted)
        await store.commit(KEY, None, WriteBatch([entry("one", 0)]))
        await store.commit(KEY, None, WriteBatch([entry("two", 0)]))
        assert len(made) == 1
        assert (await store.conversation(KEY)).id == made[0]
        assert [e.content for e in await store.transcript(KEY)] == ["one", "two"]

    async def test_a_conversation_gone_behind_the_stores_back_is_started_again(
        self, store: RedisStore, admin: Redis, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        await store.commit(KEY, None, WriteBatch([entry("one", 0)]))
        first = (await store.conversation(KEY)).id
        await admin.delete(store._keys.one("conv", KEY))
        sent = RoundTrips(monkeypatch)
        sent.start("commit")
        await store.commit(KEY, None, WriteBatch([entry("two", 0)], persistent={"n": 1}))
        assert sent.counts == {"commit": 2}  # refused without writing, then sent with an id
        current = await store.conversation(KEY)
        assert current.id != first
        assert [e.content for e in await store.transcript(KEY)] == ["two"]
        assert [e.content for e in await store.transcript(KEY, first)] == ["one"]
        assert await store.load_persistent(KEY) == {"n": 1}

    async def test_what_a_store_remembers_is_bounded(
        self, store: RedisStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setattr("chatlane.stores.redis.REMEMBERED", 3)
        for n in range(10):
            key = chat_key(f"k{n}")
            lease = await store.acquire(key, "p1", 5)
            await store.commit_and_release(lease, WriteBatch([entry("hi", lease.generation)]))
            assert len(store._heads) <= 3
            assert len(store._conversing) <= 3
        assert [await store.generation(chat_key(f"k{n}")) for n in range(10)] == [1] * 10


def test_a_forked_process_draws_its_own_request_ids() -> None:
    parent = redis_store_module._request_id()
    reader, writer = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child
        os.write(writer, redis_store_module._request_id().encode())
        os._exit(0)
    os.close(writer)
    os.waitpid(child, 0)
    with os.fdopen(reader) as pipe:
        forked = pipe.read()
    assert forked.rpartition("-")[0] != parent.rpartition("-")[0]
    assert redis_store_module._request_id() != parent


class TestKeys:
    async def test_prefixes_do_not_see_each_other(self, redis_url: str, prefix: str) -> None:
        first = await RedisStore.open(namespaced(redis_url, prefix))
        second = await RedisStore.open(namespaced(redis_url, f"{prefix}:s"))
        try:
            await first.acquire(KEY, "p1", 5)
            await first.enqueue(KEY, "m1", "p1", b"")
            await first.commit(KEY, None, WriteBatch(persistent={"x": 1}, answered=["m0"]))
            await first.heartbeat("p1", 5)
            assert (await second.acquire(KEY, "p1", 5)).generation == 1
            assert await second.pending_keys() == []
            assert await second.load_persistent(KEY) == {}
            assert not await second.is_answered("m0")
            assert await second.alive(["p1"]) == {"p1": False}
            assert await second.active_sessions() == 1
        finally:
            await first.close()
            await second.close()
            await purge(redis_url, prefix)

    async def test_braced_keys_never_collide(self, store: RedisStore) -> None:
        leases = [await store.acquire(key, "p1", 5) for key in BRACED_KEYS]
        assert [lease.generation for lease in leases] == [1] * len(BRACED_KEYS)
        for key in BRACED_KEYS:
            await store.enqueue(key, f"m-{key}", "p1", key.encode())
        assert sorted(await store.pending_keys()) == sorted(BRACED_KEYS)
        for key in BRACED_KEYS:
            with pytest.raises(SessionBusy):
                await store.acquire(key, "p2", 5)
            assert [r.payload for r in await store.pending(key)] == [key.encode()]

    @given(st.text().map(SessionKey), st.text().map(SessionKey))
    def test_a_session_is_one_hash_slot_and_one_name(
        self, key: SessionKey, other: SessionKey
    ) -> None:
        keyspace = Keyspace("p")
        tags = {hash_tag(keyspace.one(part, key)) for part in SESSION_PARTS}
        assert tags == {escape(key)}
        if key != other:
            assert keyspace.session(key) != keyspace.session(other)
            assert escape(key) != escape(other)

    def test_escaping_leaves_conversation_ids_alone(self) -> None:
        keyspace = Keyspace("p")
        head, tail = keyspace.transcript_affixes()
        assert keyspace.transcript("c_0123abcd") == f"{head}c_0123abcd{tail}"


def hash_tag(key: str) -> str:
    """What Redis Cluster hashes: the first non-empty ``{…}`` section, else the whole key."""
    start = key.find("{")
    end = key.find("}", start + 1)
    return key[start + 1 : end] if start >= 0 and end > start + 1 else key


class TestUrls:
    def test_every_part_of_the_url_reaches_the_endpoint(self) -> None:
        url = "rediss://bot%3A1:p%40ss@h:6380/2?prefix=app&client_name=eu&socket_timeout=1.5"
        endpoint, prefix = parse_url(f"{url}&socket_connect_timeout=4&ssl_cert_reqs=none")
        assert prefix == "app"
        assert (endpoint.host, endpoint.port, endpoint.db) == ("h", 6380, 2)
        assert (endpoint.username, endpoint.password) == ("bot:1", "p@ss")
        assert (endpoint.client_name, endpoint.reply_timeout, endpoint.connect_timeout) == (
            "eu",
            1.5,
            4.0,
        )
        assert endpoint.tls is not None
        assert not endpoint.tls.check_hostname
        assert endpoint.handshake() == [
            ("AUTH", "bot:1", "p@ss"),
            ("SELECT", 2),
            ("CLIENT", "SETNAME", "eu"),
        ]

    def test_defaults(self) -> None:
        endpoint, prefix = parse_url("redis://h")
        assert (prefix, endpoint.port, endpoint.db, endpoint.tls) == ("chatlane", 6379, 0, None)
        assert endpoint.handshake() == [("CLIENT", "SETNAME", "chatlane")]
        assert parse_url("redis://:only@h")[0].handshake()[0] == ("AUTH", "only")

    @pytest.mark.parametrize(
        ("url", "complaint"),
        [
            ("redis://h/0?max_connections=3", "unknown option 'max_connections'"),
            ("redis://h/0?ssl_cert_reqs=none", "need a rediss:// URL"),
            ("rediss://h/0?ssl_cert_reqs=maybe", "ssl_cert_reqs must be one of"),
            ("rediss://h/0?ssl_check_hostname=perhaps", "ssl_check_hostname must be true"),
            ("rediss://h/0?ssl_ca_certs=/nonexistent/ca.pem", "No such file"),
            ("redis://h/0?socket_timeout=-1", "positive number of seconds"),
            ("redis://h/0?socket_timeout=soon", "positive number of seconds, not 'soon'"),
            ("redis://h/0?socket_connect_timeout=nan", "positive number of seconds"),
            ("http://h/0", "scheme must be redis or rediss"),
            ("redis://h/٣", "the path must be /<database number>"),
            ("redis://h/0?wait_replicas=٣", "wait_replicas must be a whole number from 0 to 64"),
            ("redis://h/0?wait_replicas=²", "wait_replicas must be a whole number from 0 to 64"),
            ("redis://h:port/0", r"malformed \(a port that is not a number"),
        ],
    )
    def test_a_url_part_that_is_not_understood_is_named(self, url: str, complaint: str) -> None:
        with pytest.raises(StoreError, match=complaint):
            parse_url(url)

    @pytest.mark.parametrize(
        "url",
        [
            "redis://127.0.0.1:1/0",
            "redis://127.0.0.1:notaport/0",
            "redis://127.0.0.1:6379/notadb",
            "redis://127.0.0.1:6379/0?prefix=",
            "redis://127.0.0.1:6379/0?prefix=a{b",
            "redis://:s3cret@127.0.0.1:1/0",
        ],
    )
    async def test_a_bad_url_is_a_store_error(self, url: str) -> None:
        started = time.monotonic()
        with pytest.raises(StoreError) as raised:
            await open_store(url)
        assert "s3cret" not in str(raised.value)
        assert time.monotonic() - started < 5
