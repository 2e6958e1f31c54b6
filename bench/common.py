"""What every benchmark shares: the lanes that bound messages in flight, the timer,
the correctness checks, targets, and the aiogram side's handler and updates.

What stays true: the same seeded plan on every side, inputs built before the
clock starts, a GC before every timed section, and a run whose side did not do
all its work raises :class:`BenchError` instead of printing figures.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import platform
import random
import sqlite3
import statistics
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import metadata
from typing import Any, Protocol, TypeVar

from aiogram import Bot
from aiogram.fsm.context import FSMContext
from aiogram.fsm.storage.base import StorageKey
from aiogram.types import Chat, Message, Update, User

T = TypeVar("T")

BOT_ID = 42
SEED = 20_240_601
SENT_AT = datetime(2024, 6, 1, tzinfo=UTC)


class BenchError(RuntimeError):
    """A side did not do the work it was timed for; its figures mean nothing."""


def plan_lanes(sessions: int, per_session: int, in_flight: int) -> list[list[int]]:
    """Session numbers in a seeded shuffled order, dealt into one lane per worker.

    Session ``s`` goes to lane ``s % in_flight``; the shuffle mixes sessions but
    keeps each one's work in order, because its items are interchangeable copies.
    """
    stream = [s for s in range(sessions) for _ in range(per_session)]
    random.Random(SEED).shuffle(stream)
    lanes: list[list[int]] = [[] for _ in range(in_flight)]
    for session in stream:
        lanes[session % in_flight].append(session)
    return [lane for lane in lanes if lane]


def user_id(session: int) -> int:
    """The Telegram-style id of session ``session``'s user (and private chat)."""
    return 1_000 + session


@dataclass(frozen=True, slots=True)
class Elapsed:
    """One timed section: wall time, and the process's CPU time (every thread), in ns."""

    wall_ns: int
    cpu_ns: int


async def drive(lanes: Sequence[Sequence[T]], handle: Callable[[T], Awaitable[None]]) -> int:
    """Handle every lane in its own worker task; return the wall time in ns (after a GC)."""
    return (await drive_timed(lanes, handle)).wall_ns


async def drive_timed(
    lanes: Sequence[Sequence[T]], handle: Callable[[T], Awaitable[None]]
) -> Elapsed:
    """:func:`drive`, with the CPU time of the same section beside the wall time."""

    async def worker(lane: Sequence[T]) -> None:
        for item in lane:
            await handle(item)

    gc.collect()
    cpu_start, wall_start = time.process_time_ns(), time.perf_counter_ns()
    await asyncio.gather(*(worker(lane) for lane in lanes))
    wall_end, cpu_end = time.perf_counter_ns(), time.process_time_ns()
    return Elapsed(wall_end - wall_start, cpu_end - cpu_start)


def check_counts(side: str, what: str, counts: Mapping[int, int], expected: int) -> None:
    """:raises BenchError: unless every session's ``what`` equals ``expected``."""
    wrong = {s: n for s, n in counts.items() if n != expected}
    if wrong:
        sample = dict(list(wrong.items())[:5])
        raise BenchError(f"{side}: {len(wrong)} session {what}s != {expected}, e.g. {sample}")


@dataclass(frozen=True, slots=True)
class Rounds:
    """µs per message or operation in every timed round: wall time and CPU time."""

    wall_us: tuple[float, ...]
    cpu_us: tuple[float, ...]

    @property
    def wall(self) -> float:
        return statistics.median(self.wall_us)

    @property
    def cpu(self) -> float:
        return statistics.median(self.cpu_us)

    def as_json(self) -> dict[str, Any]:
        return {"wall": figures_json(self.wall_us), "cpu": figures_json(self.cpu_us)}


def figures_json(rounds: tuple[float, ...]) -> dict[str, Any]:
    return {
        "rounds_us": [round(r, 3) for r in rounds],
        "median_us": round(statistics.median(rounds), 3),
    }


@dataclass(frozen=True, slots=True)
class Target:
    """One target: ``measured`` against ``limit`` (both in the unit the rule names)."""

    rule: str
    measured: float
    limit: float

    @property
    def passed(self) -> bool:
        return self.measured <= self.limit

    @property
    def verdict(self) -> str:
        return "PASS" if self.passed else "FAIL"

    def as_json(self) -> dict[str, Any]:
        return {
            "rule": self.rule,
            "measured": round(self.measured, 3),
            "limit": round(self.limit, 3),
            "passed": self.passed,
        }


MEASURED_PACKAGES = (
    "aiogram",
    "redis",
    "hiredis",
    "python-telegram-bot",
    "uvicorn",
    "starlette",
    "h11",
    "msgspec",
)
"""The installed distributions a verdict can depend on: the peers (aiogram, and redis-py,
whose version alone flips the Redis verdict, with its parser), and what both sides of a
comparison run on. The peers are pinned in the ``bench`` extra."""


def machine() -> dict[str, Any]:
    """What the figures were measured on: CPU model, CPUs, Python, load average (1, 5, 15
    min), and the versions of SQLite and of :data:`MEASURED_PACKAGES`."""
    return {
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "load_average": [round(load, 2) for load in os.getloadavg()],
        "versions": {"sqlite": sqlite3.sqlite_version, **package_versions(MEASURED_PACKAGES)},
    }


def package_versions(names: Sequence[str]) -> dict[str, str]:
    """Each distribution's installed version, ``"absent"`` where it is not installed."""
    versions: dict[str, str] = {}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "absent"
    return versions


def cpu_model() -> str:
    """The first ``model name`` in ``/proc/cpuinfo``, else what :mod:`platform` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe_machine(facts: dict[str, Any]) -> str:
    """One line for a table's head, from :func:`machine`'s facts."""
    load = " ".join(f"{value:.2f}" for value in facts["load_average"])
    return (
        f"{facts['cpu']}, {facts['cpus']} CPUs ({facts['cpus_usable']} usable), "
        f"{facts['python']}, load average {load}"
    )


def describe_versions(facts: dict[str, Any]) -> str:
    """One line naming the versions in :func:`machine`'s facts: ``aiogram 3.31.0, …``."""
    return ", ".join(f"{name} {version}" for name, version in facts["versions"].items())


def positive(text: str) -> int:
    """An argparse type: a whole number of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


# --- the aiogram side -------------------------------------------------------------


async def on_message(message: Message, state: FSMContext) -> None:
    """Read and update the chat's FSM data; return nothing, so no Bot API call is made."""
    data = await state.get_data()
    await state.update_data(counter=data.get("counter", 0) + 1)


def telegram_update(bot: Bot, update_id: int, session: int) -> Update:
    """A private-chat text message from session ``session``'s user, bound to ``bot``."""
    uid = user_id(session)
    message = Message(
        message_id=update_id,
        date=SENT_AT,
        chat=Chat(id=uid, type="private"),
        from_user=User(id=uid, is_bot=False, first_name=f"user{session}"),
        text="hello",
    ).as_(bot)
    return Update(update_id=update_id, message=message).as_(bot)


class FsmStorage(Protocol):
    async def get_data(self, key: StorageKey) -> dict[str, Any]: ...


async def aiogram_counters(storage: FsmStorage, sessions: int) -> dict[int, int]:
    """Every session's FSM counter, read back from ``storage``."""
    counters: dict[int, int] = {}
    for session in range(sessions):
        key = StorageKey(bot_id=BOT_ID, chat_id=user_id(session), user_id=user_id(session))
        counters[session] = int((await storage.get_data(key)).get("counter", 0))
    return counters
