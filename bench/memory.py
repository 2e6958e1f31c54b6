"""Memory per session: resident memory a gateway keeps for sessions that each had one turn.

Each configuration — a store (memory, SQLite) and a registry (the engine's
own, which evicts idle sessions; or one that keeps every session resident) —
runs in a fresh Python process. What stays true:

* The baseline is the process's resident set size (after a GC) once the
  gateway and store are open and a few warmup sessions ran, so imports,
  lazily built caches and the first allocations are in it.
* The sessions are added through the real ``Gateway``/``TurnEngine``, one
  message each (``bench.population``), and the resident set size is read
  again after a GC: what stays above the baseline is what the sessions cost.
* Evicted sessions must come back: a sample of the oldest sessions, gone
  from the registry, gets a second message, and each must answer with its
  generation and transcript continued from the store; a miss raises.

Run ``python -m bench.memory --help`` for the options.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.common import BenchError, Target, describe_machine, describe_versions, machine, positive
from bench.population import (
    MB,
    STORES,
    Population,
    bench_store,
    command_line,
    peak_rss_bytes,
    run_child,
    settled_rss,
)

REGISTRIES = ("evicting", "resident")
TARGET_SESSIONS = 100_000
TARGET_MB = 200.0
"""Sessions that each had one turn stay at most this far above the baseline (at 100,000)."""
TARGET_RESIDENT_MB_PER_1000 = 1.5
"""Sessions resident in the registry cost at most this much per 1,000."""


@dataclass(frozen=True, slots=True)
class Config:
    """One measured configuration and its workload."""

    store: str
    registry: str
    sessions: int
    warmup: int
    in_flight: int
    sample: int
    trace: int
    room: int | None = None
    """The evicting registry's room; ``None``: the engine's own registry."""


@dataclass(frozen=True, slots=True)
class Result:
    """What one configuration's process measured (bytes, seconds)."""

    config: Config
    baseline: int
    after: int
    peak: int
    resident_sessions: int
    left_memory: int
    came_back: int
    seconds: float
    top_allocations: tuple[str, ...] = ()

    @property
    def above_mb(self) -> float:
        return (self.after - self.baseline) / MB

    @property
    def mb_per_1000(self) -> float:
        return self.above_mb / (self.config.sessions / 1_000)

    def as_json(self) -> dict[str, Any]:
        return {
            "store": self.config.store,
            "registry": self.config.registry,
            "sessions": self.config.sessions,
            "resident_sessions": self.resident_sessions,
            "baseline_mb": round(self.baseline / MB, 1),
            "after_mb": round(self.after / MB, 1),
            "above_mb": round(self.above_mb, 1),
            "mb_per_1000_sessions": round(self.mb_per_1000, 3),
            "peak_above_mb": round((self.peak - self.baseline) / MB, 1),
            "sampled_left_memory": self.left_memory,
            "sampled_came_back": self.came_back,
            "seconds": round(self.seconds, 1),
            "top_allocations": list(self.top_allocations),
        }


# --- one configuration, in its own process --------------------------------------------


async def measure_one(config: Config) -> Result:
    """Baseline, ``config.sessions`` new sessions, then the resident set size again."""
    with tempfile.TemporaryDirectory(prefix="chatlane-bench-") as folder:
        async with bench_store(config.store, Path(folder)) as store:
            everyone = config.warmup + config.sessions
            room = everyone if config.registry == "resident" else config.room
            population = Population(store, room)
            try:
                return await grow(population, config)
            finally:
                await population.aclose()


async def grow(population: Population, config: Config) -> Result:
    await population.add(config.warmup, config.in_flight)
    baseline = settled_rss()
    if config.trace:
        tracemalloc.start()
    started = time.perf_counter()
    await population.add(config.sessions, config.in_flight)
    seconds = time.perf_counter() - started
    after = settled_rss()
    peak = peak_rss_bytes()
    top = top_allocations(config.trace) if config.trace else ()
    resident = len(population.registry)
    left, back = await come_back(population, config)
    return Result(config, baseline, after, peak, resident, left, back, seconds, top)


def top_allocations(count: int) -> tuple[str, ...]:
    """What is still allocated since tracing started: the total, then the ``count`` source
    lines holding the most."""
    snapshot = tracemalloc.take_snapshot()
    tracemalloc.stop()
    stats = snapshot.statistics("lineno")
    total = sum(stat.size for stat in stats)
    blocks = sum(stat.count for stat in stats)
    head = f"traced: {total / MB:.1f} MB in {blocks} blocks still allocated"
    return (head, *(str(stat) for stat in stats[:count]))


async def come_back(population: Population, config: Config) -> tuple[int, int]:
    """Send sampled sessions a second message; each must continue where it was.

    With the evicting registry the sample is sessions that left it, and the
    registry must hold no more than its ``max_sessions``.

    :returns: how many sampled sessions had left the registry, and how many answered.
    :raises BenchError: if the registry kept too many sessions, or a session
        lost its generation or transcript.
    """
    registry = population.registry
    added = range(config.warmup, config.warmup + config.sessions)
    if config.registry == "evicting":
        if len(registry) > registry.max_sessions:
            raise BenchError(f"{config.store}: {len(registry)} sessions stayed in the registry")
        gone = (s for s in added if population.key(s) not in registry)
        sampled = list(itertools.islice(gone, config.sample))
    else:
        sampled = list(added[: config.sample])
    keys = [population.key(s) for s in sampled]
    left = sum(key not in registry for key in keys)
    await population.send(sampled, config.in_flight)
    store = population.store
    for key in keys:
        generation = await store.generation(key)
        entries = len(await store.transcript(key, limit=10))
        if (generation, entries) != (2, 4):
            raise BenchError(f"{config.store}: {key} came back at {generation}, {entries} entries")
    generations = await store.generations([population.key(s) for s in range(population.count)])
    if min(generations) < 1:
        raise BenchError(f"{config.store}: {generations.count(0)} sessions left no generation")
    return left, len(keys)


def child(encoded: str) -> int:
    config = Config(**json.loads(encoded))
    result = asyncio.run(measure_one(config))
    print(json.dumps({**asdict(result), "config": asdict(config)}))
    return 0


# --- the parent: every configuration, then the table -------------------------------------


def decode(found: dict[str, Any]) -> Result:
    config = Config(**found.pop("config"))
    return Result(config=config, **{**found, "top_allocations": tuple(found["top_allocations"])})


def targets(results: Sequence[Result]) -> list[Target]:
    """Sessions that leave memory (every store), and resident sessions (SQLite only).

    The memory store keeps every session's data in the process itself, so its
    resident figure is no measure of what the registry keeps; it is shown, not judged.
    """
    found: list[Target] = []
    for result in results:
        sessions = result.config.sessions
        if result.config.registry == "evicting":
            limit = TARGET_MB * sessions / TARGET_SESSIONS
            rule = (
                f"{sessions} sessions above the baseline <= {limit:g} MB "
                f"({result.config.store}, evicting registry)"
            )
            found.append(Target(rule, result.above_mb, limit))
        elif result.config.store == "sqlite":
            rule = f"resident sessions <= {TARGET_RESIDENT_MB_PER_1000:g} MB per 1000 (sqlite)"
            found.append(Target(rule, result.mb_per_1000, TARGET_RESIDENT_MB_PER_1000))
    return found


def describe_room(room: int | None) -> str:
    if room is None:
        return "the engine's own registry (room for 10000 sessions)"
    return f"a registry with room for {room} sessions"


def render(command: str, facts: dict[str, Any], results: Sequence[Result]) -> str:
    config = results[0].config
    lines = [
        f"command: {command}",
        f"machine: {describe_machine(facts)}",
        f"versions: {describe_versions(facts)}",
        f"workload: {config.sessions} sessions x 1 message, {config.in_flight} in flight, "
        f"after {config.warmup} warmup sessions; each configuration in a fresh process",
        f"evicting = {describe_room(config.room)}, idle sessions beyond it leave memory; "
        "resident = a registry that keeps them all",
        f"{'store':<8}{'registry':<10}{'resident':>9}{'baseline MB':>13}{'above MB':>10}"
        f"{'MB/1k':>8}{'peak above':>12}{'seconds':>9}",
    ]
    for r in results:
        c = r.config
        lines.append(
            f"{c.store:<8}{c.registry:<10}{r.resident_sessions:>9}{r.baseline / MB:>13.1f}"
            f"{r.above_mb:>10.1f}{r.mb_per_1000:>8.2f}{(r.peak - r.baseline) / MB:>12.1f}"
            f"{r.seconds:>9.1f}"
        )
    for r in results:
        lines.append(
            f"came back ({r.config.store}, {r.config.registry}): {r.came_back} sampled "
            f"sessions ({r.left_memory} had left memory) answered again, continuing from the store"
        )
        lines += [f"  {line}" for line in r.top_allocations]
    if config.trace:
        lines.append("targets: not judged while tracing (tracemalloc holds memory of its own)")
        return "\n".join(lines)
    for target in targets(results):
        verdict = "PASS" if target.passed else "FAIL"
        lines.append(f"target: {target.rule}: {target.measured:.2f}: {verdict}")
    return "\n".join(lines)


def as_json(command: str, facts: dict[str, Any], results: Sequence[Result]) -> dict[str, Any]:
    c = results[0].config
    judged = [] if c.trace else [t.as_json() for t in targets(results)]
    return {
        "command": command,
        "machine": facts,
        "workload": {
            "sessions": c.sessions,
            "warmup": c.warmup,
            "in_flight": c.in_flight,
            "sample": c.sample,
            "evicting_room": c.room,
        },
        "configurations": [r.as_json() for r in results],
        "targets": judged,
        "passed": all(t["passed"] for t in judged),
    }


def store_list(text: str) -> tuple[str, ...]:
    chosen = tuple(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))
    if not chosen or any(name not in STORES for name in chosen):
        raise argparse.ArgumentTypeError(f"expected some of {','.join(STORES)}, not {text!r}")
    return chosen


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--sessions", type=positive, default=TARGET_SESSIONS, help="(100000)")
    parser.add_argument("--warmup", type=positive, default=500, help="sessions (default 500)")
    parser.add_argument("--in-flight", type=positive, default=50, help="at most (default 50)")
    parser.add_argument("--sample", type=positive, default=100, help="sessions that come back")
    parser.add_argument("--stores", type=store_list, default=STORES, help="memory,sqlite")
    parser.add_argument(
        "--room", type=positive, help="sessions the evicting registry keeps (default: the engine's)"
    )
    parser.add_argument(
        "--trace", type=int, default=0, help="show the N largest allocation sites (tracemalloc)"
    )
    parser.add_argument("--json", action="store_true", help="print machine-readable results")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child is not None:
        return child(args.child)
    results = []
    for store in args.stores:
        for registry in REGISTRIES:
            config = Config(
                store,
                registry,
                args.sessions,
                args.warmup,
                args.in_flight,
                args.sample,
                args.trace,
                args.room,
            )
            results.append(decode(run_child("memory", asdict(config))))
    command, facts = command_line("memory", argv), machine()
    if args.json:
        print(json.dumps(as_json(command, facts, results), indent=2))
    else:
        print(render(command, facts, results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
