"""Every busy policy, with the second message sent to the process running the turn or to
another one, while the turn streams, waits on a tool or waits on an approval.

Each cell checks what the sender, the agent and the transcript see: one outcome per
message (in the process that accepted it), which process ran the second message as a
turn of its own (if any), and the user messages the transcript keeps.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from chatlane.runtime.outcomes import Outcome
from chatlane.runtime.turn import Turn
from chatlane.stores import Store
from tests.runtime.processes import two_processes

PHASES = ("streaming", "tool", "approval")
WHERE = ("here", "elsewhere")


class PhaseAgent:
    """``long`` reaches its phase (``in_phase`` is set), waits there until released or told
    to stop, then replies with what was steered into it; anything else is answered at once."""

    accepts_steering = True

    def __init__(self, phase: str) -> None:
        self.phase = phase
        self.in_phase = asyncio.Event()
        self.release = asyncio.Event()
        self.ran: list[str] = []

    def __call__(self, turn: Turn) -> AsyncIterator[str] | asyncio.Future[str]:
        self.ran.append(turn.text)
        if turn.text == "long" and self.phase == "streaming":
            return self._stream(turn)
        return asyncio.ensure_future(self._answer(turn))

    async def _stream(self, turn: Turn) -> AsyncIterator[str]:
        yield "part one"
        await self._wait(turn)
        if not turn.interrupted.is_set():
            yield " part two"
        for steered in turn.take_steers():
            yield f" + {steered}"

    async def _answer(self, turn: Turn) -> str:
        if turn.text == "long":
            if self.phase == "approval":
                self.in_phase.set()
                await turn.request_approval("rm -rf /tmp/scratch", "cleaning up")
            else:
                await self._wait(turn)
        return " + ".join([turn.text, *turn.take_steers()])

    async def _wait(self, turn: Turn) -> None:
        self.in_phase.set()
        released = asyncio.ensure_future(self.release.wait())
        stopped = asyncio.ensure_future(turn.interrupted.wait())
        await asyncio.wait([released, stopped], return_when=asyncio.FIRST_COMPLETED)
        released.cancel()
        stopped.cancel()


@dataclass(frozen=True)
class Expected:
    first: Outcome
    second: Outcome
    runs_second: dict[str, str | None]
    """Where → which process ran the second message as a turn of its own (None: none did)."""
    kept: tuple[str, ...]
    """The user messages the transcript keeps."""


EXPECTED = {
    "queue": Expected(
        Outcome.ANSWERED,
        Outcome.ANSWERED,
        {"here": "runner", "elsewhere": "other"},
        ("long", "next"),
    ),
    "collect": Expected(
        Outcome.ANSWERED,
        Outcome.ANSWERED,
        {"here": "runner", "elsewhere": "runner"},  # drawn in, then its own turn there
        ("long", "next"),
    ),
    "steer": Expected(
        Outcome.ANSWERED,
        Outcome.ANSWERED,
        {"here": None, "elsewhere": None},  # steered into the running turn
        ("long", "next"),
    ),
    "rollback": Expected(
        Outcome.INTERRUPTED,
        Outcome.ANSWERED,
        {"here": "runner", "elsewhere": "other"},
        ("next",),
    ),
    "redirect": Expected(
        Outcome.ANSWERED,
        Outcome.ANSWERED,
        {"here": "runner", "elsewhere": "other"},
        ("long", "next"),
    ),
    "reject": Expected(
        Outcome.ANSWERED,
        Outcome.REFUSED,
        {"here": None, "elsewhere": None},
        ("long",),
    ),
}

STOPS_THE_TURN = {"rollback", "redirect"}
"""Policies under which the running turn's approval is denied at once (no answer needed)."""


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("policy", sorted(EXPECTED))
async def test_every_policy_where_and_phase(
    two_stores: tuple[Store, Store], policy: str, where: str, phase: str
) -> None:
    here = two_stores[0]
    runner_agent, other_agent = PhaseAgent(phase), PhaseAgent(phase)
    async with two_processes(two_stores, (runner_agent, other_agent), policy) as (runner, other):
        first = await runner.send("long", chat_id="c")
        await runner_agent.in_phase.wait()
        sender = runner if where == "here" else other
        second = await sender.send("next", chat_id="c")
        if where == "elsewhere":
            await other.replies(chat_id="c", count=1)  # its ack or notice: the store has it
            await runner.gateway.engine.upkeep.check_fences()
        runner_agent.release.set()
        if phase == "approval" and policy not in STOPS_THE_TURN:
            await runner.send("/approve", chat_id="c")
        await runner.settle()
        await other.settle()
        await other.gateway.engine.upkeep.settle_watched()
        transcript = await here.transcript(first.session_key)
        queued = await here.pending(first.session_key)

    expected = EXPECTED[policy]
    ends = {o.message_id: o.outcome for o in (*runner.outcomes, *other.outcomes)}
    assert len(runner.outcomes) + len(other.outcomes) == len(ends)  # one outcome each
    assert ends[first.message_id] is expected.first
    assert ends[second.message_id] is expected.second
    ran = {"runner": runner_agent.ran.count("next"), "other": other_agent.ran.count("next")}
    runs_second = expected.runs_second[where]
    assert ran == {name: int(name == runs_second) for name in ran}
    assert "long" not in other_agent.ran
    assert tuple(e.content for e in transcript if e.role == "user") == expected.kept
    assert queued == []
