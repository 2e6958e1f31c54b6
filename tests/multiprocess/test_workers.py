"""Several real gateway processes sharing one store behave as one gateway.

Each test starts worker processes (``tests/multiprocess/worker.py``) on one
SQLite file or one Redis namespace and checks, from the log they share:
never two turns of one session at once, every message answered exactly once,
generations strictly increasing, crashed and paused workers fenced off, and
nothing lost across a restart.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import secrets
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from chatlane.stores import open_store
from tests.multiprocess.cluster import Cluster, answered_ids, turn_intervals
from tests.stores.conftest import forget_store, own_schema

pytestmark = pytest.mark.slow


@pytest.fixture(params=["sqlite", "redis", "postgres"])
def cluster(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Cluster]:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'shared.db'}"
    elif request.param == "postgres":
        url = own_schema(request.getfixturevalue("postgres_url"), "mp")
    else:
        base: str = request.getfixturevalue("redis_url")
        url = f"{base}{'&' if '?' in base else '?'}prefix=mp-{secrets.token_hex(6)}"
    cluster = Cluster(url, tmp_path / "events.jsonl")
    yield cluster
    cluster.stop_all()
    asyncio.run(forget_store(url))


def all_answered(ids: list[str]) -> Any:
    return lambda events: all(answered_ids(events).get(i) for i in ids)


def acked(message_id: str) -> Any:
    """Whether ``message_id`` was acknowledged: it is in the store, waiting for a turn."""
    return lambda events: any(
        e["event"] == "deliver" and e["kind"] == "ack" and message_id in e["ids"] for e in events
    )


@pytest.mark.timeout(300)
def test_four_workers_behave_as_one(cluster: Cluster) -> None:
    cluster.ttl = 10.0  # no worker loses a lease to a noisy machine: every message runs once
    workers = [cluster.start(f"w{n}") for n in range(4)]
    rng = random.Random(4)
    ids = []
    for index in range(10):
        for session in range(200):
            message_id = f"s{session}-m{index}"
            rng.choice(workers).send(f"chat-{session}", f"hello {index}", message_id)
            ids.append(message_id)
    events = cluster.wait_for(all_answered(ids), timeout=240, what="every message answered")

    answers = answered_ids(events)
    twice = {i: a for i, a in answers.items() if i in ids and len(a) != 1}
    assert twice == {}, "a message was answered more than once"
    intervals = turn_intervals(events)
    assert len(intervals) == 200
    for key, spans in intervals.items():
        for (_, end, gen), (start, _, next_gen) in itertools.pairwise(spans):
            assert end <= start, f"two turns of {key} overlapped"
            assert next_gen > gen, f"generations of {key} did not increase"
    runs = sum(len(spans) for spans in intervals.values())
    assert runs == len(ids)


def test_killed_worker_message_is_rerun_and_answered_once(cluster: Cluster) -> None:
    victim, survivor = cluster.start("victim"), cluster.start("survivor")
    victim.send("crash-chat", "sleep 3", "crash-1")
    cluster.wait_for(lambda ev: any(e["event"] == "start" for e in ev), 10, "the turn to start")
    victim.signal(signal.SIGKILL)
    events = cluster.wait_for(all_answered(["crash-1"]), 15, "the adopted message's answer")

    [answer] = answered_ids(events)["crash-1"]
    assert answer["worker"] == "survivor"
    assert answer["kind"] == "reply"
    starts = [e for e in events if e["event"] == "start"]
    assert [e["worker"] for e in starts] == ["victim", "survivor"]
    assert starts[1]["gen"] > starts[0]["gen"]
    survivor.send("crash-chat", "after", "crash-2")
    cluster.wait_for(all_answered(["crash-2"]), 10, "the next message")


def test_paused_worker_cannot_write_or_reply(cluster: Cluster) -> None:
    paused, _taker = cluster.start("paused"), cluster.start("taker")
    paused.send("pause-chat", "sleep 1.5", "pause-1")
    cluster.wait_for(lambda ev: any(e["event"] == "start" for e in ev), 10, "the turn to start")
    cluster.pause(paused)
    cluster.wait_for(all_answered(["pause-1"]), 20, "the taker's answer")
    paused.signal(signal.SIGCONT)
    events = cluster.wait_for(
        lambda ev: any(e["event"] == "write" and e["worker"] == "paused" for e in ev),
        10,
        "the paused worker's late write",
    )
    time.sleep(1.0)
    events = cluster.events()

    from_paused = [e for e in events if e["worker"] == "paused"]
    writes = [e["result"] for e in from_paused if e["event"] == "write"]
    deliveries = [e for e in from_paused if e["event"] == "deliver"]
    assert writes, "the paused worker never tried its late write"
    assert set(writes) == {"refused"}, writes
    assert deliveries == [], "the paused worker delivered after losing its lease"
    [answer] = answered_ids(events)["pause-1"]
    assert answer["worker"] == "taker"


def test_stop_sent_to_another_worker_interrupts_the_turn_at_once(cluster: Cluster) -> None:
    cluster.ttl = 30.0  # renewals every 10 s: only the fence check can stop the turn sooner
    runner, other = cluster.start("runner"), cluster.start("other")
    runner.send("stop-chat", "sleep 30", "stop-1")
    cluster.wait_for(lambda ev: any(e["event"] == "start" for e in ev), 10, "the turn to start")
    other.send("stop-chat", "/stop", "stop-2")
    events = cluster.wait_for(
        lambda ev: (
            any(e["event"] == "end" and e["worker"] == "runner" for e in ev)
            and bool(answered_ids(ev).get("stop-2"))
        ),
        5,
        "the runner's turn to end and /stop to answer",
    )
    [stopped] = answered_ids(events)["stop-2"]
    [end] = [e for e in events if e["event"] == "end"]
    assert (end["t"] - stopped["t"]) / 1e9 < 3
    events = cluster.wait_for(
        lambda ev: any(e["event"] == "write" for e in ev), 5, "the runner's late write"
    )
    assert [e["result"] for e in events if e["event"] == "write"] == ["refused"]
    assert "stop-1" not in answered_ids(events)


def test_a_message_to_another_worker_interrupts_the_turn_under_interrupt(
    cluster: Cluster,
) -> None:
    cluster.ttl = 30.0
    runner, other = cluster.start("runner"), cluster.start("other")
    runner.send("int-chat", "/busy interrupt", "int-0")
    cluster.wait_for(all_answered(["int-0"]), 10, "the /busy answer")
    runner.send("int-chat", "sleep 30", "int-1")
    cluster.wait_for(lambda ev: any(e["event"] == "start" for e in ev), 10, "the turn to start")
    other.send("int-chat", "hello", "int-2")
    events = cluster.wait_for(all_answered(["int-2"]), 10, "the interrupting message's answer")

    [answer] = answered_ids(events)["int-2"]
    assert (answer["worker"], answer["text"]) == ("other", "done hello")
    acks = [e["text"] for e in events if e["event"] == "deliver" and e["kind"] == "ack"]
    assert acks == ["Interrupting the current task"]
    starts = [(e["worker"], e["ids"]) for e in events if e["event"] == "start"]
    assert starts == [("runner", ["int-1"]), ("other", ["int-2"])]
    assert "int-1" not in answered_ids(events)


@pytest.mark.timeout(300)
def test_a_message_to_another_worker_is_collected_into_the_running_workers_next_turn(
    cluster: Cluster,
) -> None:
    cluster.ttl = 30.0
    runner, other = cluster.start("runner"), cluster.start("other")
    runner.send("col-chat", "/busy collect", "col-0")
    cluster.wait_for(all_answered(["col-0"]), 10, "the /busy answer")
    runner.send("col-chat", "sleep 10", "col-1")
    cluster.wait_for(lambda ev: any(e["event"] == "start" for e in ev), 10, "the turn to start")
    other.send("col-chat", "hello", "col-2")
    cluster.wait_for(lambda ev: any(e["event"] == "drawn" for e in ev), 10, "the message drawn in")
    events = cluster.wait_for(all_answered(["col-1", "col-2"]), 30, "both answers")

    [answer] = answered_ids(events)["col-2"]
    assert (answer["worker"], answer["text"]) == ("runner", "done hello")
    starts = [(e["worker"], e["ids"]) for e in events if e["event"] == "start"]
    assert starts == [("runner", ["col-1"]), ("runner", ["col-2"])]  # the other ran nothing


@pytest.mark.timeout(300)
def test_interrupts_across_workers_lose_nothing_and_never_overlap(cluster: Cluster) -> None:
    cluster.ttl = 10.0
    workers = [cluster.start(f"w{n}") for n in range(2)]
    chats = [f"ix-{n}" for n in range(20)]
    for chat in chats:
        workers[0].send(chat, "/busy interrupt", f"{chat}-busy")
    cluster.wait_for(all_answered([f"{c}-busy" for c in chats]), 30, "every /busy answer")
    rng = random.Random(11)
    ids = []
    for index in range(6):
        for chat in chats:
            text = "sleep 0.3" if rng.random() < 0.5 else f"hello {index}"
            rng.choice(workers).send(chat, text, f"{chat}-m{index}")
            ids.append(f"{chat}-m{index}")
        time.sleep(rng.uniform(0, 0.2))
    last = [f"{chat}-m5" for chat in chats]  # nothing comes after it to interrupt it
    cluster.wait_for(all_answered(last), 120, "every chat's last answer")
    time.sleep(1.0)
    events = cluster.events()

    answers = answered_ids(events)
    started = {i for e in events if e["event"] == "start" for i in e["ids"]}
    for message_id in ids:
        count = len(answers.get(message_id, []))
        assert count <= 1, f"{message_id} was answered {count} times"
        assert count == 1 or message_id in started, f"{message_id} neither ran nor was answered"
    for key, spans in turn_intervals(events).items():
        for (_, end, gen), (start, _, next_gen) in itertools.pairwise(spans):
            assert end <= start, f"two turns of {key} overlapped"
            assert next_gen > gen, f"generations of {key} did not increase"
    superseded = [e["detail"] for e in events if e["event"] == "superseded"]
    assert any("another process" in detail for detail in superseded), superseded


def test_restart_keeps_generations_queue_and_transcript(cluster: Cluster) -> None:
    first = cluster.start("first")
    first.send("restart-chat", "/busy collect", "r-0")
    first.send("restart-chat", "one", "r-1")
    cluster.wait_for(all_answered(["r-1"]), 10, "the first answer")
    first.send("restart-chat", "sleep 3", "r-2")
    cluster.wait_for(lambda ev: sum(e["event"] == "start" for e in ev) == 2, 10, "a long turn")
    first.send("restart-chat", "queued behind", "r-3")
    cluster.wait_for(acked("r-3"), 10, "the queued message stored and acknowledged")
    first.quit()

    second = cluster.start("second")
    second_events = cluster.wait_for(all_answered(["r-3"]), 45, "the queued message after restart")
    starts = [e for e in second_events if e["event"] == "start"]
    assert [e["worker"] for e in starts] == ["first", "first", "second", "second"]
    generations = [e["gen"] for e in starts]
    assert generations == sorted(set(generations)), generations
    second.send("restart-chat", "/status", "r-4")
    [status] = answered_ids(cluster.wait_for(all_answered(["r-4"]), 10, "status"))["r-4"]
    assert "busy policy: collect (session)" in status["text"]
    second.quit()

    async def stored() -> tuple[int, list[str]]:
        store = await open_store(cluster.store_url)
        try:
            key = starts[0]["key"]
            transcript = await store.transcript(key)
            return await store.generation(key), [e.content for e in transcript]
        finally:
            await store.close()

    generation, contents = asyncio.run(stored())
    assert generation >= generations[-1]
    assert contents[:2] == ["one", "done one"]
    assert contents[-2:] == ["queued behind", "done queued behind"]
