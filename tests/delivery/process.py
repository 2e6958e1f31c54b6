"""A gateway process whose replies go through the delivery ledger to the platform stand-in.

Reads one JSON message per line on stdin (``{"chat", "text", "id"}``;
``{"quit": true}`` shuts down gracefully), runs an agent that answers
``done <text>`` (``sleep <s>`` holds the turn first), and sends replies with an
HTTP sender to ``--platform`` (:mod:`tests.delivery.platform_server`). Appends
JSON events to a shared log: ``claimed`` when its sender begins a send,
``sent`` when the platform answered it, ``outcome`` when a message ended,
``settled`` after each settlement; each is also printed on stdout as a JSON
line, so the test wakes on it. Prints ``ready`` once started.

``--fault`` makes the sender stop at one point, for a test to ``kill -9`` it
there: ``disconnected`` (it never connects, so committed replies stay in the
ledger), ``before-send`` (claimed, never sent), ``after-send`` (sent and
answered, never marked delivered).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from typing import Any

import httpx

from chatlane.delivery import Attempt, DeliverySettings, DeliveryWorker
from chatlane.errors import (
    PermanentDelivery,
    PlatformUnavailable,
    RateLimited,
    TransientDelivery,
)
from chatlane.gateway import Gateway, GatewaySettings
from chatlane.identity import SessionSource
from chatlane.runtime.engine import RuntimeSettings
from chatlane.runtime.leases import LeaseSettings
from chatlane.runtime.outcomes import MessageOutcome
from chatlane.runtime.turn import Turn
from chatlane.stores import open_store
from chatlane.types import InboundMessage, Outbound
from tests.multiprocess.worker import SharedLog

PLATFORM = "test"


class HttpSender:
    """Sends deliveries to the platform stand-in over HTTP, classifying its answers."""

    platform = PLATFORM

    def __init__(self, url: str, log: SharedLog, fault: str) -> None:
        self.url = url
        self.log = log
        self.fault = fault
        self.http = httpx.AsyncClient(timeout=5.0)

    def ready(self) -> bool:
        return self.fault != "disconnected"

    async def send(self, outbound: Outbound, attempt: Attempt) -> None:
        ids = list(outbound.in_reply_to)
        self.log.write("claimed", ids=ids, delivery=attempt.delivery_id)
        if self.fault == "before-send":
            await asyncio.Event().wait()
        body = {
            "chat": outbound.target.chat_id,
            "text": outbound.text,
            "ids": ids,
            "delivery_id": attempt.delivery_id,
            "labelled": attempt.uncertain,
        }
        try:
            response = await self.http.post(self.url + "/send", json=body)
        except httpx.ConnectError as error:
            raise PlatformUnavailable(str(error)) from error
        except httpx.HTTPError as error:
            raise TransientDelivery(str(error), maybe_sent=True) from error
        self._classify(response)
        self.log.write("sent", ids=ids, delivery=attempt.delivery_id)
        if self.fault == "after-send":
            await asyncio.Event().wait()

    @staticmethod
    def _classify(response: httpx.Response) -> None:
        status = response.status_code
        if status == 429:
            raise RateLimited("rate limited", float(response.headers.get("retry-after", "1")))
        if status == 503:
            raise PlatformUnavailable("the platform is down")
        if status >= 500:
            raise TransientDelivery(f"HTTP {status}", maybe_sent=True)
        if status >= 400:
            raise PermanentDelivery(f"HTTP {status}")


class SignallingLog(SharedLog):
    """The shared log that also prints each event on stdout, as a JSON line,
    so the test hears of it at once instead of reading the file on a timer."""

    def write(self, event: str, **fields: Any) -> None:
        super().write(event, **fields)
        print(json.dumps({"event": event, "worker": self.name, **fields}), flush=True)


async def log_settlements(worker: DeliveryWorker, log: SharedLog) -> None:
    """Log ``settled`` after each settlement the worker wrote to the store."""
    while True:
        await worker.next_settlement().wait()
        log.write("settled", ids=[])


class Agent:
    """Answers ``done <text>``; ``sleep <s>`` holds the turn first. Logs each ``start``."""

    def __init__(self, log: SharedLog) -> None:
        self.log = log

    async def __call__(self, turn: Turn) -> str:
        self.log.write("start", ids=list(turn.message_ids), gen=turn.generation)
        if turn.text.startswith("sleep "):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(turn.interrupted.wait(), float(turn.text.split()[1]))
        return f"done {turn.text}"


async def serve(args: argparse.Namespace) -> None:
    log = SignallingLog(args.log, args.name)
    store = await open_store(args.store)

    def answered(outcome: MessageOutcome) -> None:
        log.write("outcome", ids=[outcome.message_id], outcome=outcome.outcome.value)

    async def deliver(outbound: Outbound) -> None:
        log.write("direct", kind=outbound.kind.value, ids=list(outbound.in_reply_to))

    leases = LeaseSettings(ttl=args.ttl)
    settings = GatewaySettings(
        runtime=RuntimeSettings(leases=leases, turn_timeout=0, ack_debounce=0)
    )
    gateway = Gateway(
        Agent(log), deliver, settings=settings, store=store, holder=args.name, on_outcome=answered
    )
    sender = HttpSender(args.platform, log, args.fault)
    delivery = DeliverySettings(
        claim_ttl=args.claim_ttl,
        send_timeout=args.claim_ttl / 2,
        poll_interval=0.1,
        first_retry=0.05,
        max_retry=0.5,
        max_attempts=1000,
        unavailable_first=0.05,
        unavailable_max=0.5,
    )
    gateway.add_sender(sender, delivery)
    await gateway.start()
    assert gateway.delivery is not None
    watcher = asyncio.create_task(log_settlements(gateway.delivery, log))
    print("ready", flush=True)
    await read_messages(gateway, log)
    await gateway.aclose()
    watcher.cancel()
    await sender.http.aclose()
    await store.close()


async def read_messages(gateway: Gateway, log: SharedLog) -> None:
    """Dispatch each line's message; log ``accepted`` once the gateway holds it durably."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    tasks: set[asyncio.Task[None]] = set()
    while line := await reader.readline():
        data = json.loads(line)
        if data.get("quit"):
            break
        source = SessionSource(PLATFORM, chat_id=data["chat"], user_id="u")
        task = asyncio.create_task(
            accept(gateway, log, InboundMessage(source, data["text"], id=data["id"]))
        )
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    await asyncio.gather(*tasks)


async def accept(gateway: Gateway, log: SharedLog, message: InboundMessage) -> None:
    result = await gateway.dispatch(message)
    log.write("accepted", ids=[message.id], outcome=str(result.outcome))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", required=True)
    parser.add_argument("--log", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--platform", required=True)
    parser.add_argument("--fault", default="none")
    parser.add_argument("--ttl", type=float, default=1.0)
    parser.add_argument("--claim-ttl", type=float, default=2.0)
    asyncio.run(serve(parser.parse_args()))


if __name__ == "__main__":
    main()
