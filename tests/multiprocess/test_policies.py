"""Every busy policy across two real processes: messages of each session sent to either.

Two worker processes share one store. Each session gets a busy policy
(``/busy``), then its messages go to one worker or the other at random, some
holding their turn a little (``sleep``), so messages keep arriving at a process
while the other one runs the session: they are queued, collected or steered
there (drawn in), interrupt it, or redirect it. Checked from the log the
workers share, for every session and message:

* every message ends in exactly one outcome, in the process that accepted it;
  nothing is lost, and only ``rollback`` sessions have interrupted messages (and
  ``redirect`` ones whose turn found no safe point within ``interrupt_grace``,
  as a burst can delay a turn's end that long: it is rolled back then).
  Should the burst (10,000 messages into each process at once) hold a
  process's heartbeat past the TTL, the other takes it for dead and adopts its
  messages: then both end such a message, with the same outcome (except that
  a message interrupted in the process that accepted it is ``dropped`` for
  the adopter, which sees only that it left the queue unanswered);
* no message is answered by two turns, and every answered one was answered
  by a turn that ran it (or took it steered);
* a session's turns that kept their lease never overlap, and their generations grow;
* of the messages one process accepted for a session, each was first run
  after the ones it accepted before (store order within one process).
"""

from __future__ import annotations

import asyncio
import itertools
import random
import secrets
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from chatlane.runtime.leases import LeaseSettings
from tests.multiprocess.cluster import Cluster, answered_ids, turn_intervals
from tests.stores.conftest import forget_store

pytestmark = pytest.mark.slow

POLICIES = ("queue", "collect", "steer", "interrupt", "redirect")
SESSIONS = 1_000
MESSAGES = 20
TTL = LeaseSettings().ttl
"""The default lease TTL. Heartbeats and renewals jump the SQLite writer's queue, so
the burst below no longer holds a heartbeat back past it; should a loaded machine
still do so, a process taken for dead has its messages adopted by the other."""


@pytest.fixture(params=["sqlite", "redis"])
def cluster(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Cluster]:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'shared.db'}"
    else:
        base: str = request.getfixturevalue("redis_url")
        url = f"{base}{'&' if '?' in base else '?'}prefix=mpp-{secrets.token_hex(6)}"
    cluster = Cluster(url, tmp_path / "events.jsonl", ttl=TTL, options=("--ordered",))
    yield cluster
    cluster.stop_all()
    asyncio.run(forget_store(url))


def outcomes(events: list[dict[str, Any]]) -> defaultdict[str, dict[str, list[str]]]:
    """Message id → worker → the outcomes that worker emitted for it."""
    ended: defaultdict[str, dict[str, list[str]]] = defaultdict(dict)
    for event in events:
        if event["event"] == "outcome":
            ended[event["ids"][0]].setdefault(event["worker"], []).append(event["outcome"])
    return ended


def seen_leave(adopter: list[str], accepter: list[str]) -> bool:
    """Whether the adopter saw a message leave the store's queue unanswered while the
    process that accepted it ended it unanswered too (its turn interrupted there): the
    store keeps no reason, so the adopter can only say ``dropped``."""
    return adopter == ["dropped"] and accepter[0] in ("interrupted", "dropped")


@pytest.mark.timeout(600)
def test_every_policy_across_two_processes_loses_nothing_and_answers_once(
    cluster: Cluster,
) -> None:
    workers = [cluster.start(f"w{n}") for n in range(2)]
    chats = [f"pol-{n}" for n in range(SESSIONS)]
    policy_of = {chat: POLICIES[n % len(POLICIES)] for n, chat in enumerate(chats)}
    for chat in chats:
        workers[0].send(chat, f"/busy {policy_of[chat]}", f"{chat}-busy")
    busy_ids = [f"{chat}-busy" for chat in chats]
    cluster.wait_for(lambda ev: set(busy_ids) <= set(answered_ids(ev)), 60, "every /busy answer")

    rng = random.Random(5)
    sent_to: dict[str, str] = {}
    sent: dict[str, list[str]] = {chat: [] for chat in chats}
    for index in range(MESSAGES):
        for chat in chats:
            message_id = f"{chat}-m{index}"
            worker = rng.choice(workers)
            text = "sleep 0.2" if rng.random() < 0.3 else f"hello {index}"
            worker.send(chat, text, message_id)
            sent_to[message_id] = worker.name
            sent[chat].append(message_id)
    every = [message_id for ids in sent.values() for message_id in ids]

    def all_ended(events: list[dict[str, Any]]) -> bool:
        ended = outcomes(events)
        return all(sent_to[m] in ended[m] for m in every)

    events = cluster.wait_for(all_ended, 300, "every message's outcome where it was sent")

    ended = outcomes(events)
    adopted = {i for event in events if event["event"] == "adopted" for i in event["ids"]}
    fate: dict[str, str] = {}
    for message_id in every:
        by_worker = ended[message_id]
        mine = by_worker.get(sent_to[message_id], [])
        expected = 1 if message_id not in adopted else len(mine)  # taken back and forth
        assert mine, f"{message_id}: no outcome where it was sent"
        assert len(mine) == expected, f"{message_id}: {by_worker}"
        assert len(set(mine)) == 1, f"{message_id}: {by_worker}"
        fate[message_id] = mine[0]
        for name, theirs in by_worker.items():  # a process taken for dead: both end it
            if name != sent_to[message_id]:
                assert message_id in adopted, (message_id, by_worker)
                assert theirs == mine or seen_leave(theirs, mine), (message_id, by_worker)
    kinds = Counter(fate.values())
    interrupted = {m for m in every if fate[m] == "interrupted"}
    rolling_back = {"interrupt", "redirect"}  # past interrupt_grace a redirect rolls back
    assert all(policy_of[m.rsplit("-", 1)[0]] in rolling_back for m in interrupted)
    assert set(kinds) <= {"answered", "interrupted"}, kinds

    answered_by: defaultdict[str, list[int]] = defaultdict(list)
    for event in events:
        if event["event"] == "end" and event["current"]:
            for message_id in event["answers"]:
                answered_by[message_id].append(event["gen"])
    replies = Counter(
        message_id
        for event in events
        if event["event"] == "deliver" and event["kind"] == "reply"
        for message_id in event["ids"]
    )
    for message_id in every:
        assert replies[message_id] <= 1, f"{message_id} was answered {replies[message_id]} times"
        if fate[message_id] == "answered":
            assert answered_by[message_id], f"{message_id} answered by no turn that ran it"

    lost = {(e["key"], e["gen"]) for e in events if e["event"] == "end" and not e["current"]}
    kept = [
        e for e in events if e["event"] not in ("start", "end") or (e["key"], e["gen"]) not in lost
    ]
    for key, spans in turn_intervals(kept).items():  # the turns that kept their lease
        for (_, end, gen), (start, _, next_gen) in itertools.pairwise(spans):
            assert end <= start, f"two turns of {key} overlapped"
            assert next_gen > gen, f"generations of {key} did not increase"

    first_run: dict[str, int] = {}
    for event in events:
        if event["event"] == "start":
            for position, message_id in enumerate(event["ids"]):
                first_run.setdefault(message_id, event["t"] * 1000 + position)
    for chat, ids in sent.items():
        for worker in workers:
            mine = [m for m in ids if sent_to[m] == worker.name and m in first_run]
            runs = [first_run[m] for m in mine]
            assert runs == sorted(runs), f"{chat}: {worker.name}'s messages ran out of order"
    drawn = sum(1 for event in events if event["event"] == "drawn")
    print(f"\noutcomes {dict(kinds)}; drawn into another process's turn {drawn}; "
          f"adopted from a process taken for dead {len(adopted)}")  # fmt: skip
