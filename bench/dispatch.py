"""Cost per message of chatlane's gateway next to aiogram 3's ``Dispatcher``, in memory.

Both sides get the same workload and do the same work per message: read a
per-session counter, write it back incremented. What stays true:

* Every message is prepared before the clock starts; only handling is timed.
* A message counts as done when its handling ended: for chatlane when
  ``deliver`` got the agent's reply (dispatch → turn → agent → reply), for
  aiogram when ``feed_update`` returned (middlewares → FSM → handler).
* At most ``in_flight`` messages are in flight: one worker task per lane, each
  awaiting its message before the next. A session belongs to exactly one lane,
  so its messages are handled in order on both sides.
* Each run builds a fresh gateway or dispatcher and checks afterwards that every
  session's counter equals the number of messages it got; a miss raises.

Run ``python -m bench.dispatch --help`` for the options.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import itertools
import json
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from aiogram import Bot, Dispatcher
from aiogram.dispatcher.event.bases import UNHANDLED
from aiogram.fsm.storage.memory import MemoryStorage, SimpleEventIsolation

from bench.common import (
    BOT_ID,
    SENT_AT,
    BenchError,
    aiogram_counters,
    check_counts,
    drive,
    on_message,
    plan_lanes,
    positive,
    telegram_update,
    user_id,
)
from chatlane.gateway import Gateway
from chatlane.identity import SessionSource
from chatlane.runtime.turn import Turn
from chatlane.state import ConversationState, SessionRegistry
from chatlane.types import InboundMessage, Outbound, OutboundKind

TARGET_RATIO = 10.0
"""chatlane passes when aiogram's cost per message is at least this many times its own."""
DEFAULT_MAX_SESSIONS = 10_000
"""``SessionRegistry``'s own default, kept unless the workload needs more."""


@dataclass(frozen=True, slots=True)
class Workload:
    """How many sessions, messages per session, and messages in flight at most."""

    sessions: int
    messages: int
    in_flight: int

    @property
    def total(self) -> int:
        return self.sessions * self.messages


# --- chatlane -----------------------------------------------------------------


@dataclass(slots=True)
class BenchConversation(ConversationState):
    """The conversation scope plus the benchmark's counter."""

    counter: int = 0


class ChatlaneSide:
    """A gateway whose agent bumps a counter in the session's conversation state."""

    def __init__(self, sessions: int) -> None:
        # Room for every session: an evicted one would take its counter with it.
        capacity = max(sessions, DEFAULT_MAX_SESSIONS)
        self.registry = SessionRegistry(conversation_cls=BenchConversation, max_sessions=capacity)
        self.gateway = Gateway(self.agent, self.deliver, registry=self.registry)
        self.waiting: dict[str, asyncio.Future[None]] = {}
        self.replies = 0

    async def agent(self, turn: Turn) -> str:
        conversation = self.registry.get(turn.session_key).conversation
        if not isinstance(conversation, BenchConversation):
            raise BenchError(f"conversation state is a {type(conversation).__name__}")
        conversation.counter += 1
        return "ok"

    async def deliver(self, outbound: Outbound) -> None:
        done = self.waiting.pop(outbound.in_reply_to[0])
        if outbound.kind is not OutboundKind.REPLY:
            done.set_exception(BenchError(f"chatlane sent a {outbound.kind}: {outbound.text}"))
            return
        self.replies += 1
        done.set_result(None)

    async def handle(self, message: InboundMessage) -> None:
        done = asyncio.get_running_loop().create_future()
        self.waiting[message.id] = done
        result = await self.gateway.dispatch(message)
        if not result.started:
            raise BenchError(f"chatlane did not start a turn: {result}")
        await done

    def counters(self, sources: dict[int, SessionSource]) -> dict[int, int]:
        counters: dict[int, int] = {}
        for session, source in sources.items():
            state = self.registry.peek(self.gateway.session_key(InboundMessage(source, "")))
            conversation = None if state is None else state.conversation
            counters[session] = getattr(conversation, "counter", 0)
        return counters


def chatlane_source(session: int) -> SessionSource:
    """The private chat of session ``session``'s user, as a Telegram adapter would name it."""
    uid = str(user_id(session))
    return SessionSource("telegram", chat_id=uid, user_id=uid)


async def run_chatlane(workload: Workload, lanes: list[list[int]]) -> int:
    """One timed chatlane run on a fresh gateway; the wall time in ns."""
    side = ChatlaneSide(workload.sessions)
    sources = {s: chatlane_source(s) for s in range(workload.sessions)}
    inputs = [[InboundMessage(sources[s], "hello") for s in lane] for lane in lanes]
    try:
        elapsed = await drive(inputs, side.handle)
    finally:
        await side.gateway.aclose()
    if side.replies != workload.total:
        raise BenchError(f"chatlane: {side.replies} replies for {workload.total} messages")
    check_counts("chatlane", "counter", side.counters(sources), workload.messages)
    return elapsed


# --- aiogram ------------------------------------------------------------------


def raw_update(update_id: int, session: int) -> dict[str, Any]:
    """The same message as :func:`telegram_update`, as the Bot API's JSON sends it."""
    uid = user_id(session)
    return {
        "update_id": update_id,
        "message": {
            "message_id": update_id,
            "date": int(SENT_AT.timestamp()),
            "chat": {"id": uid, "type": "private"},
            "from": {"id": uid, "is_bot": False, "first_name": f"user{session}"},
            "text": "hello",
        },
    }


async def run_aiogram(workload: Workload, lanes: list[list[int]], raw: bool = False) -> int:
    """One timed aiogram run on a fresh dispatcher and storage; the wall time in ns.

    ``raw`` feeds each update as the Bot API's JSON (``feed_raw_update``, which
    validates it into an ``Update`` as a webhook does) instead of a prepared one.
    """
    storage = MemoryStorage()
    dp = Dispatcher(storage=storage, events_isolation=SimpleEventIsolation())
    dp.message.register(on_message)
    bot = Bot(f"{BOT_ID}:TEST")
    ids = iter(range(1, workload.total + 1))
    make = (lambda i, s: raw_update(i, s)) if raw else (lambda i, s: telegram_update(bot, i, s))
    inputs = [[make(next(ids), s) for s in lane] for lane in lanes]

    async def handle(update: Any) -> None:
        feed = dp.feed_raw_update if raw else dp.feed_update
        if await feed(bot, update) is UNHANDLED:
            raise BenchError("aiogram left an update unhandled")

    try:
        elapsed = await drive(inputs, handle)
    finally:
        await bot.session.close()
        await dp.storage.close()
    counters = await aiogram_counters(storage, workload.sessions)
    check_counts("aiogram", "counter", counters, workload.messages)
    return elapsed


# --- the floor ------------------------------------------------------------------

FLOOR_SESSION: contextvars.ContextVar[int] = contextvars.ContextVar("floor_session")


async def run_floor(workload: Workload, lanes: list[list[int]]) -> int:
    """The least any turn runtime does per message here; the wall time in ns.

    One cancellable task per turn in a fresh context with the session bound,
    the message written to a dict (the "durable queue") and removed at the
    "commit", the counter bumped, the reply handed back through a future. No
    store, lease, fence, busy policy or outbound record: chatlane can never cost
    less than this, so ``aiogram / floor`` is the highest ratio any design with a
    task per turn could reach on this machine.
    """
    loop = asyncio.get_running_loop()
    queued: dict[int, int] = {}
    counters: dict[int, int] = {}
    sequence = itertools.count()

    async def turn(session: int, done: asyncio.Future[str]) -> None:
        FLOOR_SESSION.set(session)
        counters[session] = counters.get(session, 0) + 1
        queued.pop(session, None)
        done.set_result("ok")

    async def handle(session: int) -> None:
        done: asyncio.Future[str] = loop.create_future()
        queued[session] = next(sequence)
        task = asyncio.create_task(turn(session, done), context=contextvars.Context())
        await done
        await task

    elapsed = await drive(lanes, handle)
    check_counts("floor", "counter", counters, workload.messages)
    return elapsed


# --- measuring and reporting --------------------------------------------------


@dataclass(frozen=True, slots=True)
class Report:
    """µs per message of every timed round, per side."""

    workload: Workload
    chatlane_us: tuple[float, ...]
    aiogram_us: tuple[float, ...]
    aiogram_raw_us: tuple[float, ...]
    floor_us: tuple[float, ...]

    @property
    def ratio(self) -> float:
        return statistics.median(self.aiogram_us) / statistics.median(self.chatlane_us)

    @property
    def passed(self) -> bool:
        return self.ratio >= TARGET_RATIO

    def as_json(self) -> dict[str, Any]:
        w = self.workload
        return {
            "workload": {"sessions": w.sessions, "messages": w.messages, "in_flight": w.in_flight},
            "chatlane": side_json(self.chatlane_us),
            "aiogram": side_json(self.aiogram_us),
            "aiogram_raw_updates": side_json(self.aiogram_raw_us),
            "floor": side_json(self.floor_us),
            "ratio_aiogram_over_floor": round(
                statistics.median(self.aiogram_us) / statistics.median(self.floor_us), 3
            ),
            "ratio_aiogram_raw_over_chatlane": round(
                statistics.median(self.aiogram_raw_us) / statistics.median(self.chatlane_us), 3
            ),
            "ratio_aiogram_over_chatlane": round(self.ratio, 3),
            "target_ratio": TARGET_RATIO,
            "passed": self.passed,
        }


def side_json(rounds: tuple[float, ...]) -> dict[str, Any]:
    return {
        "rounds_us": [round(r, 3) for r in rounds],
        "median_us": round(statistics.median(rounds), 3),
    }


async def measure(workload: Workload, rounds: int) -> Report:
    """A warmup run per side, then ``rounds`` timed runs alternating chatlane and aiogram."""
    lanes = plan_lanes(workload.sessions, workload.messages, workload.in_flight)
    await run_chatlane(workload, lanes)
    await run_aiogram(workload, lanes)
    await run_aiogram(workload, lanes, raw=True)
    await run_floor(workload, lanes)
    chatlane: list[float] = []
    aiogram: list[float] = []
    aiogram_raw: list[float] = []
    floor: list[float] = []
    for _ in range(rounds):
        chatlane.append(await run_chatlane(workload, lanes) / workload.total / 1_000)
        aiogram.append(await run_aiogram(workload, lanes) / workload.total / 1_000)
        aiogram_raw.append(await run_aiogram(workload, lanes, raw=True) / workload.total / 1_000)
        floor.append(await run_floor(workload, lanes) / workload.total / 1_000)
    return Report(workload, tuple(chatlane), tuple(aiogram), tuple(aiogram_raw), tuple(floor))


def render(report: Report) -> str:
    w = report.workload
    lines = [
        f"workload: {w.sessions} sessions x {w.messages} messages = {w.total}, "
        f"{w.in_flight} in flight, {len(report.chatlane_us)} rounds (+1 warmup)",
        f"{'side':<12}{'median µs/msg':>13}{'msgs/s':>10}   rounds µs/msg",
    ]
    sides = (
        ("chatlane", report.chatlane_us),
        ("aiogram", report.aiogram_us),
        ("aiogram/raw", report.aiogram_raw_us),
        ("floor", report.floor_us),
    )
    for name, rounds in sides:
        median = statistics.median(rounds)
        shown = " ".join(f"{r:.1f}" for r in rounds)
        lines.append(f"{name:<12}{median:>13.1f}{1e6 / median:>10.0f}   {shown}")
    verdict = "PASS" if report.passed else "FAIL"
    raw_ratio = statistics.median(report.aiogram_raw_us) / statistics.median(report.chatlane_us)
    lines.append(f"ratio aiogram/chatlane: {report.ratio:.2f}x (raw updates: {raw_ratio:.2f}x)")
    ceiling = statistics.median(report.aiogram_us) / statistics.median(report.floor_us)
    lines.append(f"ratio aiogram/floor: {ceiling:.2f}x (no design with a task per turn beats it)")
    lines.append(
        f"target: chatlane at most 1/{TARGET_RATIO:g} of aiogram's cost per message: {verdict}"
    )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--sessions", type=positive, default=1_000, help="sessions (default 1000)")
    parser.add_argument("--messages", type=positive, default=20, help="per session (default 20)")
    parser.add_argument("--in-flight", type=positive, default=50, help="at most (default 50)")
    parser.add_argument("--rounds", type=positive, default=3, help="timed rounds (default 3)")
    parser.add_argument("--json", action="store_true", help="print machine-readable results")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    workload = Workload(args.sessions, args.messages, args.in_flight)
    report = asyncio.run(measure(workload, args.rounds))
    print(json.dumps(report.as_json(), indent=2) if args.json else render(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
