"""The wait budget of one message's sends (:mod:`chatlane.adapters.waits`)."""

from __future__ import annotations

import time

import pytest

from chatlane.adapters.waits import SEND_ROOM, WaitBudget


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(time, "monotonic", clock)
    return clock


def test_the_cap_counts_every_wait_of_the_message(clock: Clock) -> None:
    budget = WaitBudget(60)
    assert budget.allows(40)
    clock.now += 40  # part 2 waited 40 s
    assert budget.allows(20)
    assert not budget.allows(21)  # part 3 may not wait another minute


def test_a_wait_must_leave_room_for_the_send_before_the_deadline(clock: Clock) -> None:
    budget = WaitBudget(60, deadline=clock.now + 30)
    assert budget.allows(30 - SEND_ROOM)
    assert not budget.allows(30 - SEND_ROOM + 0.1)


def test_a_deadline_closer_than_the_room_allows_no_wait(clock: Clock) -> None:
    assert not WaitBudget(60, deadline=clock.now + SEND_ROOM / 2).allows(0)
