"""Scale: what a new session's first message costs as sessions pile up, and the SQLite file.

Each checkpoint of each store runs in a fresh Python process of its own, on
the engine's own registry (which evicts idle sessions). What stays true:

* A checkpoint's process adds sessions through the real ``Gateway`` and
  ``TurnEngine``, one message each (``bench.population``), until the
  checkpoint's number exists (1,000, 10,000 or 100,000 by default); filling
  is not timed.
* Then it runs rounds when told to: each sends the first message of
  ``--probes`` brand-new sessions. A round's cost is the process's CPU time
  (every thread: the SQLite writer too) divided by its messages, after a GC.
* The rounds of a store's checkpoints take turns (one round of each, then the
  next, in alternating order), so a busy spell on a shared machine falls on
  every checkpoint alike. A checkpoint's figure is the median of its rounds.
* The SQLite file is measured once the largest checkpoint's store is closed
  and checkpointed: its size (plus any WAL) less an empty store's, per 1,000
  sessions it holds.

Run ``python -m bench.scale --help`` for the options.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import itertools
import json
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

from bench.common import BenchError, Target, describe_machine, describe_versions, machine, positive
from bench.memory import store_list
from bench.population import MB, ROOT, STORES, Population, bench_store, command_line

CHECKPOINTS = (1_000, 10_000, 100_000)
TARGET_RATIO = 1.3
"""A first message at the last checkpoint costs at most this many times one at the first."""
TARGET_DB_MB_PER_1000 = 0.5
"""The SQLite file grows at most this much per 1,000 sessions of one message each."""


@dataclass(frozen=True, slots=True)
class Config:
    """One checkpoint's process: its store, sessions, probes per round, and whether it
    measures the SQLite file at the end."""

    store: str
    existing: int
    probes: int
    in_flight: int
    measure_file: bool


@dataclass(frozen=True, slots=True)
class Point:
    """The first-message cost (µs of CPU per message, each round) with ``existing`` sessions."""

    existing: int
    rounds_us: tuple[float, ...]

    @property
    def median_us(self) -> float:
        return statistics.median(self.rounds_us)


@dataclass(frozen=True, slots=True)
class FileSize:
    """A SQLite store file holding ``sessions`` one-message sessions, and an empty one (bytes)."""

    sessions: int
    size: int
    empty: int
    tables: dict[str, int]

    @property
    def mb_per_1000(self) -> float:
        return (self.size - self.empty) / MB / (self.sessions / 1_000)


@dataclass(frozen=True, slots=True)
class Result:
    store: str
    points: tuple[Point, ...]
    file: FileSize | None

    @property
    def ratio(self) -> float:
        return self.points[-1].median_us / self.points[0].median_us


# --- one checkpoint, in its own process ---------------------------------------------------


def say(found: dict[str, Any]) -> None:
    print(json.dumps(found), flush=True)


async def serve_rounds(config: Config, folder: Path) -> int:
    """Fill to ``config.existing``, then run a round per ``round`` line read; the sessions made."""
    loop = asyncio.get_running_loop()
    async with bench_store(config.store, folder) as store:
        population = Population(store)
        try:
            await population.add(config.existing, config.in_flight)
            say({"ready": population.count})
            while (await loop.run_in_executor(None, sys.stdin.readline)).strip() == "round":
                say({"us": await one_round(population, config)})
        finally:
            await population.aclose()
    return population.count


async def one_round(population: Population, config: Config) -> float:
    """µs of process CPU time per first message of ``config.probes`` new sessions."""
    lanes = population.prepare(config.probes, config.in_flight)
    gc.collect()
    started = time.process_time_ns()
    await population.run(lanes, config.probes)
    return (time.process_time_ns() - started) / config.probes / 1_000


def file_size(folder: Path, sessions: int) -> FileSize:
    """The closed store's size next to an empty store's, made and closed the same way."""
    (folder / "empty").mkdir()
    asyncio.run(empty_store(folder / "empty"))
    size, tables = checkpointed(folder / "chatlane.db")
    empty, _ = checkpointed(folder / "empty" / "chatlane.db")
    return FileSize(sessions, size, empty, tables)


async def empty_store(folder: Path) -> None:
    async with bench_store("sqlite", folder):
        pass


def checkpointed(path: Path) -> tuple[int, dict[str, int]]:
    """The file's size with its WAL checkpointed, and the bytes of each table and index."""
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as db:
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        try:
            rows = db.execute("SELECT name, sum(pgsize) FROM dbstat GROUP BY name").fetchall()
        except sqlite3.OperationalError:  # SQLite built without the dbstat table
            rows = []
    wal = path.with_name(path.name + "-wal")
    size = path.stat().st_size + (wal.stat().st_size if wal.exists() else 0)
    return size, {str(name): int(pages) for name, pages in rows}


def child(encoded: str) -> int:
    config = Config(**json.loads(encoded))
    with tempfile.TemporaryDirectory(prefix="chatlane-bench-") as name:
        sessions = asyncio.run(serve_rounds(config, Path(name)))
        size = file_size(Path(name), sessions) if config.measure_file else None
    say({"sessions": sessions, "file": size and asdict(size)})
    return 0


# --- the parent: a store's checkpoints, round by round ---------------------------------------


class Child:
    """A checkpoint's process, answering one JSON line per line it is sent."""

    def __init__(self, config: Config, errors: IO[bytes]) -> None:
        self.config = config
        self._errors = errors
        self._process = subprocess.Popen(
            [sys.executable, "-m", "bench.scale", "--child", json.dumps(asdict(config))],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=errors,
            text=True,
        )

    def answer(self) -> dict[str, Any]:
        """The next line the process writes.

        :raises BenchError: if it ended instead (its error output is included).
        """
        assert self._process.stdout is not None
        line = self._process.stdout.readline()
        if not line:
            self._process.wait()
            self._errors.seek(0)
            text = self._errors.read().decode(errors="replace")
            raise BenchError(f"bench.scale {self.config}: exit {self._process.returncode}\n{text}")
        found: dict[str, Any] = json.loads(line)
        return found

    def ask(self, command: str) -> dict[str, Any]:
        assert self._process.stdin is not None
        self._process.stdin.write(command + "\n")
        self._process.stdin.flush()
        return self.answer()

    def stop(self) -> None:
        if self._process.poll() is None:
            self._process.kill()
            self._process.wait()


@contextlib.contextmanager
def children(configs: Sequence[Config]) -> Iterator[list[Child]]:
    """One process per config, all filling at once; every one is stopped at the end."""
    with contextlib.ExitStack() as stack:
        started: list[Child] = []

        @stack.callback
        def stop_all() -> None:
            for process in started:
                process.stop()

        for config in configs:
            errors = stack.enter_context(tempfile.TemporaryFile())
            started.append(Child(config, errors))
        yield started


def measure_store(store: str, checkpoints: Sequence[int], args: argparse.Namespace) -> Result:
    """Every checkpoint of ``store``, their rounds taking turns; the SQLite file at the end."""
    configs = [
        Config(store, n, args.probes, args.in_flight, store == "sqlite" and n == checkpoints[-1])
        for n in checkpoints
    ]
    with children(configs) as running:
        for process in running:
            process.answer()  # ready: filled to its checkpoint
        rounds: dict[int, list[float]] = {n: [] for n in checkpoints}
        for number in range(args.rounds):
            order = running if number % 2 == 0 else running[::-1]
            for process in order:
                rounds[process.config.existing].append(float(process.ask("round")["us"]))
        ends = [process.ask("end") for process in running]
    file = next((FileSize(**e["file"]) for e in ends if e["file"] is not None), None)
    points = tuple(Point(n, tuple(rounds[n])) for n in checkpoints)
    return Result(store, points, file)


def targets(results: Sequence[Result]) -> list[Target]:
    found: list[Target] = []
    for r in results:
        first, last = r.points[0].existing, r.points[-1].existing
        rule = f"first message with {last} sessions <= {TARGET_RATIO:g}x with {first} ({r.store})"
        found.append(Target(rule, r.ratio, TARGET_RATIO))
        if r.file is not None:
            rule = f"SQLite file <= {TARGET_DB_MB_PER_1000:g} MB per 1000 one-message sessions"
            found.append(Target(rule, r.file.mb_per_1000, TARGET_DB_MB_PER_1000))
    return found


def render(
    command: str, facts: dict[str, Any], args: argparse.Namespace, results: Sequence[Result]
) -> str:
    lines = [
        f"command: {command}",
        f"machine: {describe_machine(facts)}",
        f"versions: {describe_versions(facts)}",
        "workload: sessions of one message each, filled to "
        f"{', '.join(map(str, args.checkpoints))}, each checkpoint in a fresh process; "
        f"{args.rounds} rounds of {args.probes} new sessions' first messages at each, "
        f"{args.in_flight} in flight, the checkpoints' rounds taking turns",
        "cost = process CPU time (every thread) per first message, median of the rounds",
        f"{'store':<8}{'sessions':>10}{'median µs':>11}{'vs first':>10}   rounds µs",
    ]
    for r in results:
        for point in r.points:
            shown = " ".join(f"{us:.0f}" for us in point.rounds_us)
            ratio = point.median_us / r.points[0].median_us
            lines.append(
                f"{r.store:<8}{point.existing:>10}{point.median_us:>11.1f}{ratio:>9.2f}x   {shown}"
            )
    for r in results:
        if r.file is not None:
            f = r.file
            lines.append(
                f"sqlite file: {f.size / MB:.1f} MB for {f.sessions} sessions (empty store "
                f"{f.empty / 1024:.0f} KiB): {f.mb_per_1000:.3f} MB per 1000 sessions"
            )
            biggest = sorted(f.tables.items(), key=lambda item: -item[1])
            large = [(name, size) for name, size in biggest if size >= f.size / 100]
            lines.append(
                "  by table and index (1% of the file or more): "
                + ", ".join(f"{name} {size / MB:.1f} MB" for name, size in large)
            )
    for target in targets(results):
        verdict = "PASS" if target.passed else "FAIL"
        lines.append(f"target: {target.rule}: {target.measured:.2f}: {verdict}")
    return "\n".join(lines)


def as_json(
    command: str, facts: dict[str, Any], args: argparse.Namespace, results: Sequence[Result]
) -> dict[str, Any]:
    judged = [t.as_json() for t in targets(results)]
    return {
        "command": command,
        "machine": facts,
        "workload": {
            "checkpoints": list(args.checkpoints),
            "probes": args.probes,
            "rounds": args.rounds,
            "in_flight": args.in_flight,
        },
        "stores": {
            r.store: {
                "curve": [
                    {
                        "sessions": p.existing,
                        "rounds_us": [round(us, 1) for us in p.rounds_us],
                        "median_us": round(p.median_us, 1),
                    }
                    for p in r.points
                ],
                "ratio_last_over_first": round(r.ratio, 3),
                "file": None
                if r.file is None
                else {**asdict(r.file), "mb_per_1000_sessions": round(r.file.mb_per_1000, 3)},
            }
            for r in results
        },
        "targets": judged,
        "passed": all(t["passed"] for t in judged),
    }


def checkpoint_list(text: str) -> tuple[int, ...]:
    try:
        chosen = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"expected numbers, not {text!r}") from error
    if len(chosen) < 2 or any(b <= a for a, b in itertools.pairwise(chosen)) or chosen[0] < 1:
        raise argparse.ArgumentTypeError(f"expected two or more growing numbers, not {text!r}")
    return chosen


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--checkpoints",
        type=checkpoint_list,
        default=CHECKPOINTS,
        help="sessions that exist when probing (default 1000,10000,100000)",
    )
    parser.add_argument("--probes", type=positive, default=100, help="per round (default 100)")
    parser.add_argument("--rounds", type=positive, default=9, help="per checkpoint (default 9)")
    parser.add_argument("--in-flight", type=positive, default=50, help="at most (default 50)")
    parser.add_argument("--stores", type=store_list, default=STORES, help="memory,sqlite")
    parser.add_argument("--json", action="store_true", help="print machine-readable results")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child is not None:
        return child(args.child)
    results = [measure_store(store, args.checkpoints, args) for store in args.stores]
    command, facts = command_line("scale", argv), machine()
    if args.json:
        print(json.dumps(as_json(command, facts, args, results), indent=2))
    else:
        print(render(command, facts, args, results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
