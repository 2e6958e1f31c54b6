"""Cost per turn of chatlane's stores (memory, SQLite, Redis, PostgreSQL) beside aiogram's FSM.

A chatlane turn is the store calls one message costs: take the session's
lease, write under its generation, give it back. aiogram's counterpart is one
``feed_update`` with ``RedisStorage`` and ``RedisEventIsolation`` on the same
Redis server. What stays true:

* Every line runs the same workload as ``bench.dispatch``: one worker task
  per lane, a session in exactly one lane, so its turns run in order and never
  overlap, and at most ``in_flight`` operations are in flight.
* Every input is prepared before the clock starts; only the store calls (or
  ``feed_update``, or the ``PING``) are timed.
* Each timed section records its wall time and the process's CPU time (every
  thread: the SQLite writer's too, not the Redis server's); a figure is µs
  per operation, the median over rounds. Targets are judged on CPU time.
* Each run starts on an empty namespace: a new memory store, a new SQLite file,
  a new Redis key prefix, a new PostgreSQL schema. A run's Redis keys are
  deleted afterwards, by prefix (never ``FLUSHDB``), and its schema dropped.
* Each run is checked afterwards: every session's generation, persistent
  counter and transcript length (aiogram: FSM counter) equal its turns, and
  every ``PING`` was answered; a miss raises.
* Redis is ``$REDIS_URL`` if set, else a throwaway server stopped at exit.
* PostgreSQL is ``$CHATLANE_TEST_POSTGRES_URL`` if set, else a throwaway
  cluster (``initdb``/``pg_ctl``) stopped at exit; where there is neither, its
  lines are skipped and the report says why.

Run ``python -m bench.stores --help`` for the options.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import secrets
import sys
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import ExitStack, asynccontextmanager, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from aiogram import Bot, Dispatcher
from aiogram.dispatcher.event.bases import UNHANDLED
from aiogram.fsm.storage.base import DefaultKeyBuilder
from aiogram.fsm.storage.redis import RedisStorage
from aiogram.types import Update
from redis.asyncio import Redis

from bench.common import (
    BOT_ID,
    BenchError,
    Elapsed,
    Rounds,
    Target,
    aiogram_counters,
    check_counts,
    describe_machine,
    describe_versions,
    drive_timed,
    machine,
    on_message,
    plan_lanes,
    positive,
    telegram_update,
    user_id,
)
from chatlane.identity import SessionSource, build_session_key
from chatlane.stores import Store, TranscriptEntry, WriteBatch, open_store
from chatlane.stores.redis_url import parse_url, redact
from chatlane.stores.resp import RespClient
from chatlane.testing_postgres import missing as postgres_missing
from chatlane.testing_postgres import postgres_server as postgres_throwaway_or_env
from chatlane.testing_redis import redis_server as throwaway_or_env
from chatlane.testing_redis import server_binary
from chatlane.types import SessionKey

BACKENDS = ("memory", "sqlite", "redis", "postgres")
DURABLE = ("sqlite", "redis", "postgres")
JUDGED_OVER_MEMORY = ("sqlite", "redis")
"""The stores held to :data:`TARGET_OVER_MEMORY` (PostgreSQL's turn is bound by its round trips
to the server; its ratio is shown, not judged)."""
TARGET_REDIS_RATIO = 5.0
"""Redis passes when aiogram's cost per update is at least this many times its cost per turn."""
TARGET_SQLITE_US = 150.0
"""SQLite passes when a turn costs at most this many µs of CPU."""
TARGET_OVER_MEMORY = 8.0
"""SQLite and Redis pass when an engine turn (the ``fused`` line) costs at most this many
times memory's, in CPU."""
MAX_REDIS_IN_FLIGHT = 100
"""redis-py's default pool (aiogram's and the PING line's) fails past 100 concurrent commands."""
LEASE_TTL = 30.0
HOLDER = "bench"


@dataclass(frozen=True, slots=True)
class Workload:
    """How many sessions, turns per session, and turns in flight at most."""

    sessions: int
    turns: int
    in_flight: int

    @property
    def total(self) -> int:
        return self.sessions * self.turns


# --- a Redis server -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RedisServer:
    """The server every Redis line uses, and where it came from."""

    url: str
    origin: str


@dataclass(frozen=True, slots=True)
class Servers:
    """The servers the lines use (a URL, or ``""`` where it is not used), and why one is absent."""

    redis: str = ""
    postgres: str = ""
    skipped: tuple[tuple[str, str], ...] = ()
    """``(backend, why)`` for each backend asked for whose server is missing."""


@contextmanager
def postgres_server() -> Iterator[str]:
    """``$CHATLANE_TEST_POSTGRES_URL``, or a throwaway cluster that stops at exit."""
    with postgres_throwaway_or_env() as url:
        yield url


@contextmanager
def redis_server() -> Iterator[RedisServer]:
    """``$REDIS_URL``, or a throwaway server that keeps nothing on disk and stops at exit."""
    origin = "$REDIS_URL" if os.environ.get("REDIS_URL") else f"throwaway {server_binary()}"
    with throwaway_or_env() as url:
        yield RedisServer(url, origin)


def unique_prefix(side: str) -> str:
    return f"{side}-bench-{secrets.token_hex(6)}"


async def delete_prefix(url: str, prefix: str) -> None:
    """Delete every key under ``prefix:`` (one run's keys), leaving the rest of the server."""
    client = Redis.from_url(url)
    try:
        batch: list[bytes] = []
        async for key in client.scan_iter(match=f"{prefix}:*", count=1_000):
            batch.append(key)
            if len(batch) >= 1_000:
                await client.unlink(*batch)
                batch.clear()
        if batch:
            await client.unlink(*batch)
    finally:
        await client.aclose()


# --- chatlane stores --------------------------------------------------------------

TurnForm = Callable[[Store, SessionKey, int], Awaitable[None]]
"""One turn of session ``key`` that leaves its persistent counter at ``n``."""


async def four_calls(store: Store, key: SessionKey, n: int) -> None:
    """The turn as the issue states it: acquire, append, persist, release."""
    lease = await store.acquire(key, HOLDER, LEASE_TTL)
    generation = lease.generation
    await store.append_transcript(key, generation, TranscriptEntry("user", "hello", generation))
    await store.set_persistent(key, generation, counter=n)
    await store.release(lease)


async def engine_calls(store: Store, key: SessionKey, n: int) -> None:
    """The same writes as :func:`four_calls` in one commit: 3 calls."""
    lease = await store.acquire(key, HOLDER, LEASE_TTL)
    generation = lease.generation
    entry = TranscriptEntry("user", "hello", generation)
    await store.commit(key, generation, WriteBatch(transcript=[entry], persistent={"counter": n}))
    await store.release(lease)


def answer(key: SessionKey, n: int, generation: int, seq: int) -> WriteBatch:
    """A turn's commit as ``TurnEngine`` makes it: the input and the reply, answered, dequeued."""
    entries = [TranscriptEntry("user", "hello", generation, message_id=f"{key}#{n}")]
    return WriteBatch(
        transcript=entries,
        persistent={"counter": n},
        answered=[f"{key}#{n}"],
        done=[seq],
        answer="ok",
    )


async def unfused_calls(store: Store, key: SessionKey, n: int) -> None:
    """A message to an idle session with the separate calls: enqueue, acquire, read the
    stored choices, commit, release (5 calls)."""
    seq = await store.enqueue(key, f"{key}#{n}", HOLDER, b"message")
    lease = await store.acquire(key, HOLDER, LEASE_TTL, head_seq=seq)
    await store.load_persistent(key)
    await store.commit(key, lease.generation, answer(key, n, lease.generation, seq))
    await store.release(lease)


async def fused_calls(store: Store, key: SessionKey, n: int, *, read: bool = True) -> None:
    """The same message with the fused calls, as ``TurnEngine`` makes them: 2 calls."""
    admission = await store.enqueue_and_acquire(
        key, f"{key}#{n}", HOLDER, b"message", LEASE_TTL, with_persistent=read
    )
    lease = admission.lease
    if lease is None:
        raise BenchError(f"{key}: the lease was refused: {admission.refusal}")
    await store.commit_and_release(lease, answer(key, n, lease.generation, admission.seq))


FORMS: dict[str, TurnForm] = {
    "turn": four_calls,
    "engine": engine_calls,
    "unfused": unfused_calls,
    "fused": fused_calls,
    "fused-bare": functools.partial(fused_calls, read=False),
}


def session_key(session: int) -> SessionKey:
    uid = str(user_id(session))
    return build_session_key(SessionSource("telegram", chat_id=uid, user_id=uid))


def numbered(lanes: list[list[int]], keys: list[SessionKey]) -> list[list[tuple[SessionKey, int]]]:
    """Each lane's turns as (session key, that session's turn number from 1)."""
    done = [0] * len(keys)
    inputs: list[list[tuple[SessionKey, int]]] = []
    for lane in lanes:
        inputs.append([])
        for session in lane:
            done[session] += 1
            inputs[-1].append((keys[session], done[session]))
    return inputs


@asynccontextmanager
async def fresh_store(backend: str, servers: Servers) -> AsyncIterator[Store]:
    """An empty store of ``backend``; its file, Redis keys or schema are deleted afterwards."""
    redis_url = servers.redis
    if backend == "postgres":
        schema = f"bench_{secrets.token_hex(6)}"
        base = servers.postgres
        url = f"{base}{'&' if '?' in base else '?'}schema={schema}"
        try:
            async with opened(url) as store:
                yield store
        finally:
            await drop_schema(base, schema)
    elif backend == "sqlite":
        with tempfile.TemporaryDirectory(prefix="chatlane-bench-") as folder:
            async with opened(f"sqlite:///{Path(folder, 'chatlane.db')}") as store:
                yield store
    elif backend == "redis":
        prefix = unique_prefix("chatlane")
        url = f"{redis_url}{'&' if '?' in redis_url else '?'}prefix={prefix}"
        try:
            async with opened(url) as store:
                yield store
        finally:
            await delete_prefix(redis_url, prefix)
    else:
        async with opened("memory://") as store:
            yield store


async def drop_schema(url: str, schema: str) -> None:
    """Drop one run's schema (never anything else: the server may be shared)."""
    import asyncpg

    from chatlane.stores.postgres.url import parse_url as parse_postgres_url

    connection = await asyncpg.connect(parse_postgres_url(url).dsn)
    try:
        await connection.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    finally:
        await connection.close()


@asynccontextmanager
async def opened(url: str) -> AsyncIterator[Store]:
    store = await open_store(url)
    try:
        yield store
    finally:
        await store.close()


async def check_store(line: str, store: Store, keys: list[SessionKey], turns: int) -> None:
    """:raises BenchError: unless every session shows exactly ``turns`` turns."""
    generations, counters, entries, queued = {}, {}, {}, {}
    for session, key in enumerate(keys):
        generations[session] = await store.generation(key)
        counters[session] = (await store.load_persistent(key)).get("counter", 0)
        entries[session] = len(await store.transcript(key, limit=turns + 1))
        queued[session] = len(await store.pending(key))
    check_counts(line, "generation", generations, turns)
    check_counts(line, "counter", counters, turns)
    check_counts(line, "transcript length", entries, turns)
    check_counts(line, "messages still queued", queued, 0)
    if await store.active_sessions():
        raise BenchError(f"{line}: a lease was never released")


async def run_store(
    backend: str, form: str, servers: Servers, workload: Workload, lanes: list[list[int]]
) -> Elapsed:
    """One timed run of ``form`` turns on a fresh ``backend`` store."""
    keys = [session_key(s) for s in range(workload.sessions)]
    inputs = numbered(lanes, keys)
    turn = FORMS[form]
    async with fresh_store(backend, servers) as store:
        elapsed = await drive_timed(inputs, lambda item: turn(store, *item))
        await check_store(f"{backend}/{form}", store, keys, workload.turns)
    return elapsed


# --- redis-py and aiogram on the same server ---------------------------------------------


async def run_ping(redis_url: str, workload: Workload, lanes: list[list[int]]) -> Elapsed:
    """One timed run of a ``PING`` per turn on a fresh redis-py client."""
    client = Redis.from_url(redis_url)
    try:
        return await time_pings("redis-py", client.ping, workload, lanes)
    finally:
        await client.aclose()


async def run_resp_ping(redis_url: str, workload: Workload, lanes: list[list[int]]) -> Elapsed:
    """The same ``PING``s through the client chatlane's Redis store uses (one connection)."""
    client = RespClient(parse_url(redis_url)[0])
    await client.execute("PING")  # connected before the clock starts, as the store is

    async def ping() -> bool:
        return bool(await client.execute("PING"))

    try:
        return await time_pings("resp", ping, workload, lanes)
    finally:
        await client.close()


async def time_pings(
    side: str, ping: Callable[[], Awaitable[object]], workload: Workload, lanes: list[list[int]]
) -> Elapsed:
    """One ``PING`` per turn of ``lanes``, timed; raises unless each was answered."""
    answered = 0

    async def one(_: int) -> None:
        nonlocal answered
        pong = await ping()  # awaited first: `answered += await …` would lose counts
        answered += bool(pong)

    elapsed = await drive_timed(lanes, one)
    if answered != workload.total:
        raise BenchError(f"{side}: {answered} PONGs for {workload.total} PINGs")
    return elapsed


async def run_aiogram(redis_url: str, workload: Workload, lanes: list[list[int]]) -> Elapsed:
    """One timed run on a fresh dispatcher and key prefix."""
    prefix = unique_prefix("aiogram")
    storage = RedisStorage(Redis.from_url(redis_url), key_builder=DefaultKeyBuilder(prefix=prefix))
    dp = Dispatcher(storage=storage, events_isolation=storage.create_isolation())
    dp.message.register(on_message)
    bot = Bot(f"{BOT_ID}:TEST")
    ids = iter(range(1, workload.total + 1))
    inputs = [[telegram_update(bot, next(ids), s) for s in lane] for lane in lanes]

    async def handle(update: Update) -> None:
        if await dp.feed_update(bot, update) is UNHANDLED:
            raise BenchError("aiogram left an update unhandled")

    try:
        elapsed = await drive_timed(inputs, handle)
        counters = await aiogram_counters(storage, workload.sessions)
    finally:
        await bot.session.close()
        await dp.storage.close()
        await delete_prefix(redis_url, prefix)
    check_counts("aiogram", "counter", counters, workload.turns)
    return elapsed


# --- measuring and reporting --------------------------------------------------

Run = Callable[[Workload, list[list[int]]], Awaitable[Elapsed]]


def plan_lines(backends: Sequence[str], servers: Servers) -> dict[str, Run]:
    """Every line to time, by name: each store in each form, then redis-py and aiogram."""
    lines: dict[str, Run] = {}
    redis_url = servers.redis
    skipped = dict(servers.skipped)
    for backend in backends:
        if backend in skipped:
            continue
        for form in FORMS:
            lines[f"{backend}/{form}"] = functools.partial(run_store, backend, form, servers)
    if "redis" in backends:
        lines["redis-py/ping"] = functools.partial(run_ping, redis_url)
        lines["resp/ping"] = functools.partial(run_resp_ping, redis_url)
        lines["aiogram/redis"] = functools.partial(run_aiogram, redis_url)
    return lines


RATIO_FORMS = ("engine", "fused")
"""The forms whose durable-store / memory ratios are shown."""
JUDGED_FORM = "fused"
"""The form judged against memory: the two calls a ``TurnEngine`` turn makes today (``engine``
is the older three-call pattern, kept for comparison with earlier figures)."""


@dataclass(frozen=True, slots=True)
class Report:
    """Every line's rounds, and what they were measured on."""

    workload: Workload
    redis: RedisServer | None
    lines: dict[str, Rounds]
    machine: dict[str, Any]
    skipped: tuple[tuple[str, str], ...] = ()
    """``(backend, why)`` for each backend asked for but not measured."""

    def cpu(self, line: str) -> float | None:
        rounds = self.lines.get(line)
        return None if rounds is None else rounds.cpu

    def ratios(self) -> dict[str, tuple[float, float]]:
        """``<store>/<form> / memory/<form>``, CPU and wall, for the stores measured."""
        found: dict[str, tuple[float, float]] = {}
        for form in RATIO_FORMS:
            memory = self.lines.get(f"memory/{form}")
            for backend in DURABLE:
                durable = self.lines.get(f"{backend}/{form}")
                if memory is not None and durable is not None:
                    found[f"{backend}/{form} / memory/{form}"] = (
                        durable.cpu / memory.cpu,
                        durable.wall / memory.wall,
                    )
        return found

    def targets(self) -> list[Target]:
        """The checks whose lines were measured, all on CPU time."""
        found: list[Target] = []
        redis, aiogram = self.cpu("redis/turn"), self.cpu("aiogram/redis")
        if redis is not None and aiogram is not None:
            rule = f"redis turn <= aiogram update / {TARGET_REDIS_RATIO:g}, CPU µs"
            found.append(Target(rule, redis, aiogram / TARGET_REDIS_RATIO))
        sqlite = self.cpu("sqlite/turn")
        if sqlite is not None:
            rule = f"sqlite turn <= {TARGET_SQLITE_US:g} µs, CPU µs"
            found.append(Target(rule, sqlite, TARGET_SQLITE_US))
        memory = self.cpu(f"memory/{JUDGED_FORM}")
        for backend in JUDGED_OVER_MEMORY:
            durable = self.cpu(f"{backend}/{JUDGED_FORM}")
            if memory is not None and durable is not None:
                limit = f"{TARGET_OVER_MEMORY:g}x"
                rule = f"{backend} engine turn ({JUDGED_FORM}) / memory's <= {limit}, CPU"
                found.append(Target(rule, durable / memory, TARGET_OVER_MEMORY))
        return found

    def as_json(self) -> dict[str, Any]:
        w = self.workload
        server = self.redis
        return {
            "machine": self.machine,
            "workload": {"sessions": w.sessions, "turns": w.turns, "in_flight": w.in_flight},
            "redis": None
            if server is None
            else {"url": redact(server.url), "origin": server.origin},
            "lines": {name: rounds.as_json() for name, rounds in self.lines.items()},
            "skipped": dict(self.skipped),
            "ratios": {
                name: {"cpu": round(cpu, 3), "wall": round(wall, 3)}
                for name, (cpu, wall) in self.ratios().items()
            },
            "targets": [target.as_json() for target in self.targets()],
            "passed": all(target.passed for target in self.targets()),
        }


async def measure(
    workload: Workload,
    rounds: int,
    backends: Sequence[str],
    redis: RedisServer | None,
    servers: Servers,
) -> Report:
    """A warmup run per line, then ``rounds`` timed runs going through every line in turn."""
    lanes = plan_lanes(workload.sessions, workload.turns, workload.in_flight)
    lines = plan_lines(backends, servers)
    for run in lines.values():
        await run(workload, lanes)
    wall: dict[str, list[float]] = {name: [] for name in lines}
    cpu: dict[str, list[float]] = {name: [] for name in lines}
    for _ in range(rounds):
        for name, run in lines.items():
            elapsed = await run(workload, lanes)
            wall[name].append(elapsed.wall_ns / workload.total / 1_000)
            cpu[name].append(elapsed.cpu_ns / workload.total / 1_000)
    timed = {name: Rounds(tuple(wall[name]), tuple(cpu[name])) for name in lines}
    return Report(workload, redis, timed, machine(), servers.skipped)


LEGEND = (
    "turn       = acquire + append_transcript + set_persistent + release (4 store calls)",
    "engine     = acquire + commit(WriteBatch: the same entry and field) + release (3 calls)",
    "unfused    = a message to an idle session, separate calls: enqueue + acquire +",
    "             load_persistent + commit(entry, field, answered, dequeued) + release (5)",
    "fused      = the same message: enqueue_and_acquire + commit_and_release (2 calls)",
    "fused-bare = fused without reading the stored choices (with_persistent=False)",
)
REDIS_LEGEND = (
    "redis-py/ping = one PING (a raw round trip)",
    "resp/ping = one PING through chatlane's pipelined client",
    "aiogram/redis = one feed_update with RedisStorage + RedisEventIsolation",
)


def render(report: Report) -> str:
    w = report.workload
    rounds = len(next(iter(report.lines.values())).cpu_us) if report.lines else 0
    lines = [
        f"machine: {describe_machine(report.machine)}",
        f"versions: {describe_versions(report.machine)}",
        f"workload: {w.sessions} sessions x {w.turns} turns = {w.total}, "
        f"{w.in_flight} in flight, {rounds} rounds (+1 warmup)",
    ]
    lines += LEGEND
    if report.redis is not None:
        lines += REDIS_LEGEND
        lines.append(f"redis: {redact(report.redis.url)} ({report.redis.origin})")
    lines += [
        "µs per operation, medians of the rounds; CPU = this process's CPU time (every thread)",
        f"{'line':<20}{'CPU':>8}{'wall':>8}{'ops/s':>9}   rounds CPU | wall",
    ]
    for name, measured in report.lines.items():
        cpu = " ".join(f"{r:.1f}" for r in measured.cpu_us)
        wall = " ".join(f"{r:.1f}" for r in measured.wall_us)
        per_second = 1e6 / measured.wall
        lines.append(
            f"{name:<20}{measured.cpu:>8.1f}{measured.wall:>8.1f}{per_second:>9.0f}"
            f"   {cpu} | {wall}"
        )
    for backend, why in report.skipped:
        lines.append(f"{backend}: skipped ({why})")
    for name, (cpu_ratio, wall_ratio) in report.ratios().items():
        lines.append(f"ratio {name}: CPU {cpu_ratio:.2f}, wall {wall_ratio:.2f}")
    for target in report.targets():
        figures = f"{target.measured:.2f} vs {target.limit:.2f}"
        lines.append(f"target: {target.rule} ({figures}): {target.verdict}")
    return "\n".join(lines)


def backend_list(text: str) -> tuple[str, ...]:
    chosen = tuple(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))
    unknown = [name for name in chosen if name not in BACKENDS]
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(f"expected some of {','.join(BACKENDS)}, not {text!r}")
    return chosen


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--sessions", type=positive, default=1_000, help="sessions (default 1000)")
    parser.add_argument("--turns", type=positive, default=5, help="per session (default 5)")
    parser.add_argument("--in-flight", type=positive, default=50, help="at most (default 50)")
    parser.add_argument("--rounds", type=positive, default=3, help="timed rounds (default 3)")
    parser.add_argument("--json", action="store_true", help="print machine-readable results")
    parser.add_argument(
        "--backends",
        type=backend_list,
        default=BACKENDS,
        help="stores to time, comma-separated (default memory,sqlite,redis,postgres)",
    )
    args = parser.parse_args(argv)
    if "redis" in args.backends and args.in_flight > MAX_REDIS_IN_FLIGHT:
        parser.error(
            f"--in-flight {args.in_flight}: at most {MAX_REDIS_IN_FLIGHT} with redis, where "
            "redis-py's default pool (aiogram's) fails with 'Too many connections'"
        )
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    workload = Workload(args.sessions, args.turns, args.in_flight)
    with ExitStack() as stack:
        redis = stack.enter_context(redis_server()) if "redis" in args.backends else None
        servers = Servers(redis="" if redis is None else redis.url)
        if "postgres" in args.backends:
            servers = stack.enter_context(with_postgres(servers))
        report = asyncio.run(measure(workload, args.rounds, args.backends, redis, servers))
    print(json.dumps(report.as_json(), indent=2) if args.json else render(report))
    return 0


@contextmanager
def with_postgres(servers: Servers) -> Iterator[Servers]:
    """``servers`` with PostgreSQL's URL, or with the reason it is skipped."""
    why = postgres_missing()
    if why is not None:
        yield replace(servers, skipped=(*servers.skipped, ("postgres", why)))
        return
    try:
        import asyncpg  # noqa: F401 -- the store's driver: the postgres extra
    except ImportError as error:
        reason = f"the postgres extra is not installed ({error})"
        yield replace(servers, skipped=(*servers.skipped, ("postgres", reason)))
        return
    with postgres_server() as url:
        yield replace(servers, postgres=url)


if __name__ == "__main__":
    sys.exit(main())
