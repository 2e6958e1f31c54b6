"""Store calls failing at random under many sessions and commands: nothing is lost.

While the store fails about one call in three — whichever call, wherever
the runtime makes it; refused before it changed anything, or run and then
failed as if its answer was lost on the way back (:data:`FAILING`) — 30
sessions each send 15 messages and commands drawn at random: plain text,
agent work that holds its turn, ``/queue``, ``/stop``, ``/steer``, ``/now``,
``/new``, ``/unqueue``, ``/busy`` with every policy, ``/model``. Once the
store answers again and the gateway is idle:

* every message the gateway took (its dispatch returned) ended in exactly
  one outcome, and no message ended twice;
* every message answered had its answer delivered, once: no answer was
  committed for a turn gone stale meanwhile and then held back;
* no outcome is left open, and no session's stored queue holds a message:
  nothing waits for a restart to run;
* every lease was given back: with a lease TTL of an hour, a lease left
  behind in the store would hold its session's next turn for good;
* no session ever ran two turns at once, and no turn saw another's context;
* the outage was logged as warnings: nothing in it is an error.

It runs under each busy policy and overflow, with coalescing, and with an
agent that takes steered text (:data:`SETUPS`). The seeds fix what is sent,
not how it interleaves: every run is a new interleaving, and the claims hold
for all of them.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import random
from typing import Any

import pytest

from chatlane.errors import ChatlaneError
from chatlane.runtime.busy import Overflow
from chatlane.runtime.outcomes import Outcome
from chatlane.runtime.settings import LeaseSettings
from chatlane.testing import GatewayHarness
from chatlane.types import OutboundKind
from tests.runtime.agents import EchoAgent, Recorder, SteeringAgent
from tests.runtime.refusing import LosingAnswers, Refusing

SESSIONS = 30
MESSAGES = 15
REFUSED = 0.3
"""The share of store calls refused while the outage lasts."""

SENT = (
    "hi",
    "sleep 0.01",
    "sleep 0.03",
    "/queue q",
    "/stop",
    "/new",
    "yes",
    "/new confirm",
    "/status",
    "/unqueue #1",
    "/unqueue #3",
    "/steer s",
    "/now n",
    "/model m",
    *(f"/busy {policy}" for policy in ("queue", "collect", "steer", "reject", "redirect")),
)
TAKEN_AS_MESSAGES = ("/queue", "/steer", "/now")
"""Commands whose text the gateway takes as a message."""


class Outage:
    """While :attr:`on`, refuses each store call with probability ``p`` (see :class:`Refusing`)."""

    def __init__(self, rng: random.Random, p: float) -> None:
        self.rng, self.p = rng, p
        self.on = False

    def __call__(self, name: str) -> bool:
        return self.on and self.rng.random() < self.p


async def chat(
    h: GatewayHarness, chat_id: str, rng: random.Random, taken: list[tuple[str, str]]
) -> None:
    """Send ``MESSAGES`` drawn from ``SENT``; note each one the gateway took."""
    for _ in range(MESSAGES):
        text = rng.choice(SENT)
        try:
            result = await h.send(text, chat_id=chat_id)
        except ChatlaneError:
            continue  # not taken: its dispatch said so
        if text == "yes":  # a confirmation or a message, by what came before: not judged
            continue
        if not text.startswith("/") or text.split()[0] in TAKEN_AS_MESSAGES:
            taken.append((result.message_id, text))
        for _ in range(rng.randrange(4)):
            await asyncio.sleep(0)  # let other chats' sends and turns interleave


SETUPS: dict[str, dict[str, Any]] = {
    "queue": {},
    "collect, steered": {"busy": "collect", "steering": True},
    "steer, steered": {"busy": "steer", "steering": True},
    "rollback": {"busy": "rollback"},
    "redirect, steered": {"busy": "redirect", "steering": True},
    "reject": {"busy": "reject"},
    "a short queue, the oldest dropped": {"queue_cap": 2, "overflow": Overflow.DROP_OLDEST},
    "a short queue, summarized": {"queue_cap": 2, "overflow": Overflow.SUMMARIZE},
    "coalescing": {"coalesce": {"test": 0.01}},
}
"""The gateway's busy policy and settings, and whether its agent takes steered text."""


FAILING = {"refused": Refusing, "answer lost": LosingAnswers}
"""How a failing call fails: before it changed anything, or after (see :mod:`.refusing`)."""


@pytest.mark.parametrize("failing", list(FAILING))
@pytest.mark.parametrize(
    ("seed", "setup"),
    [*((seed, "queue") for seed in range(4)), *((4, setup) for setup in list(SETUPS)[1:])],
)
async def test_nothing_is_lost_while_the_store_fails_calls_at_random(
    seed: int, setup: str, failing: str, caplog: pytest.LogCaptureFixture
) -> None:
    settings: dict[str, Any] = dict(SETUPS[setup])
    steering = settings.pop("steering", False)
    rng = random.Random(seed)
    outage, recorder = Outage(rng, REFUSED), Recorder()
    store = FAILING[failing](outage)
    lasting = LeaseSettings(ttl=3600)  # a lease left behind would hold its session for good
    agent = SteeringAgent(recorder, looks=3) if steering else EchoAgent(recorder)
    async with GatewayHarness(agent, store=store, leases=lasting, **settings) as h:
        taken: list[tuple[str, str]] = []
        outage.on = True
        await asyncio.gather(*(chat(h, f"c{n}", rng, taken) for n in range(SESSIONS)))
        outage.on = False
        await h.settle(timeout=30)  # a bound no loaded machine reaches
        engine = h.gateway.engine
        ended = collections.Counter(outcome.message_id for outcome in h.outcomes)
        assert sum(store.refused.values()) > 50  # the outage touched every part of the run
        assert [m for m, count in ended.items() if count > 1] == []
        assert [(m, text) for m, text in taken if m not in ended] == []
        assert engine.outcomes.open_ids() == []
        delivered = collections.Counter(
            (message_id, o.text)
            for o in h.outbox
            if o.kind is OutboundKind.REPLY
            for message_id in o.in_reply_to
        )
        answered = [o for o in h.outcomes if o.outcome is Outcome.ANSWERED]
        assert [o.message_id for o in answered if delivered[o.message_id, o.text] != 1] == []
        assert await store.active_sessions() == 0  # every lease was given back
        for n in range(SESSIONS):
            assert await store.pending(h.session_key(chat_id=f"c{n}")) == []
        assert max(recorder.max_active.values()) == 1
        assert recorder.cross_talk == []
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == []  # an outage is logged as warnings, never as an error with a traceback
