"""The delivery ledger across real processes: ``kill -9`` at each point of a reply's way out.

Each test runs gateway processes on one store (SQLite, Redis) whose replies go
through the ledger to a platform stand-in over HTTP, kills one at a point, and
ends with every message answered and delivered, a duplicate only where it is
labelled. The points: before the commit, after the commit and before the
send, during the send, after the send and before it is marked delivered.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import signal
import subprocess
import sys
import threading
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from chatlane.stores import open_store
from chatlane.stores.base import PENDING
from tests.delivery.platform_server import PlatformServer, Received
from tests.multiprocess.cluster import ROOT, Cluster, Worker
from tests.stores.conftest import forget_redis_prefix

pytestmark = pytest.mark.slow


@dataclass
class Gateways(Cluster):
    """Gateway processes of :mod:`tests.delivery.process` on one store and one platform."""

    platform_url: str = ""
    claim_ttl: float = 2.0
    changed: threading.Condition = field(default_factory=threading.Condition)
    """Notified after each event a gateway logged (and, shared, each message the platform took)."""
    heard: list[dict[str, Any]] = field(default_factory=list)
    """Every event the gateways printed, in the order heard."""
    ids: defaultdict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    """Event name → the message ids of its events, so far."""

    def start(self, name: str, fault: str = "none") -> Worker:
        command = [
            sys.executable,
            "-m",
            "tests.delivery.process",
            *("--store", self.store_url, "--log", str(self.log_path), "--name", name),
            *("--platform", self.platform_url, "--fault", fault),
            *("--ttl", str(self.ttl), "--claim-ttl", str(self.claim_ttl)),
        ]
        process = subprocess.Popen(command, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        worker = Worker(name, process)
        self.workers.append(worker)  # stopped at the end even if it never says it is ready
        assert process.stdout is not None
        while (line := process.stdout.readline()).strip() != b"ready":
            # a restarted gateway may adopt a dead one's turn before it says it is ready
            assert line.startswith(b"{"), f"gateway {name} did not start: {line!r}"
            self._hear(line)
        threading.Thread(target=self._follow, args=(process,), daemon=True).start()
        return worker

    def _follow(self, process: subprocess.Popen[bytes]) -> None:
        """Keep each event ``process`` prints, and wake every waiter after it."""
        assert process.stdout is not None
        for line in process.stdout:
            self._hear(line)

    def _hear(self, line: bytes) -> None:
        event = json.loads(line)
        with self.changed:
            self.heard.append(event)
            self.ids[event["event"]].update(event["ids"])
            self.changed.notify_all()

    def events(self) -> list[dict[str, Any]]:
        """Every event heard so far (read from the gateways' stdout, not the file)."""
        with self.changed:
            return list(self.heard)

    def logged_ids(self, event: str) -> set[str]:
        """The message ids of every ``event`` heard so far."""
        with self.changed:
            return set(self.ids[event])

    def wait(self, condition: Callable[[], bool], what: str, timeout: float = 30) -> None:
        """Return once ``condition()`` holds, checked again after each event or platform send."""
        with self.changed:
            assert self.changed.wait_for(condition, timeout), f"timed out waiting for {what}"

    def kill(self, worker: Worker) -> None:
        worker.signal(signal.SIGKILL)
        worker.process.wait(timeout=10)

    def logged(self, event: str, message_id: str) -> bool:
        return message_id in self.logged_ids(event)


@pytest.fixture(params=["sqlite", "redis"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'chatlane.db'}"
        return
    server: str = request.getfixturevalue("redis_url")
    separator = "&" if "?" in server else "?"
    url = f"{server}{separator}prefix=ledger-{secrets.token_hex(6)}"
    yield url
    asyncio.run(forget_redis_prefix(url))


@pytest.fixture
def platform() -> Iterator[PlatformServer]:
    with PlatformServer() as server:
        yield server


@pytest.fixture
def gateways(store_url: str, platform: PlatformServer, tmp_path: Path) -> Iterator[Gateways]:
    made = Gateways(
        store_url, tmp_path / "events.jsonl", platform_url=platform.url, changed=platform.changed
    )
    try:
        yield made
    finally:
        made.stop_all()


def replies_to(platform: PlatformServer, message_id: str) -> list[Received]:
    return [r for r in platform.received() if message_id in r.ids]


def ledger_state(url: str) -> tuple[int, list[str]]:
    """How many deliveries are pending, and whether each given message is answered."""

    async def read() -> tuple[int, list[str]]:
        store = await open_store(url)
        try:
            pending = await store.deliveries(PENDING)
            return len(pending), [d.id for d in pending]
        finally:
            await store.close()

    return asyncio.run(read())


def answered(url: str, message_id: str) -> bool:
    async def read() -> bool:
        store = await open_store(url)
        try:
            return await store.is_answered(message_id)
        finally:
            await store.close()

    return asyncio.run(read())


def delivered_once_or_labelled(platform: PlatformServer, message_id: str) -> list[bool]:
    """The labels of every reply to ``message_id``; every one after the first is labelled."""
    replies = replies_to(platform, message_id)
    assert replies, f"no reply to {message_id}"
    assert all(r.labelled for r in replies[1:]), replies
    assert {r.text for r in replies} == {replies[0].text}
    return [r.labelled for r in replies]


def finish(gateways: Gateways, platform: PlatformServer, message_id: str) -> list[bool]:
    """Wait until ``message_id`` is answered, delivered and settled; its replies' labels."""
    gateways.wait(lambda: bool(replies_to(platform, message_id)), f"a reply to {message_id}")
    gateways.wait(lambda: ledger_state(gateways.store_url)[0] == 0, "an empty ledger")
    assert answered(gateways.store_url, message_id)
    return delivered_once_or_labelled(platform, message_id)


def test_killed_before_the_commit(gateways: Gateways, platform: PlatformServer) -> None:
    first = gateways.start("a1")
    first.send("c1", "sleep 3", "m1")  # killed during it; run again in full elsewhere
    gateways.wait(lambda: gateways.logged("start", "m1"), "the turn to start")
    gateways.kill(first)
    gateways.start("b1")  # adopts the message once a1's heartbeat is gone, runs it again
    assert finish(gateways, platform, "m1") == [False]


def test_killed_after_the_commit_before_the_send(
    gateways: Gateways, platform: PlatformServer
) -> None:
    first = gateways.start("a1", fault="disconnected")
    first.send("c1", "hello", "m1")
    gateways.wait(lambda: gateways.logged("outcome", "m1"), "the reply's commit")
    assert ledger_state(gateways.store_url)[0] == 1  # committed: in the ledger, never sent
    gateways.kill(first)
    gateways.start("b1")
    assert finish(gateways, platform, "m1") == [False]  # never claimed: nothing to label


def test_killed_during_the_send(gateways: Gateways, platform: PlatformServer) -> None:
    platform.hold = True  # the platform takes the message and never answers
    first = gateways.start("a1")
    first.send("c1", "hello", "m1")
    gateways.wait(lambda: platform.held == 1, "the send to reach the platform")
    gateways.kill(first)
    gateways.start("b1")  # claims it again once a1's claim expires
    assert finish(gateways, platform, "m1") == [False, True]


def test_killed_after_the_send_before_the_mark(
    gateways: Gateways, platform: PlatformServer
) -> None:
    first = gateways.start("a1", fault="after-send")
    first.send("c1", "hello", "m1")
    gateways.wait(lambda: gateways.logged("sent", "m1"), "the platform to take the reply")
    gateways.kill(first)
    gateways.start("b1")
    assert finish(gateways, platform, "m1") == [False, True]


def test_killed_after_the_claim_before_the_send(
    gateways: Gateways, platform: PlatformServer
) -> None:
    first = gateways.start("a1", fault="before-send")
    first.send("c1", "hello", "m1")
    gateways.wait(lambda: gateways.logged("claimed", "m1"), "the claim")
    gateways.kill(first)
    gateways.start("b1")
    # the chat saw it once; the re-send is labelled, since b1 cannot know a1 never sent it
    assert finish(gateways, platform, "m1") == [True]


def test_later_replies_keep_their_order_behind_a_killed_send(
    gateways: Gateways, platform: PlatformServer
) -> None:
    platform.hold = True
    first = gateways.start("a1")
    for n in range(5):
        first.send("c1", f"m{n}", f"m{n}")
    gateways.wait(lambda: platform.held == 1, "the first send to reach the platform")
    gateways.kill(first)
    second = gateways.start("b1")
    for n in range(5):
        finish(gateways, platform, f"m{n}")
    firsts = []
    for reply in platform.received():
        if reply.ids[0] not in firsts:
            firsts.append(reply.ids[0])
    assert firsts == [f"m{n}" for n in range(5)]
    second.quit()
