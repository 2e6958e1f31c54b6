"""The load generator: messages to random hosts, retried elsewhere, one link pulled meanwhile.

Runs in the root namespace and talks only to the hosts' own addresses. Each
message is one request to the OpenAI-compatible API with an
``Idempotency-Key``, so a retry (to another host, after a failure or a
timeout) names the same message. A fixed number of senders share the
messages; each message is tried at most :data:`MAX_ATTEMPTS` times, and no
sender starts a message after the deadline.

The link of one host goes down once ``down_after`` messages are answered and
the ``held`` messages (``hold …``, sent to that host then, one new session
each) are running there, so it is cut off in the middle of turns. It comes
back once ``up_after`` messages are answered and the held ones too (which
only another host can do, by taking their sessions over), or after
``max_outage`` seconds, whichever is first.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import httpx

from tests.multihost.network import Host
from tests.multihost.servers import SERVE_PORT

MAX_ATTEMPTS = 10
TIMEOUT = httpx.Timeout(20.0, connect=2.0)


@dataclass(frozen=True)
class Message:
    session: str
    index: int
    verb: str = "m"

    @property
    def text(self) -> str:
        return f"{self.verb} {self.session} {self.index}"

    @property
    def key(self) -> str:
        return f"{self.session}-{self.index}"


@dataclass(frozen=True)
class Answer:
    message: Message
    content: str
    host: str
    attempts: int
    at: float


@dataclass
class Outage:
    """When the link was down, and how many messages were answered before and during it."""

    host: str
    down: float = 0.0
    up: float = 0.0
    answered_before: int = 0
    answered_during: int = 0

    @property
    def seconds(self) -> float:
        return self.up - self.down

    def elapsed(self) -> float:
        return time.monotonic() - self.down


@dataclass
class Plan:
    """What to send where, and when the link goes down and up again."""

    hosts: list[Host]
    token: str
    flap: Host
    set_link: Callable[[Host, bool], None]
    down_after: int
    up_after: int
    max_outage: float
    concurrency: int
    deadline: float
    seed: int
    held: list[Message]
    running: Callable[[list[str]], bool]
    """Whether the turn log shows a turn of each of these texts running (started, not ended)."""


@dataclass
class Results:
    answers: dict[Message, Answer] = field(default_factory=dict)
    failures: Counter[str] = field(default_factory=Counter)
    unanswered: list[Message] = field(default_factory=list)
    outage: Outage | None = None
    seconds: float = 0.0


def messages(sessions: int, per_session: int, rng: random.Random) -> list[Message]:
    """``per_session`` messages for each of ``sessions`` sessions, in a random order."""
    every = [Message(f"mh{s}", i) for s in range(sessions) for i in range(per_session)]
    rng.shuffle(every)
    return every


class Load:
    """Sends every message until it is answered; see the module docstring."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.rng = random.Random(plan.seed)
        self.results = Results(outage=Outage(plan.flap.name))
        self.count_changed = asyncio.Condition()
        self.total = 0
        self.clients = {
            host.name: httpx.AsyncClient(
                base_url=f"http://{host.address}:{SERVE_PORT}",
                headers={"Authorization": f"Bearer {plan.token}"},
                timeout=TIMEOUT,
                limits=httpx.Limits(max_connections=plan.concurrency),
            )
            for host in plan.hosts
        }

    async def run(self, every: list[Message]) -> Results:
        started, self.total = time.monotonic(), len(every) + len(self.plan.held)
        pending = iter(every)
        flapper = asyncio.create_task(self._flap())
        try:
            await asyncio.gather(*(self._sender(pending) for _ in range(self.plan.concurrency)))
            await flapper
        finally:
            flapper.cancel()  # the link is up again when it ends, however it ends
            with contextlib.suppress(asyncio.CancelledError):
                await flapper
            for client in self.clients.values():
                await client.aclose()
        self.results.seconds = time.monotonic() - started
        return self.results

    async def _sender(self, pending: Iterator[Message]) -> None:
        for message in pending:
            await self._settle(message)

    async def _settle(self, message: Message, first: Host | None = None) -> None:
        """Send ``message`` until answered or out of attempts, and count how it ended."""
        late = time.monotonic() > self.plan.deadline
        answer = None if late else await self._send(message, first)
        if answer is None:
            self.results.unanswered.append(message)
        else:
            self.results.answers[message] = answer
        async with self.count_changed:
            self.count_changed.notify_all()

    async def _send(self, message: Message, first: Host | None = None) -> Answer | None:
        failed: str | None = None
        for attempt in range(1, MAX_ATTEMPTS + 1):
            others = [h for h in self.plan.hosts if h.name != failed]
            host = first if first and attempt == 1 else self.rng.choice(others)
            content = await self._post(host, message)
            if content is not None:
                return Answer(message, content, host.name, attempt, time.monotonic())
            failed = host.name
        return None

    async def _post(self, host: Host, message: Message) -> str | None:
        """The answer's text, or None after counting why there was none."""
        headers = {"X-Chatlane-Session": message.session, "Idempotency-Key": message.key}
        body = {"model": "chatlane", "messages": [{"role": "user", "content": message.text}]}
        try:
            response = await self.clients[host.name].post(
                "/v1/chat/completions", headers=headers, json=body
            )
        except httpx.TransportError as error:
            self.results.failures[f"{host.name}: {type(error).__name__}"] += 1
            return None
        if response.status_code != 200:
            self.results.failures[f"{host.name}: HTTP {response.status_code}"] += 1
            return None
        content: str = response.json()["choices"][0]["message"]["content"]
        return content

    async def _flap(self) -> None:
        """Pull the flapping host's link at ``down_after`` answers, plug it in at ``up_after``."""
        outage = self.results.outage
        assert outage is not None
        await self._answered(self.plan.down_after, within=None)
        held = [self._settle(m, first=self.plan.flap) for m in self.plan.held]
        senders = asyncio.gather(*held)
        try:
            await self._until_running([m.text for m in self.plan.held])
            await asyncio.to_thread(self.plan.set_link, self.plan.flap, False)
            outage.down, outage.answered_before = time.monotonic(), len(self.results.answers)
            await self._answered(self.plan.up_after, within=self.plan.max_outage)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.plan.max_outage - outage.elapsed()):
                    await asyncio.shield(senders)
        finally:
            await asyncio.to_thread(self.plan.set_link, self.plan.flap, True)
            outage.up = time.monotonic()
            outage.answered_during = len(self.results.answers) - outage.answered_before
            await senders

    async def _until_running(self, texts: list[str]) -> None:
        """Return once the turn log shows every one of ``texts`` running (a bounded poll)."""
        for _ in range(600):
            if await asyncio.to_thread(self.plan.running, texts):
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"the held messages {texts} never started")

    async def _answered(self, count: int, within: float | None) -> None:
        """Return once ``count`` messages are answered, all are settled, or ``within`` s passed."""

        def reached() -> bool:
            settled = len(self.results.answers) + len(self.results.unanswered)
            return len(self.results.answers) >= count or settled >= self.total

        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(within), self.count_changed:
                await self.count_changed.wait_for(reached)
