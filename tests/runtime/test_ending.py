"""The fate of an ended turn's messages: every row of the table."""

from __future__ import annotations

import pytest

from chatlane.runtime.ending import Fate, TurnEnd, fate

E = TurnEnd

TABLE = [
    # end,              answered, closing, fate
    (E.STOPPED, False, False, Fate.DROP),
    (E.INTERRUPTED, False, False, Fate.DROP),
    (E.EVICTED, False, False, Fate.DROP),
    (E.FAILED, False, False, Fate.DROP),
    (E.REJECTED, False, False, Fate.DROP),
    (E.STOPPED, False, True, Fate.DROP),  # told before the shutdown: still done
    (E.FAILED, False, True, Fate.DROP),
    (E.LEASE_LOST, False, False, Fate.RERUN),
    (E.LEASE_LOST, False, True, Fate.KEEP),  # the next process runs it
    (E.REORDERED, False, False, Fate.REQUEUE),
    (E.REORDERED, False, True, Fate.KEEP),
    (E.SHUTDOWN, False, False, Fate.KEEP),
    (E.SHUTDOWN, False, True, Fate.KEEP),
    (E.DROPPED, False, False, Fate.KEEP),  # what is still queued already waits again
    (None, False, False, Fate.KEEP),
    (None, False, True, Fate.KEEP),
]


@pytest.mark.parametrize(("end", "answered", "closing", "expected"), TABLE)
def test_fate(end: TurnEnd | None, answered: bool, closing: bool, expected: Fate) -> None:
    assert fate(end, answered=answered, closing=closing) is expected


@pytest.mark.parametrize("end", [*TurnEnd, None])
@pytest.mark.parametrize("closing", [False, True])
def test_an_answered_turns_messages_are_kept_whatever_else_happened(
    end: TurnEnd | None, closing: bool
) -> None:
    assert fate(end, answered=True, closing=closing) is Fate.KEEP


def test_every_end_has_a_row() -> None:
    assert {row[0] for row in TABLE} == {*TurnEnd, None}
