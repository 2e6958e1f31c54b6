"""Chaos: four gateway processes, ``kill -9`` and restarts, a flaky platform that goes down.

10,000 messages over 200 sessions go to random processes; every few rounds a
random process is killed and a new one started, or stopped (``SIGSTOP``) for
longer than its leases and claims and then let run on; the platform stand-in
fails 10% of sends (half of those after the chat saw the message) and is down
for a while. A message written to a process that died before accepting it is
sent again to another, as a platform re-delivers an update nobody confirmed.

At the end every message must be answered in the store and delivered to its
chat by one delivery, of whose copies at most one is unlabelled: every repeat
is labelled. A first send whose process was stopped mid-send can reach the chat
after its labelled re-send; those are counted, not failed. The figures are
printed: sent / accepted / answered / delivered / lost / duplicated (labelled)
/ duplicated unlabelled / first sends after their re-send.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import random
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from chatlane.stores import open_store
from tests.delivery.platform_server import PlatformServer, Received
from tests.delivery.test_processes import Gateways, store_url
from tests.multiprocess.cluster import Worker

pytestmark = pytest.mark.slow

__all__ = ["store_url"]  # the fixture: SQLite, then Redis

PROCESSES = 4
SESSIONS = 200
ROUNDS = 50
"""One message per session per round: 10,000 messages."""
AHEAD = 4
"""Rounds a session's messages may run ahead of its turns (well inside the queue cap)."""
KILL_EVERY = 6
FREEZE_EVERY = 5
FREEZE_SECONDS = 3.0
"""A frozen process (``SIGSTOP``) outlives its leases and delivery claims (1 s and 2 s)
before it runs on, as a process starved of CPU does."""
DOWN_ROUNDS = range(20, 26)
"""Rounds during which the platform is down."""


class Chaos:
    """Feeds messages to random live processes, kills and restarts them, and keeps count."""

    def __init__(self, gateways: Gateways, seed: int = 3) -> None:
        self.gateways = gateways
        self.random = random.Random(seed)
        self.live: dict[str, Worker] = {}
        self.sent_to: dict[str, str] = {}
        """Message id → the process it was last written to."""
        self.texts: dict[str, tuple[str, str]] = {}
        self.generation = 0
        self.kills = 0
        self.resent = 0
        self.frozen = 0

    def start(self) -> None:
        self.generation += 1
        name = f"p{self.generation}"
        self.live[name] = self.gateways.start(name)

    def send(self, message_id: str, chat: str, text: str) -> None:
        self.texts[message_id] = (chat, text)
        name = self.random.choice(sorted(self.live))
        self.sent_to[message_id] = name
        self.live[name].send(chat, text, message_id)

    def kill_one(self) -> None:
        name = self.random.choice(sorted(self.live))
        self.gateways.kill(self.live.pop(name))
        self.kills += 1
        self.start()
        self.resend_unaccepted(name)

    def freeze_one(self) -> None:
        """Stop a live process for :data:`FREEZE_SECONDS`, then let it run on."""
        worker = self.live[self.random.choice(sorted(self.live))]
        worker.signal(signal.SIGSTOP)
        self.frozen += 1
        thaw = threading.Timer(FREEZE_SECONDS, _thaw, args=(worker,))
        thaw.daemon = True
        thaw.start()

    def resend_unaccepted(self, dead: str) -> None:
        """Send again what ``dead`` was given and never accepted (to a live process)."""
        accepted = self.accepted()
        for message_id, name in list(self.sent_to.items()):
            if name == dead and message_id not in accepted:
                self.resent += 1
                self.send(message_id, *self.texts[message_id])

    def accepted(self) -> set[str]:
        return self.gateways.logged_ids("accepted")

    def started(self) -> set[str]:
        return self.gateways.logged_ids("start")


def store_figures(url: str, message_ids: list[str]) -> tuple[int, int]:
    """How many of ``message_ids`` are answered, and how many deliveries are pending."""

    async def read() -> tuple[int, int]:
        store = await open_store(url)
        try:
            answered = sum([await store.is_answered(m) for m in message_ids])
            return answered, (await store.delivery_stats()).pending
        finally:
            await store.close()

    return asyncio.run(read())


@pytest.mark.timeout(300)  # 10,000 messages through four processes: 45 to 85 s on two cores
def test_chaos_loses_nothing_and_labels_every_repeat(
    store_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    started_at = time.monotonic()
    url = store_url
    with PlatformServer(transient=0.10) as platform:
        gateways = Gateways(
            url, tmp_path / "events.jsonl", platform_url=platform.url, changed=platform.changed
        )
        wait = gateways.wait
        chaos = Chaos(gateways)
        try:
            for _ in range(PROCESSES):
                chaos.start()
            sessions = [f"s{n}" for n in range(SESSIONS)]
            for round_ in range(ROUNDS):
                platform.down = round_ in DOWN_ROUNDS
                if round_ and round_ % KILL_EVERY == 0:
                    chaos.kill_one()
                elif round_ % FREEZE_EVERY == 2:
                    chaos.freeze_one()
                if round_ >= AHEAD:
                    behind = {f"{chat}-{round_ - AHEAD}" for chat in sessions}
                    ran: Callable[[], bool] = functools.partial(_all_started, chaos, behind)
                    wait(ran, f"round {round_ - AHEAD}", 300)
                for chat in sessions:
                    chaos.send(f"{chat}-{round_}", chat, f"m{round_}")
            platform.down = False
            every = list(chaos.texts)
            wait(lambda: set(every) <= chaos.accepted(), "every message accepted", 300)
            wait(lambda: _delivered(platform.received()) >= set(every), "every reply", 600)
            wait(lambda: store_figures(url, [])[1] == 0, "an empty ledger", 300)
            answered, pending = store_figures(url, every)
        finally:
            gateways.stop_all()
        received = platform.received()
    replies: dict[str, list[Received]] = {}
    for reply in received:
        for message_id in reply.ids:
            replies.setdefault(message_id, []).append(reply)
    figures = Figures.of(every, replies)
    with capsys.disabled():
        print(
            f"\nchaos ({url.split(':')[0]}): sent {len(every)}  "
            f"accepted {len(chaos.accepted())}  answered {answered}  {figures}  | "
            f"processes {PROCESSES}, sessions {SESSIONS}, kills {chaos.kills}, "
            f"freezes {chaos.frozen}, re-sent to another process {chaos.resent}, "
            f"{time.monotonic() - started_at:.0f} s"
        )
    assert (answered, pending) == (len(every), 0)
    assert (figures.lost, figures.unlabelled, figures.split) == (0, 0, 0), figures.examples


@dataclass
class Figures:
    """What the chat saw of each message's reply."""

    delivered: int
    lost: int
    labelled: int
    """Copies beyond one per message that carried the label."""
    unlabelled: int
    """Unlabelled copies beyond one per message: must be none."""
    late: int
    """Messages whose unlabelled first send arrived after a labelled re-send (its
    sender stopped mid-send for longer than its claim)."""
    split: int
    """Messages answered by more than one delivery: must be none."""
    examples: dict[str, list[Received]]

    @classmethod
    def of(cls, every: list[str], replies: dict[str, list[Received]]) -> Figures:
        copies = [replies.get(m, []) for m in every]
        plain = [sum(not r.labelled for r in c) for c in copies]
        wrong = {
            m: c
            for m, c in zip(every, copies, strict=True)
            if len({r.delivery_id for r in c}) > 1 or sum(not r.labelled for r in c) > 1
        }
        delivered, unlabelled = sum(bool(c) for c in copies), sum(max(p - 1, 0) for p in plain)
        return cls(
            delivered=delivered,
            lost=len(every) - delivered,
            labelled=sum(map(len, copies)) - delivered - unlabelled,
            unlabelled=unlabelled,
            late=sum(p == 1 and c[0].labelled for p, c in zip(plain, copies, strict=True)),
            split=sum(len({r.delivery_id for r in c}) > 1 for c in copies),
            examples=dict(list(wrong.items())[:5]),
        )

    def __str__(self) -> str:
        return (
            f"delivered {self.delivered}  lost {self.lost}  duplicated (labelled) "
            f"{self.labelled}  duplicated unlabelled {self.unlabelled}  "
            f"first send after its labelled re-send {self.late}"
        )


def _thaw(worker: Worker) -> None:
    with contextlib.suppress(ProcessLookupError):  # killed while frozen
        worker.signal(signal.SIGCONT)


def _all_started(chaos: Chaos, ids: set[str]) -> bool:
    return ids <= chaos.started()


def _delivered(received: list[Received]) -> set[str]:
    return {message_id for reply in received for message_id in reply.ids}
