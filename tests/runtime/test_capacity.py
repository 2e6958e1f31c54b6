"""Process-wide limits: the byte count never under-counts, and what it remembers stays bounded."""

from __future__ import annotations

from typing import cast

import pytest

from chatlane.errors import GatewayFull, MessageTooLarge
from chatlane.identity import SessionSource
from chatlane.runtime.capacity import RECOUNT_FLOOR, Capacity, CapacitySettings, message_bytes
from chatlane.runtime.slots import Slots
from chatlane.types import InboundMessage

SOURCE = SessionSource("test", chat_id="c", user_id="u")


class Held:
    """What the engine's slots tell a capacity: the messages held, and no live session."""

    def __init__(self, messages: list[InboundMessage]) -> None:
        self.messages = messages

    def held(self) -> list[InboundMessage]:
        return self.messages

    def live_count(self) -> int:
        return 0


def capacity_over(held: list[InboundMessage], settings: CapacitySettings | None = None) -> Capacity:
    return Capacity(settings or CapacitySettings(), cast(Slots, Held(held)))


def admit(capacity: Capacity, message: InboundMessage) -> None:
    capacity.reserve(message, new_session=False)
    capacity.settled(message, new_session=False)


def test_answered_messages_are_forgotten_however_many_came_and_went() -> None:
    held: list[InboundMessage] = []
    capacity = capacity_over(held)
    size = message_bytes(InboundMessage(SOURCE, "hello"))
    for _ in range(20 * RECOUNT_FLOOR):
        admit(capacity, InboundMessage(SOURCE, "hello"))  # answered at once: never held
    assert capacity.counted_bytes <= (RECOUNT_FLOOR + 1) * size


def test_held_messages_stay_counted_through_recounts() -> None:
    held = [InboundMessage(SOURCE, "waiting") for _ in range(3 * RECOUNT_FLOOR)]
    capacity = capacity_over(held)
    for message in held:
        admit(capacity, message)
    for _ in range(10 * RECOUNT_FLOOR):
        admit(capacity, InboundMessage(SOURCE, "passing"))
    assert capacity.counted_bytes >= sum(message_bytes(m) for m in held)


def test_a_message_larger_than_the_byte_limit_alone_is_told_so() -> None:
    """Not "N bytes wait; try again later": no wait makes room for it."""
    message = InboundMessage(SOURCE, "x" * 100)
    capacity = capacity_over([], CapacitySettings(queued_bytes=message_bytes(message) - 1))
    with pytest.raises(MessageTooLarge, match="the message is too large") as refused:
        capacity.reserve(message, new_session=True)
    assert "try again later" not in str(refused.value)
    assert isinstance(refused.value, GatewayFull)  # every adapter refuses it as before
    admit(capacity, InboundMessage(SOURCE, "x" * 50))  # nothing of it was counted


def test_the_byte_limit_still_refuses_what_would_pass_it() -> None:
    held: list[InboundMessage] = []
    message = InboundMessage(SOURCE, "x" * 100)
    capacity = capacity_over(held, CapacitySettings(queued_bytes=3 * message_bytes(message)))
    for _ in range(3):
        admitted = InboundMessage(SOURCE, "x" * 100)
        admit(capacity, admitted)
        held.append(admitted)
    with pytest.raises(GatewayFull):
        capacity.reserve(InboundMessage(SOURCE, "x" * 100), new_session=False)
