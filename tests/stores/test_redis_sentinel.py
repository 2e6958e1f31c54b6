"""The Redis store behind Sentinel, against real processes: a primary, a replica, three sentinels.

The primary is killed (``SIGKILL``) while messages flow; the sentinels promote
the replica, the killed primary comes back as its replica, and the gateway
carries on through the ``redis+sentinel://`` URL. Every message the gateway
accepted is answered exactly once, and no session ever runs two turns at once.
Writes wait for a replica (``wait_replicas=1``), so nothing acknowledged before
the kill lives on the dead primary alone.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import tempfile
from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from chatlane import testing_redis
from chatlane.errors import ChatlaneError, StoreError
from chatlane.identity import SessionSource
from chatlane.runtime.turn import Turn
from chatlane.stores import open_store
from chatlane.stores.redis_sentinel import parse_sentinel_url
from chatlane.stores.resp import Endpoint, RespClient
from chatlane.testing import GatewayHarness
from chatlane.testing_redis import free_port, server_binary
from chatlane.types import InboundMessage

PRIMARY_NAME = "chatlane-main"
SESSIONS = 12
MESSAGES = 240
KILL_AFTER = 80
REPLIES_WITHIN = 60.0
"""Seconds for every reply to arrive once the last message was accepted."""


@dataclass
class Node:
    """One redis-server process of the setup."""

    port: int
    args: list[str]
    process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            self.args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
        )
        testing_redis.wait_until_ready(self.port, self.process, 10.0)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=10)


@dataclass
class Setup:
    primary: Node
    replica: Node
    sentinels: list[Node] = field(default_factory=list)

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return (
            f"redis+sentinel://{hosts}/{PRIMARY_NAME}/0?prefix=failover"
            "&wait_replicas=1&wait_timeout=0.5&socket_timeout=1&socket_connect_timeout=1"
        )


@contextmanager
def sentinel_setup() -> Iterator[Setup]:
    try:
        binary = server_binary()
    except testing_redis.TestServerError as error:
        pytest.skip(str(error))
    with tempfile.TemporaryDirectory(prefix="chatlane-sentinel-") as folder:
        setup = _started(binary, Path(folder))
        try:
            yield setup
        finally:
            _stop(setup)


def _started(binary: str, base: Path, attempts: int = 3) -> Setup:
    """Start the setup, on other ports if a server took one of its ports meanwhile."""
    for attempt in range(1, attempts + 1):
        setup = _planned(binary, base / f"try-{attempt}")
        try:
            for node in (setup.primary, setup.replica, *setup.sentinels):
                node.start()
        except BaseException as error:
            _stop(setup)
            if not isinstance(error, testing_redis.PortTaken) or attempt == attempts:
                raise
        else:
            return setup
    raise AssertionError("unreachable")


def _planned(binary: str, base: Path) -> Setup:
    base.mkdir()
    primary, replica = free_port(), free_port()
    setup = Setup(
        Node(primary, _data_node(binary, base / "primary", primary)),
        Node(
            replica,
            [
                *_data_node(binary, base / "replica", replica),
                "--replicaof",
                "127.0.0.1",
                str(primary),
            ],
        ),
    )
    for n in range(3):
        port = free_port()
        config = base / f"sentinel-{n}.conf"
        config.write_text(_sentinel_config(port, primary))
        setup.sentinels.append(Node(port, [binary, str(config), "--sentinel"]))
    return setup


def _stop(setup: Setup) -> None:
    for node in (*setup.sentinels, setup.replica, setup.primary):
        node.stop()


def _data_node(binary: str, folder: Path, port: int) -> list[str]:
    folder.mkdir()
    return [binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--dir", str(folder)]


def _sentinel_config(port: int, primary: int) -> str:
    return "\n".join(
        (
            f"port {port}",
            "bind 127.0.0.1",
            f"sentinel monitor {PRIMARY_NAME} 127.0.0.1 {primary} 2",
            f"sentinel down-after-milliseconds {PRIMARY_NAME} 500",
            f"sentinel failover-timeout {PRIMARY_NAME} 4000",
            "",
        )
    )


async def ask(port: int, *command: str | int) -> object:
    client = RespClient(Endpoint(port=port), retries=0)
    try:
        return await client.execute(*command)
    finally:
        await client.close()


async def until(check: object, what: str, limit: float = 60.0) -> None:
    """Ask ``check()`` again, 0.05 s apart, until it holds (for at most ``limit`` seconds)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit
    while loop.time() < deadline:
        try:
            if await check():  # type: ignore[operator]
                return
        except (ConnectionError, OSError):
            pass
        await asyncio.sleep(0.05)  # polling other processes: nothing here to await
    raise AssertionError(f"never: {what}")


async def primary_port(setup: Setup) -> int:
    reply = await ask(setup.sentinels[0].port, "SENTINEL", "get-master-addr-by-name", PRIMARY_NAME)
    assert isinstance(reply, list)
    return int(reply[1])


async def ready(setup: Setup) -> None:
    """Until the replica is in sync and every sentinel knows it and the other two."""

    async def synced() -> bool:
        info = await ask(setup.replica.port, "INFO", "replication")
        return isinstance(info, bytes) and b"master_link_status:up" in info

    async def known() -> bool:
        for sentinel in setup.sentinels:
            replicas = await ask(sentinel.port, "SENTINEL", "replicas", PRIMARY_NAME)
            others = await ask(sentinel.port, "SENTINEL", "sentinels", PRIMARY_NAME)
            if not (
                isinstance(replicas, list)
                and replicas
                and isinstance(others, list)
                and len(others) == 2
            ):
                return False
        return True

    await until(synced, "the replica is in sync")
    await until(known, "every sentinel knows the replica and the other sentinels")


class OneTurnAtATime:
    """Answers ``done <text>``; records turns running at once per session, and every run."""

    def __init__(self) -> None:
        self.running: Counter[str] = Counter()
        self.overlaps = 0
        self.runs: Counter[str] = Counter()

    async def __call__(self, turn: Turn) -> str:
        key = turn.session_key
        self.running[key] += 1
        self.overlaps += self.running[key] > 1
        try:
            await asyncio.sleep(0)
            self.runs[turn.text] += 1
            return f"done {turn.text}"
        finally:
            self.running[key] -= 1


async def send_until_accepted(h: GatewayHarness, text: str, chat: str) -> None:
    """Send until the gateway takes the message; a retry carries the same message id.

    A store error means the gateway did not take it — or cannot say (the reply
    was lost): the same id makes the store keep one record of it either way.
    """
    message = InboundMessage(SessionSource("test", chat_id=chat, user_id="u1"), text, id=text)
    for _ in range(200):
        try:
            await h.gateway.dispatch(message)
            return
        except ChatlaneError:
            continue  # the sender retries, as a client would
    raise AssertionError(f"{text} was never accepted")


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_a_failover_loses_no_accepted_message_and_keeps_one_turn_per_session() -> None:
    with sentinel_setup() as setup:
        await ready(setup)
        agent = OneTurnAtATime()
        store = await open_store(setup.url)
        sent: defaultdict[str, list[str]] = defaultdict(list)
        async with GatewayHarness(agent, store=store) as h:
            for n in range(MESSAGES):
                if n == KILL_AFTER:
                    setup.primary.kill()
                chat = f"s{n % SESSIONS}"
                await send_until_accepted(h, f"m{n}", chat)
                sent[chat].append(f"done m{n}")
                if n == KILL_AFTER + 10:  # promoted by now or soon: the old primary comes back
                    await until(lambda: _moved(setup), "a replica was promoted")
                    await asyncio.to_thread(setup.primary.start)  # the gateway's loop runs on
            replies = await every_reply(h, sent)
            for chat, expected in sent.items():
                assert sorted(replies[chat]) == sorted(expected)
            await h.settle(timeout=60)
        await store.close()
        assert await primary_port(setup) == setup.replica.port
    assert agent.overlaps == 0
    assert set(agent.runs.values()) == {1}  # each message ran once
    assert len(agent.runs) == MESSAGES


async def every_reply(h: GatewayHarness, sent: dict[str, list[str]]) -> dict[str, list[str]]:
    """The first replies to each chat, as many as it was sent messages (REPLIES_WITHIN in all).

    :raises AssertionError: naming the replies that never came.
    """
    try:
        async with asyncio.timeout(REPLIES_WITHIN):
            return {
                chat: await h.replies(chat_id=chat, count=len(expected), timeout=REPLIES_WITHIN)
                for chat, expected in sent.items()
            }
    except TimeoutError:
        missing = [
            text
            for chat, expected in sent.items()
            for text in sorted(set(expected) - {o.text for o in h.delivered(chat_id=chat)})
        ]
        raise AssertionError(f"accepted, never answered: {missing}") from None


async def _moved(setup: Setup) -> bool:
    return await primary_port(setup) == setup.replica.port


async def test_a_sentinel_url_is_checked_and_its_passwords_never_shown() -> None:
    parsed = parse_sentinel_url(
        "redis+sentinel://:data-secret@h1,h2:26380/main/3?sentinel_password=s-secret&prefix=p"
    )
    assert parsed.sentinels == (("h1", 26379), ("h2", 26380))
    assert (parsed.primary, parsed.password) == ("main", "s-secret")
    assert parsed.redis_url == "redis://:data-secret@sentinel-primary/3?prefix=p"
    for bad, why in (
        ("redis+sentinel://h1:notaport/main?sentinel_password=s-secret", "host\\[:port\\]"),
        ("redis+sentinel://:data-secret@h1/?sentinel_password=s-secret", "name the primary"),
    ):
        with pytest.raises(StoreError, match=why) as caught:
            parse_sentinel_url(bad)
        assert "secret" not in str(caught.value)


async def test_unreachable_sentinels_are_a_clear_error_at_open() -> None:
    dead = ",".join(f"127.0.0.1:{free_port()}" for _ in range(2))
    with pytest.raises(StoreError, match="no sentinel named primary 'main'"):
        await open_store(f"redis+sentinel://{dead}/main?socket_connect_timeout=0.5")
