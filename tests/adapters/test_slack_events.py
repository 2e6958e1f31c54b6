"""The intake on its own: which copies of an event are handed on, and when a copy is answered."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from chatlane.adapters import slack_events
from chatlane.adapters.slack_events import Intake
from chatlane.adapters.slack_wire import Press
from tests.adapters.slackapi import WAIT, event_callback, message_event

ENVELOPE = event_callback(message_event("DALICE01", "UALICE01", "hi", "1.000001", "im", None), "E1")


async def no_press(press: Press) -> None:
    raise AssertionError("no press in these tests")


async def test_a_copy_of_an_event_handled_before_is_not_handed_on_again() -> None:
    handled: list[str] = []

    async def on_event(event: dict[str, Any]) -> None:
        handled.append(event["text"])

    intake = Intake(on_event, no_press)
    for _ in range(3):
        await intake.event(ENVELOPE)
    assert handled == ["hi"]


async def test_a_copy_of_an_event_whose_job_failed_is_handed_on_as_new(
    caplog: pytest.LogCaptureFixture,
) -> None:
    handled: list[str] = []

    async def on_event(event: dict[str, Any]) -> None:
        handled.append(event["text"])
        if len(handled) == 1:
            raise RuntimeError("the first copy's job failed")

    intake = Intake(on_event, no_press)
    with caplog.at_level(logging.ERROR, logger="chatlane.adapters"):
        await intake.event(ENVELOPE)
    assert "a Slack job could not be done" in caplog.text
    await intake.event(ENVELOPE)
    await intake.event(ENVELOPE)
    assert handled == ["hi", "hi"]


async def test_copies_arriving_while_the_first_runs_are_answered_after_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(slack_events, "ANSWER_WITHIN", 60.0)  # a loaded machine: no cut-off
    order: list[str] = []
    started, release = asyncio.Event(), asyncio.Event()

    async def on_event(event: dict[str, Any]) -> None:
        order.append("handed on")
        started.set()
        await release.wait()
        order.append("held")

    intake = Intake(on_event, no_press)

    async def answered(name: str) -> None:
        await intake.event(ENVELOPE)
        order.append(name)

    first = asyncio.create_task(answered("first answered"))
    async with asyncio.timeout(WAIT):
        await started.wait()
    copies = [asyncio.create_task(answered(f"copy {n} answered")) for n in (1, 2)]
    asyncio.get_running_loop().call_soon(release.set)  # after each copy's first step
    await asyncio.gather(first, *copies)
    assert order[:2] == ["handed on", "held"]
    assert sorted(order[2:]) == ["copy 1 answered", "copy 2 answered", "first answered"]
