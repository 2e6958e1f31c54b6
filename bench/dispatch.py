"""Cost per message of chatlane's gateway next to aiogram 3's ``Dispatcher`` and a floor, in memory.

Every side gets the same workload and does the same work per message: read a
per-session counter, write it back incremented. What stays true:

* Every input is prepared before the clock starts; only handling is timed. A
  raw side starts from each update as the Bot API's JSON sends it, so parsing
  it is inside the clock: aiogram's (``feed_raw_update``) and chatlane's
  Telegram adapter's (``Update.de_json``, then
  :func:`~chatlane.adapters.telegram.inbound_message`).
* Each timed section records its wall time and the process's CPU time; a
  figure is µs per message, the median over rounds. Targets are judged on CPU
  time.
* A session's messages are spaced as in chat traffic: chatlane re-reads the
  session's stored choices at every turn, inside the clock
  (:data:`SPACED_MESSAGES`).
* A message counts as done when its handling ended: for chatlane when
  ``deliver`` got the agent's reply (dispatch → turn → agent → reply), for
  aiogram when ``feed_update`` returned (middlewares → FSM → handler).
* At most ``in_flight`` messages are in flight: one worker task per lane, each
  awaiting its message before the next. A session belongs to exactly one lane,
  so its messages are handled in order on every side.
* Each run builds a fresh gateway or dispatcher and checks afterwards that every
  session's counter equals the number of messages it got; a miss raises.
* aiogram's raw updates are compared with chatlane's raw updates only, never
  with chatlane's prepared messages.

Run ``python -m bench.dispatch --help`` for the options.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import functools
import itertools
import json
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import telegram
from aiogram import Bot, Dispatcher
from aiogram.dispatcher.event.bases import UNHANDLED
from aiogram.fsm.storage.memory import MemoryStorage, SimpleEventIsolation

from bench.common import (
    BOT_ID,
    SENT_AT,
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
from chatlane.adapters.telegram import inbound_message
from chatlane.adapters.telegram_groups import BotIdentity
from chatlane.config import TelegramConfig
from chatlane.gateway import Gateway, GatewaySettings
from chatlane.groups import GroupPolicy
from chatlane.identity import SessionSource
from chatlane.runtime.settings import RuntimeSettings
from chatlane.runtime.turn import Turn
from chatlane.state import ConversationState, SessionRegistry
from chatlane.types import InboundMessage, Outbound, OutboundKind

TARGET_OVER_FLOOR = 3.0
"""chatlane passes when its CPU time per message is at most this many times the floor's."""
TARGET_OVER_AIOGRAM = 0.25
"""… and at most this share of aiogram's, fed prebound ``Update`` objects."""
DEFAULT_MAX_SESSIONS = 10_000
"""``SessionRegistry``'s own default, kept unless the workload needs more."""
BOT_USERNAME = "bench_bot"
"""The bot's username as chatlane's Telegram adapter knows it (commands may name it)."""
SPACED_MESSAGES = RuntimeSettings(reread_stored=0.0)
"""The engine's settings, standing for a session's messages seconds apart.

The engine trusts a session's stored choices for ``reread_stored`` seconds (1
by default) and has the store read them again with the first message after
that. In chat traffic a session's messages come seconds apart, so every turn
re-reads; here they come micro- to milliseconds apart, and 0 makes every turn
re-read as it would there. (With 0 the engine also re-applies the choices read
with the message once more after taking the lease, a little more than spaced
messages cost.)
"""


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
        settings = GatewaySettings(runtime=SPACED_MESSAGES)
        self.gateway = Gateway(self.agent, self.deliver, settings=settings, registry=self.registry)
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

    async def check(self, name: str, workload: Workload, sources: dict[int, SessionSource]) -> None:
        """Close the gateway; :raises BenchError: unless every message got its reply and count."""
        await self.gateway.aclose()
        if self.replies != workload.total:
            raise BenchError(f"{name}: {self.replies} replies for {workload.total} messages")
        check_counts(name, "counter", self.counters(sources), workload.messages)


def chatlane_source(session: int) -> SessionSource:
    """The private chat of session ``session``'s user, as a Telegram adapter would name it."""
    uid = str(user_id(session))
    return SessionSource("telegram", chat_id=uid, user_id=uid)


async def run_chatlane(workload: Workload, lanes: list[list[int]]) -> Elapsed:
    """One timed chatlane run on a fresh gateway, fed prepared ``InboundMessage`` objects."""
    side = ChatlaneSide(workload.sessions)
    sources = {s: chatlane_source(s) for s in range(workload.sessions)}
    inputs = [[InboundMessage(sources[s], "hello") for s in lane] for lane in lanes]
    try:
        elapsed = await drive_timed(inputs, side.handle)
    finally:
        await side.check("chatlane", workload, sources)
    return elapsed


BOT = BotIdentity(BOT_ID, BOT_USERNAME)
GROUPS = GroupPolicy(TelegramConfig(), "telegram")
"""The adapter's group rule as configured by default (the bench writes in private chats)."""


def ptb_bot() -> telegram.Bot:
    """The python-telegram-bot ``Bot`` that parsed updates are bound to, as polling binds them."""
    return telegram.Bot(f"{BOT_ID}:TEST")


def adapter_message(update: dict[str, Any], bot: telegram.Bot) -> InboundMessage:
    """What chatlane's Telegram adapter makes of one raw update (parsed as polling parses it)."""
    message = inbound_message(telegram.Update.de_json(update, bot), BOT, GROUPS)
    if message is None:
        raise BenchError(f"the Telegram adapter made no message of update {update['update_id']}")
    return message


async def run_chatlane_raw(workload: Workload, lanes: list[list[int]]) -> Elapsed:
    """One timed chatlane run on a fresh gateway, fed the Bot API's JSON of each update.

    Per message, inside the clock: the adapter's parsing (``Update.de_json``
    bound to the bot, :func:`~chatlane.adapters.telegram.inbound_message`), then
    the same dispatch as :func:`run_chatlane`.
    """
    side = ChatlaneSide(workload.sessions)
    bot = ptb_bot()
    sources = {s: adapter_message(raw_update(0, s), bot).source for s in range(workload.sessions)}
    ids = iter(range(1, workload.total + 1))
    inputs = [[raw_update(next(ids), s) for s in lane] for lane in lanes]

    async def handle(update: dict[str, Any]) -> None:
        await side.handle(adapter_message(update, bot))

    try:
        elapsed = await drive_timed(inputs, handle)
    finally:
        await side.check("chatlane/raw", workload, sources)
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


async def run_aiogram(workload: Workload, lanes: list[list[int]], raw: bool = False) -> Elapsed:
    """One timed aiogram run on a fresh dispatcher and storage.

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
        elapsed = await drive_timed(inputs, handle)
    finally:
        await bot.session.close()
        await dp.storage.close()
    counters = await aiogram_counters(storage, workload.sessions)
    check_counts("aiogram/raw" if raw else "aiogram", "counter", counters, workload.messages)
    return elapsed


# --- the floor ------------------------------------------------------------------

FLOOR_SESSION: contextvars.ContextVar[int] = contextvars.ContextVar("floor_session")


async def run_floor(workload: Workload, lanes: list[list[int]]) -> Elapsed:
    """The least any turn runtime does per message here.

    One cancellable task per turn in a fresh context with the session bound,
    the message written to a dict (the "durable queue") and removed at the
    "commit", the counter bumped, the reply handed back through a future. No
    store, lease, fence, busy policy or outbound record: chatlane can never cost
    less than this, so ``floor / aiogram`` is the lowest ``chatlane / aiogram``
    any design with a task per turn could reach on this machine.
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

    elapsed = await drive_timed(lanes, handle)
    check_counts("floor", "counter", counters, workload.messages)
    return elapsed


# --- measuring and reporting --------------------------------------------------

Run = Callable[[Workload, list[list[int]]], Awaitable[Elapsed]]

SIDES: dict[str, Run] = {
    "chatlane": run_chatlane,
    "chatlane/raw": run_chatlane_raw,
    "aiogram": run_aiogram,
    "aiogram/raw": functools.partial(run_aiogram, raw=True),
    "floor": run_floor,
}
"""Every side, in the order each round runs them and the table shows them."""

RATIOS: tuple[tuple[str, str], ...] = (
    ("chatlane", "floor"),
    ("chatlane", "aiogram"),
    ("aiogram", "floor"),
    ("chatlane/raw", "aiogram/raw"),
)
"""The ratios of medians shown (side / side): below 1, the first side costs less."""


@dataclass(frozen=True, slots=True)
class Report:
    """Every side's rounds, and what they were measured on."""

    workload: Workload
    sides: dict[str, Rounds]
    machine: dict[str, Any]

    def cpu_ratio(self, side: str, over: str) -> float:
        return self.sides[side].cpu / self.sides[over].cpu

    def wall_ratio(self, side: str, over: str) -> float:
        return self.sides[side].wall / self.sides[over].wall

    @property
    def targets(self) -> list[Target]:
        """chatlane's CPU time per message against the floor's and against aiogram's."""
        return [
            Target(
                f"chatlane / floor, CPU per message <= {TARGET_OVER_FLOOR:g}x",
                self.cpu_ratio("chatlane", "floor"),
                TARGET_OVER_FLOOR,
            ),
            Target(
                f"chatlane / aiogram, CPU per message <= 1/{1 / TARGET_OVER_AIOGRAM:g}",
                self.cpu_ratio("chatlane", "aiogram"),
                TARGET_OVER_AIOGRAM,
            ),
        ]

    @property
    def passed(self) -> bool:
        return all(target.passed for target in self.targets)

    def as_json(self) -> dict[str, Any]:
        w = self.workload
        return {
            "machine": self.machine,
            "workload": {
                "sessions": w.sessions,
                "messages": w.messages,
                "in_flight": w.in_flight,
                "reread_stored": SPACED_MESSAGES.reread_stored,
            },
            "sides": {name: rounds.as_json() for name, rounds in self.sides.items()},
            "ratios": {
                f"{side} / {over}": {
                    "cpu": round(self.cpu_ratio(side, over), 3),
                    "wall": round(self.wall_ratio(side, over), 3),
                }
                for side, over in RATIOS
            },
            "targets": [target.as_json() for target in self.targets],
            "passed": self.passed,
        }


async def measure(workload: Workload, rounds: int) -> Report:
    """A warmup run per side, then ``rounds`` timed rounds, each running every side once."""
    lanes = plan_lanes(workload.sessions, workload.messages, workload.in_flight)
    for run in SIDES.values():
        await run(workload, lanes)
    wall: dict[str, list[float]] = {name: [] for name in SIDES}
    cpu: dict[str, list[float]] = {name: [] for name in SIDES}
    for _ in range(rounds):
        for name, run in SIDES.items():
            elapsed = await run(workload, lanes)
            wall[name].append(elapsed.wall_ns / workload.total / 1_000)
            cpu[name].append(elapsed.cpu_ns / workload.total / 1_000)
    sides = {name: Rounds(tuple(wall[name]), tuple(cpu[name])) for name in SIDES}
    return Report(workload, sides, machine())


def render(report: Report) -> str:
    w = report.workload
    rounds = len(report.sides["chatlane"].cpu_us)
    lines = [
        f"machine: {describe_machine(report.machine)}",
        f"versions: {describe_versions(report.machine)}",
        f"workload: {w.sessions} sessions x {w.messages} messages = {w.total}, "
        f"{w.in_flight} in flight, {rounds} rounds (+1 warmup); every turn re-reads "
        "the stored choices (messages spaced as in chat traffic)",
        "µs per message, medians of the rounds; CPU = the process's CPU time",
        f"{'side':<14}{'CPU':>8}{'wall':>8}{'msgs/s':>9}   rounds CPU | wall",
    ]
    for name, measured in report.sides.items():
        lines.append(side_line(name, measured))
    for side, over in RATIOS:
        lines.append(
            f"ratio {side} / {over}: CPU {report.cpu_ratio(side, over):.3f}, "
            f"wall {report.wall_ratio(side, over):.3f}{ratio_note(report, side, over)}"
        )
    for target in report.targets:
        lines.append(f"target: {target.rule}: {target.measured:.3f}: {target.verdict}")
    return "\n".join(lines)


def side_line(name: str, measured: Rounds) -> str:
    """One row of the table: the medians, messages per second (wall), every round."""
    cpu = " ".join(f"{r:.1f}" for r in measured.cpu_us)
    wall = " ".join(f"{r:.1f}" for r in measured.wall_us)
    per_second = 1e6 / measured.wall
    return f"{name:<14}{measured.cpu:>8.1f}{measured.wall:>8.1f}{per_second:>9.0f}   {cpu} | {wall}"


def ratio_note(report: Report, side: str, over: str) -> str:
    """What a ratio means, where the name alone does not say it."""
    if (side, over) == ("aiogram", "floor"):
        ceiling = report.cpu_ratio("floor", "aiogram")
        return f" (so chatlane / aiogram cannot go below {ceiling:.3f} with a task per turn)"
    if (side, over) == ("chatlane/raw", "aiogram/raw"):
        return " (both parse the Bot API's JSON inside the clock; not judged)"
    return ""


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
