"""Randomized stress: 1,000 sessions x 20 messages under every busy policy.

Checked for every session: its messages are seen in the order they were sent;
never two of its turns run at once (the agent itself counts); every message is
run, merged, steered or answered with a notice — exactly once, and ends in
exactly one emitted outcome; and no agent ever sees another session's context,
in its task or in a worker thread.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter, defaultdict
from typing import Any

import pytest

from chatlane.context import get_session_env, run_in_thread
from chatlane.runtime.busy import BusyPolicy
from chatlane.runtime.outcomes import Outcome
from chatlane.runtime.turn import Turn
from chatlane.testing import GatewayHarness
from chatlane.types import OutboundKind

SESSIONS = 1_000
MESSAGES = 20


class StressAgent:
    """Sleeps a random few milliseconds, steering and checking its context as it goes."""

    accepts_steering = True

    def __init__(self, seed: int, takes_steers: bool = True) -> None:
        self.random = random.Random(seed)
        self.takes_steers = takes_steers
        self.active: defaultdict[str, int] = defaultdict(int)
        self.overlaps: list[str] = []
        self.cross_talk: list[str] = []
        self.seen: defaultdict[str, list[str]] = defaultdict(list)

    async def __call__(self, turn: Turn) -> str:
        key = turn.session_key
        self.active[key] += 1
        if self.active[key] > 1:
            self.overlaps.append(key)
        try:
            self.seen[key].extend(turn.message_ids)
            await self._work(turn)
            return f"done {turn.generation}"
        finally:  # steered text it took counts as seen, even if the turn was cancelled
            self.seen[key].extend(m.id for m in turn.steered if m.id not in self.seen[key])
            self.active[key] -= 1

    async def _work(self, turn: Turn) -> None:
        for _ in range(self.random.randint(1, 3)):
            try:
                await asyncio.wait_for(turn.interrupted.wait(), self.random.random() * 0.004)
                return
            except TimeoutError:
                pass
            if self.takes_steers:
                turn.take_steers()
            seen_in_thread = await run_in_thread(get_session_env, "CHATLANE_SESSION_KEY")
            if seen_in_thread != turn.session_key or get_session_env(
                "CHATLANE_SESSION_CHAT_ID"
            ) != (turn.source.chat_id or ""):
                self.cross_talk.append(turn.session_key)


async def _chat(
    h: GatewayHarness,
    chat: str,
    rng: random.Random,
    queue_some: bool,
    commands: tuple[str, ...] = (),
) -> list[str]:
    """Send ``MESSAGES`` messages; with ``queue_some``, about one in five as ``/queue``.

    ``commands`` (such as ``/steer``, ``/now``): about one message in four is
    sent as one of them, picked at random.
    """
    sent = []
    for i in range(MESSAGES):
        text = f"{chat}/{i}"
        if queue_some and rng.random() < 0.2:
            text = f"/queue {text}"  # queued whatever the policy: behind any steered message
        elif commands and rng.random() < 0.25:
            text = f"{rng.choice(commands)} {text}"
        result = await h.send(text, chat_id=chat, user_id=f"u-{chat}")
        sent.append(result.message_id)
        if rng.random() < 0.7:
            await asyncio.sleep(rng.random() * 0.003)
    return sent


@pytest.mark.slow
@pytest.mark.parametrize(
    ("policy", "takes_steers"),
    [(policy, True) for policy in BusyPolicy] + [(BusyPolicy.STEER, False)],
)
async def test_thousand_sessions_under_every_policy(policy: BusyPolicy, takes_steers: bool) -> None:
    """``takes_steers=False``: an agent that accepts steering but never takes any."""
    agent = StressAgent(seed=hash(policy.value) & 0xFFFF, takes_steers=takes_steers)
    await _stress(agent, {"busy": policy}, queue_some=not takes_steers)


@pytest.mark.slow
@pytest.mark.parametrize(
    "variant",
    ["drop-oldest", "summarize", "coalesce", "steer-and-now", "redirect-steer-and-now"],
)
async def test_thousand_sessions_under_overflow_coalescing_and_per_message_policies(
    variant: str,
) -> None:
    """A full queue dropping its oldest or collapsing into one turn; coalescing idle
    sessions; `/steer` and `/now` mixed in, under ``queue`` and under ``redirect``."""
    agent = StressAgent(seed=len(variant))
    settings: dict[str, Any] = {"busy": BusyPolicy.QUEUE}
    commands: tuple[str, ...] = ()
    if variant in ("drop-oldest", "summarize"):
        settings["overflow"] = variant
    elif variant == "coalesce":
        settings["coalesce"] = {"test": 0.002}
    else:
        commands = ("/steer", "/now")
        if variant.startswith("redirect"):
            settings["busy"] = BusyPolicy.REDIRECT
    await _stress(agent, settings, commands=commands)


async def _stress(
    agent: StressAgent,
    settings: dict[str, Any],
    *,
    queue_some: bool = False,
    commands: tuple[str, ...] = (),
) -> None:
    """Every session's messages, sent at once, checked as the module docstring says."""
    rng = random.Random(7)
    async with GatewayHarness(
        agent,
        queue_cap=8,
        collect_debounce=0.002,
        interrupt_grace=0.05,
        ack_debounce=0.0,
        **settings,
    ) as h:
        chats = [f"chat:{n}" for n in range(SESSIONS)]
        sent = await asyncio.gather(
            *(_chat(h, chat, random.Random(rng.random()), queue_some, commands) for chat in chats)
        )
        await h.settle(timeout=50)

    assert agent.overlaps == []
    assert agent.cross_talk == []
    noticed = _noticed(h)
    for chat, ids in zip(chats, sent, strict=True):
        key = h.session_key(chat_id=chat, user_id=f"u-{chat}")
        seen = agent.seen[key]
        assert len(seen) == len(set(seen)), f"{key} ran a message twice"
        order = {message_id: index for index, message_id in enumerate(ids)}
        assert [order[m] for m in seen] == sorted(order[m] for m in seen), f"{key} out of order"
        accounted = set(seen) | noticed.get(key, set())
        assert accounted == set(ids), f"{key} lost {set(ids) - accounted}"
        assert not set(seen) & noticed.get(key, set()), f"{key} both ran and refused a message"
    assert sum(len(ids) for ids in sent) == SESSIONS * MESSAGES
    outcomes = Counter(outcome.message_id for outcome in h.outcomes)
    every_id = [message_id for ids in sent for message_id in ids]
    assert {message_id: outcomes[message_id] for message_id in every_id} == dict.fromkeys(
        every_id, 1
    ), "a message ended with no outcome, or with more than one"
    assert set(outcomes) == set(every_id)
    for outcome in h.outcomes:
        if outcome.outcome is Outcome.ANSWERED:
            assert outcome.message_id in agent.seen[outcome.session_key]


def _noticed(h: GatewayHarness) -> dict[str, set[str]]:
    refused: defaultdict[str, set[str]] = defaultdict(set)
    for outbound in h.outbox:
        if outbound.kind is OutboundKind.NOTICE:
            refused[outbound.session_key].update(outbound.in_reply_to)
    return refused
