"""Load alone, with no fault at all, loses nothing: thousands of long turns on two processes.

Two real worker processes share one store (SQLite or Redis) with the default
lease TTL; each accepts half of :data:`SESSIONS` messages at once, one per
session, and each message holds its turn for :data:`TURN_SECONDS` (six
TTLs). Upkeep must keep up with all of them: every message is answered
exactly once by the turn that first ran it (generation 1, never run twice:
neither process was ever taken for dead), and every lease was renewed in
time: no renewal was refused, no lease was lost, and each turn still held a
live lease when it ended. How late heartbeats came is printed, never checked
against a clock: a loaded machine may delay them, and what a delay must never
cost (a lease, a rerun, an answer) is what is checked.
"""

from __future__ import annotations

import asyncio
import secrets
import signal
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from chatlane.runtime.leases import LeaseSettings
from tests.multiprocess.cluster import Cluster, answered_ids
from tests.stores.conftest import forget_store, own_schema

pytestmark = pytest.mark.slow

SESSIONS = 3000
TURN_SECONDS = 60
DEFAULTS = LeaseSettings()


@pytest.fixture(params=["sqlite", "redis", "postgres"])
def default_ttl_cluster(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Cluster]:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'shared.db'}"
    elif request.param == "postgres":
        url = own_schema(request.getfixturevalue("postgres_url"), "load")
    else:
        base: str = request.getfixturevalue("redis_url")
        url = f"{base}{'&' if '?' in base else '?'}prefix=load-{secrets.token_hex(6)}"
    cluster = Cluster(url, tmp_path / "events.jsonl", ttl=DEFAULTS.ttl)
    yield cluster
    cluster.stop_all()
    asyncio.run(forget_store(url))


@pytest.mark.timeout(600)
def test_thousands_of_long_turns_on_two_processes_lose_nothing(
    default_ttl_cluster: Cluster,
) -> None:
    cluster = default_ttl_cluster
    workers = [cluster.start("a"), cluster.start("b")]
    ids = [f"m{i}" for i in range(SESSIONS)]
    for i, message_id in enumerate(ids):
        workers[i % 2].send(f"chat-{i}", f"sleep {TURN_SECONDS}", message_id)
    cluster.wait_for(
        lambda events: len(answered_ids(events)) >= SESSIONS or bool(lapsed(events)),
        timeout=TURN_SECONDS + 240,
        what=f"{SESSIONS} answers",
    )
    for worker in workers:
        worker.quit()
    events = cluster.events()

    assert not lapsed(events), f"{len(lapsed(events))} turns ended without a live lease"
    counters = [e for e in events if e["event"] == "leases"]
    assert len(counters) == 2
    assert all((c["lost"], c["stale"]) == (0, 0) for c in counters), counters
    answers = answered_ids(events)
    assert sorted(answers) == sorted(ids)
    assert all(len(answer) == 1 for answer in answers.values())
    assert {a[0]["kind"] for a in answers.values()} == {"reply"}
    starts = Counter(i for e in events if e["event"] == "start" for i in e["ids"])
    assert set(starts.values()) == {1}, "a turn ran twice"
    assert {e["gen"] for e in events if e["event"] in ("start", "deliver")} == {1}
    assert not [e for e in events if e["event"] == "superseded"]
    assert not [e for e in events if e["event"] == "fenced"]
    for beats in (e for e in events if e["event"] == "beats"):
        print(
            f"{beats['worker']}: {beats['count']} heartbeats, the longest gap "
            f"{beats['longest']:.3f} s (renewal period {DEFAULTS.renew_every} s)"
        )


def lapsed(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The turns that ended without a live lease (one not renewed in time, or fenced)."""
    return [e for e in events if e["event"] == "end" and not e["current"]]


OLD_DEFAULT_TTL = 30.0
"""The lease TTL before takeover was measured: a killed process held its sessions this long."""


def survivor_started(events: list[dict[str, Any]]) -> bool:
    return any(e["event"] == "start" and e["worker"] == "survivor" for e in events)


@pytest.mark.timeout(120)
def test_a_killed_process_is_taken_over_within_the_default_ttl(
    default_ttl_cluster: Cluster,
) -> None:
    cluster = default_ttl_cluster
    doomed = cluster.start("doomed")
    cluster.start("survivor")
    doomed.send("chat", "sleep 600", "m1")
    cluster.wait_for(lambda events: any(e["event"] == "start" for e in events), 30, "the turn")
    doomed.signal(signal.SIGKILL)
    killed_at = time.monotonic()
    events = cluster.wait_for(
        survivor_started, timeout=OLD_DEFAULT_TTL, what="the survivor to take the turn over"
    )
    print(f"taken over {time.monotonic() - killed_at:.1f} s after kill -9 (ttl {DEFAULTS.ttl} s)")
    [rerun] = [e for e in events if e["event"] == "start" and e["worker"] == "survivor"]
    assert (rerun["ids"], rerun["gen"]) == (["m1"], 2)
