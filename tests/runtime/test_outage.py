"""A store outage is survived in order: commits wait it out, nothing is stuck or overtaken.

The outages are real: another connection holds the SQLite file's write lock
for longer than the store's busy timeout, as a backup, another program or a
slow disk would; a Redis server goes away and comes back with its data.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from chatlane.runtime.turn import Turn
from chatlane.stores import Taken, open_store
from chatlane.stores.sqlite import SQLiteStore
from chatlane.stores.sqlite_schema import parse_url
from chatlane.testing import GatewayHarness
from chatlane.testing_redis import free_port, server_binary, wait_until_ready
from chatlane.types import OutboundKind, SessionKey
from tests.adapters.test_api import eventually, make_config, serve
from tests.keys import chat_key


class HeldFirst:
    """Answers every message; the one saying "first" waits for ``go`` once it runs."""

    def __init__(self) -> None:
        self.running, self.go = asyncio.Event(), asyncio.Event()

    async def __call__(self, turn: Turn) -> str:
        if turn.text == "first":
            self.running.set()
            await self.go.wait()
        return f"answer {turn.text}"


async def answers(h: GatewayHarness, count: int) -> list[str]:
    """The first ``count`` answers (replies, not acks) to chat ``c``, in the order delivered."""
    async with asyncio.timeout(60):
        while True:
            texts = [o.text for o in h.outbox if o.kind is OutboundKind.REPLY]
            if len(texts) >= count:
                return texts
            await h.settle(timeout=60)


@contextlib.contextmanager
def write_lock(path: Path) -> Iterator[None]:
    """Hold ``path``'s write lock (``BEGIN IMMEDIATE``) until the block ends."""
    db = sqlite3.connect(path, isolation_level=None)
    try:
        db.execute("BEGIN IMMEDIATE")
        yield
        db.execute("COMMIT")
    finally:
        db.close()


async def test_a_commit_outlasts_a_held_write_lock_and_later_messages_wait_behind_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "chatlane.db"
    store = await open_store(f"sqlite:///{path}?busy_timeout=50")
    agent = HeldFirst()

    caplog.set_level(logging.WARNING)
    try:
        async with GatewayHarness(agent, store=store) as h:
            first = await h.send("first", chat_id="c")
            await agent.running.wait()
            with write_lock(path):
                agent.go.set()
                await eventually(lambda: "commit failed, retrying" in caplog.text)
            await h.send("second", chat_id="c")  # the first's commit may still be waiting
            assert await answers(h, 2) == ["answer first", "answer second"]
            assert await store.pending(first.session_key) == []
            assert await store.failed() == []
    finally:
        await store.close()
    assert "never retrieved" not in caplog.text
    assert "could not settle" not in caplog.text


async def test_an_api_request_during_an_outage_is_refused_without_naming_the_store_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "chatlane.db"
    store = f"sqlite:///{path}?busy_timeout=50"
    caplog.set_level(logging.WARNING)
    async with serve(make_config(tmp_path), store=store) as s:
        assert await s.ask("before", "c") == "echo: before"
        with write_lock(path), pytest.raises(openai.InternalServerError) as refused:
            await s.ask("during", "c")
        assert await s.ask("after", "c") == "echo: after"
        said = [e.content for e in await s.hub.store.transcript(chat_key("c", "api"))]
    assert refused.value.status_code == 503
    told = refused.value.response.text
    assert "the store is unavailable" in told
    assert str(tmp_path) not in told
    assert "locked" not in told
    assert str(path) in caplog.text  # the operator's log keeps what the store said
    # refused, so never taken (the client knows to send it again); the others answered
    assert said == ["before", "echo: before", "after", "echo: after"]


class OutageAtFirstAcquire(SQLiteStore):
    """Another connection takes the file's write lock just as a waiting turn first asks
    for its lease again."""

    locker: sqlite3.Connection | None = None

    async def acquire_and_read(
        self, key: SessionKey, holder: str, ttl: float, **options: Any
    ) -> Taken:
        if self.locker is None:
            self.locker = sqlite3.connect(self.location.path, isolation_level=None)
            self.locker.execute("BEGIN IMMEDIATE")
        return await super().acquire_and_read(key, holder, ttl, **options)

    def end_outage(self) -> None:
        assert self.locker is not None
        self.locker.execute("COMMIT")
        self.locker.close()


async def test_a_turn_waits_out_an_outage_before_it_takes_its_lease(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    url = f"sqlite:///{tmp_path / 'chatlane.db'}?busy_timeout=50"
    store = OutageAtFirstAcquire(url, parse_url(url))
    await store._writer.start()

    async def agent(turn: Turn) -> str:
        return f"answer {turn.text}"

    caplog.set_level(logging.WARNING)
    try:
        async with GatewayHarness(agent, store=store) as h:
            elsewhere = await store.acquire(h.session_key(chat_id="c"), "another-process", 30)
            await h.send("first", chat_id="c")  # queued; its turn waits for the lease
            await eventually(lambda: "taking the lease failed, retrying" in caplog.text)
            store.end_outage()
            await store.release(elsewhere)
            told = await h.replies(chat_id="c", count=2, timeout=60)
            assert told == ["Queued for the next turn (this conversation is busy)", "answer first"]
    finally:
        await store.close()
    assert "never retrieved" not in caplog.text


@contextlib.contextmanager
def persistent_redis(folder: Path, port: int) -> Iterator[subprocess.Popen[bytes]]:
    """A Redis server of this test's own that keeps its data across a restart (AOF)."""
    command = [server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--dir", str(folder)]
    command += ["--save", "", "--appendonly", "yes", "--appendfsync", "always"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until_ready(port, process, 10)
        yield process
    finally:
        process.terminate()
        process.wait(timeout=10)


async def test_a_commit_outlasts_a_redis_restart_and_later_messages_wait_behind_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    port = free_port()
    agent = HeldFirst()

    caplog.set_level(logging.WARNING)
    with persistent_redis(tmp_path, port) as server:
        store = await open_store(f"redis://127.0.0.1:{port}/0")
        try:
            async with GatewayHarness(agent, store=store) as h:
                first = await h.send("first", chat_id="c")
                await agent.running.wait()
                server.terminate()  # the outage: the server is gone
                await asyncio.to_thread(server.wait, 10)
                agent.go.set()
                await eventually(lambda: "commit failed, retrying" in caplog.text)
                with persistent_redis(tmp_path, port):  # back, with its data
                    await h.send("second", chat_id="c")
                    assert await answers(h, 2) == ["answer first", "answer second"]
                    assert await store.pending(first.session_key) == []
                    assert await store.failed() == []
        finally:
            await store.close()
    assert "never retrieved" not in caplog.text
    assert "could not settle" not in caplog.text
