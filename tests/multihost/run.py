"""One run of the multi-host test: three gateway hosts under load, one link pulled meanwhile.

:func:`run_hosts` starts ``chatlane serve`` on three new hosts of the network,
sends the load (:mod:`tests.multihost.load`), stops the gateways, and returns
what the client saw, what the shared turn log holds and what the store
committed, having printed the figures.
"""

from __future__ import annotations

import asyncio
import functools
import random
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from chatlane.stores import open_store
from tests.multihost.checks import Turns, committed, max_concurrent, overlaps, read_log, running
from tests.multihost.checks import turns as read_turns
from tests.multihost.load import Load, Message, Plan, Results, messages
from tests.multihost.network import Network
from tests.multihost.servers import Server, start_serve

SESSIONS = 200
PER_SESSION = 25
CONCURRENCY = 24
DOWN_AFTER = 1500
UP_AFTER = 3000
HELD = 3
MAX_OUTAGE = 90.0
LOAD_SECONDS = 600.0


@dataclass
class Run:
    """What one run sent, what the client got back, what the log and the store hold."""

    plan: Plan
    every: list[Message]
    results: Results
    turns: Turns
    stored: dict[str, int]
    exits: list[int]
    pids: dict[str, int]
    tails: list[str]

    @property
    def held_keys(self) -> set[str]:
        return {f"main:api:dm:{m.session}" for m in self.plan.held}


def run_hosts(network: Network, store_url: str, directory: Path) -> Run:
    """Three gateway hosts on ``store_url`` under load; always stopped before returning."""
    token, log, seed = secrets.token_hex(16), directory / "turns.jsonl", secrets.randbits(32)
    hosts = [network.add(f"h{n}") for n in (1, 2, 3)]
    plan = Plan(
        hosts=hosts,
        token=token,
        flap=hosts[0],
        set_link=network.set_link,
        down_after=DOWN_AFTER,
        up_after=UP_AFTER,
        max_outage=MAX_OUTAGE,
        concurrency=CONCURRENCY,
        deadline=time.monotonic() + LOAD_SECONDS,
        seed=seed,
        held=[Message(f"mhheld{n}", 0, verb="hold") for n in range(HELD)],
        running=functools.partial(running, log),
    )
    every = messages(SESSIONS, PER_SESSION, random.Random(seed))
    servers: list[Server] = []
    try:
        servers += [start_serve(h, store_url, token, directory / h.name, log) for h in hosts]
        results = asyncio.run(Load(plan).run(every))
    finally:
        exits = [server.stop() for server in servers]
    sessions = sorted({m.session for m in [*every, *plan.held]})
    stored = asyncio.run(committed_answers(store_url, sessions))
    pids = {host.name: server.process.pid for host, server in zip(hosts, servers, strict=True)}
    tails = [server.tail() for server in servers]
    done = Run(plan, every, results, read_turns(read_log(log)), stored, exits, pids, tails)
    report(store_url, seed, done)
    return done


async def committed_answers(store_url: str, sessions: list[str]) -> dict[str, int]:
    store = await open_store(store_url)
    try:
        return dict(await committed(store, sessions))
    finally:
        await store.close()


def report(store_url: str, seed: int, run: Run) -> None:
    """Print the run's figures (seen with ``pytest -s``)."""
    results, found, stored = run.results, run.turns, run.stored
    outage = results.outage
    assert outage is not None
    total = len(run.every) + len(run.plan.held)
    lost = len(results.unanswered) + sum(1 for text in expected_texts(run) if text not in stored)
    print(f"\nstore {store_url.split('://')[0]}, seed {seed}, {results.seconds:.1f} s of load")
    print(f"sent {total} messages ({len(run.plan.held)} held) over {SESSIONS + HELD} sessions")
    print(f"answered {len(results.answers)}; committed once {sum(c == 1 for c in stored.values())}")
    print(f"duplicated {sum(c > 1 for c in stored.values())}; lost {lost}")
    reruns = sum(1 for c in found.runs.values() if c > 1)
    print(f"agent runs {sum(found.runs.values())}; messages run again {reruns}")
    print(f"turns that ended without their lease {len(found.stale)}")
    for label, keys in (("other", set(found.spans) - run.held_keys), ("held", run.held_keys)):
        most = max((max_concurrent(found.spans[key]) for key in keys), default=0)
        print(f"max concurrent turns per session ({label} sessions) {most}")
    print(f"problems among turns that kept their lease: {overlaps(found.live())}")
    print(f"problems among all turns: {overlaps(found.spans)}")
    retried = sum(a.attempts - 1 for a in results.answers.values())
    print(f"retries {retried}; failures {dict(sorted(results.failures.items()))}")
    for message in run.plan.held:
        answer = results.answers.get(message)
        print(f"held {message.text!r}: ran {found.runs[message.text]} times, answered as "
              f"{answer and answer.content!r} (hosts by pid {run.pids})")  # fmt: skip
    print(f"link of {outage.host} down {outage.seconds:.1f} s, after {outage.answered_before} "
          f"answers; {outage.answered_during} answered while down")  # fmt: skip


def expected_texts(run: Run) -> list[str]:
    return [m.text for m in [*run.every, *run.plan.held]]
