"""A gateway worker process for the multi-process tests.

Reads one JSON message per line on stdin (``{"chat", "text", "id"}``; ``{"quit": true}``
shuts down gracefully) and appends JSON events to a shared log file: turn
``start``/``end`` (with a system-wide monotonic clock; ``end`` also says
whether the turn still held a live lease then, and ``answers`` every message
the turn answers, steered ones included), each message's one ``outcome`` (or
``not taken: <error>`` for one the gateway refused to take),
every ``deliver``, every
``write`` a turn attempts after sleeping (``accepted`` or ``refused``), and,
when told to quit, its heartbeats (``beats``: how many, the longest gap) and
its lease counters (``leases``: leases lost, stale writes and replies refused).
Prints ``ready`` once the gateway has started.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import sys
import time
from typing import Any

from chatlane.errors import ChatlaneError, StaleGeneration
from chatlane.gateway import Gateway, GatewaySettings
from chatlane.identity import SessionSource
from chatlane.runtime.engine import RuntimeSettings
from chatlane.runtime.leases import LeaseSettings
from chatlane.runtime.outcomes import MessageOutcome
from chatlane.runtime.turn import Turn
from chatlane.stores import Store, TranscriptEntry, open_store
from chatlane.types import InboundMessage, Outbound, accepts_steering


class SharedLog:
    """Appends one JSON line per event; O_APPEND keeps lines from different processes whole."""

    def __init__(self, path: str, name: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.name = name

    def write(self, event: str, **fields: Any) -> None:
        record = {"event": event, "worker": self.name, "t": time.monotonic_ns(), **fields}
        os.write(self.fd, (json.dumps(record) + "\n").encode())


class Agent:
    """Logs its turns; ``sleep <s>`` holds the turn (or less, if interrupted), then writes."""

    def __init__(self, log: SharedLog, store: Store) -> None:
        self.log = log
        self.store = store

    async def __call__(self, turn: Turn) -> str:
        ids = list(turn.message_ids)
        self.log.write("start", key=turn.session_key, gen=turn.generation, ids=ids)
        try:
            if turn.text.startswith("sleep "):
                await self._hold(turn, float(turn.text.split()[1]))
            else:
                await asyncio.sleep(0.001 + (hash(turn.text) % 5) / 1000)
            steered = turn.take_steers() if accepts_steering(self) else []
            return " + ".join([f"done {turn.text}", *steered])
        finally:
            current = turn.is_current()  # its lease was renewed in time and still holds
            answers = list(turn.message_ids)
            self.log.write(
                "end",
                key=turn.session_key,
                gen=turn.generation,
                ids=ids,
                current=current,
                answers=answers,
            )

    async def _hold(self, turn: Turn, seconds: float) -> None:
        """Hold, then write — even when the turn is cancelled: a tool that writes anyway,
        which only the store's fencing can stop (a turn whose lease ran out is cancelled)."""
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(turn.interrupted.wait(), seconds)
        finally:
            await asyncio.shield(self._late_write(turn))

    async def _late_write(self, turn: Turn) -> None:
        entry = TranscriptEntry("tool", "late write", turn.generation)
        try:
            await self.store.append_transcript(turn.session_key, turn.generation, entry)
            self.log.write("write", key=turn.session_key, gen=turn.generation, result="accepted")
        except StaleGeneration:
            self.log.write("write", key=turn.session_key, gen=turn.generation, result="refused")


class FenceLog(logging.Handler):
    """Turns the engine's 'fenced stale …' and 'turn superseded …' lines into shared-log events."""

    def __init__(self, log: SharedLog) -> None:
        super().__init__(logging.INFO)
        self.log = log

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("fenced stale"):
            self.log.write("fenced", detail=message)
        elif message.startswith("turn superseded"):
            self.log.write("superseded", detail=message)
        elif message.startswith("drew in"):
            self.log.write("drawn", detail=message)
        elif message.startswith("adopted message"):
            adopted = record.args[0] if isinstance(record.args, tuple) and record.args else ""
            self.log.write("adopted", ids=[str(adopted)])


async def serve(args: argparse.Namespace) -> None:
    log = SharedLog(args.log, args.name)
    logging.getLogger("chatlane.runtime").addHandler(FenceLog(log))
    logging.getLogger("chatlane.runtime").setLevel(logging.INFO)
    store = await open_store(args.store)

    async def deliver(outbound: Outbound) -> None:
        log.write(
            "deliver",
            kind=outbound.kind.value,
            key=outbound.session_key,
            gen=outbound.generation,
            ids=list(outbound.in_reply_to),
            text=outbound.text,
        )

    settings = GatewaySettings(
        runtime=RuntimeSettings(leases=LeaseSettings(ttl=args.ttl), turn_timeout=0, ack_debounce=0)
    )

    def ended(outcome: MessageOutcome) -> None:
        log.write("outcome", ids=[outcome.message_id], outcome=outcome.outcome.value)

    agent = (SteeredAgent if args.ordered else Agent)(log, store)
    gateway = Gateway(agent, deliver, settings=settings, store=store, on_outcome=ended)
    await gateway.start()
    print("ready", flush=True)
    await read_messages(gateway, log, ordered=args.ordered)
    beats = gateway.engine.leases.beats
    log.write("beats", count=beats.count, longest=beats.longest)
    metrics = gateway.engine.metrics
    log.write("leases", lost=metrics.lease_failures, stale=metrics.stale_refused)
    await gateway.aclose()
    await store.close()


async def read_messages(gateway: Gateway, log: SharedLog, *, ordered: bool) -> None:
    """Dispatch each line's message; with ``ordered``, a chat's in the order sent."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    tasks: set[asyncio.Task[Any]] = set()
    last: dict[str, asyncio.Task[Any]] = {}
    while line := await reader.readline():
        data = json.loads(line)
        if data.get("quit"):
            break
        source = SessionSource("test", chat_id=data["chat"], user_id="u")
        message = InboundMessage(source, data["text"], id=data["id"])
        previous = last.get(data["chat"]) if ordered else None
        task = asyncio.create_task(dispatch_after(previous, gateway, message, log))
        last[data["chat"]] = task
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    await asyncio.gather(*tasks)


async def dispatch_after(
    previous: asyncio.Task[Any] | None, gateway: Gateway, message: InboundMessage, log: SharedLog
) -> None:
    """Dispatch ``message`` once its chat's previous message was accepted, as a chat
    adapter keeps a chat's order; chats are dispatched concurrently. A message the
    gateway refuses to take (its store failing) is logged as ending ``not taken``, so
    that a test waiting for every message's end sees it at once."""
    if previous is not None:
        await asyncio.wait([previous])
    try:
        await gateway.dispatch(message)
    except ChatlaneError as error:  # told to its sender, never accepted: no outcome follows
        log.write("outcome", ids=[message.id], outcome=f"not taken: {error}")


class SteeredAgent(Agent):
    """:class:`Agent` that takes what was steered into the turn just before it answers."""

    accepts_steering = True


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", required=True)
    parser.add_argument("--log", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--ttl", type=float, default=1.0)
    parser.add_argument(
        "--ordered",
        action="store_true",
        help="dispatch a chat's messages one after the other, and take steered text",
    )
    asyncio.run(serve(parser.parse_args()))


if __name__ == "__main__":
    main()
