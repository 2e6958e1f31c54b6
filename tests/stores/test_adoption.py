"""Adopting session by session (memory and Redis): one session's failure is its own.

A store that adopts each session's records with calls of their own
(:mod:`chatlane.stores.adoption`) returns what the other sessions' calls
adopted when one fails, and reads back, at its next adoption, what a call
whose answer was lost made this process's.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from chatlane.errors import StoreError
from chatlane.stores import MemoryStore, PendingRecord
from tests.keys import chat_key
from tests.runtime.refusing import FailingAdoption

DEAD = "a process that died"
ME = "me"


async def left_by_the_dead(store: MemoryStore, chats: Sequence[str]) -> None:
    for chat in chats:
        await store.enqueue(chat_key(chat), f"m-{chat}", DEAD, b"")


def adopted_ids(records: Sequence[PendingRecord]) -> list[str]:
    return sorted(record.message_id for record in records)


@pytest.mark.parametrize("applies", [False, True], ids=["refused", "answer lost"])
async def test_one_sessions_failure_does_not_take_the_others_adoptions_with_it(
    applies: bool,
) -> None:
    store = FailingAdoption(chat_key("b"), applies=applies)
    await left_by_the_dead(store, ["a", "b", "c"])
    first = await store.adopt_orphans(ME, 10)
    assert adopted_ids(first) == ["m-a", "m-c"]
    assert {record.owner for record in first} == {ME}
    second = await store.adopt_orphans(ME, 10)  # refused: adopted now; lost: read back
    assert adopted_ids(second) == ["m-b"]
    assert [(r.owner, r.message_id) for r in second] == [(ME, "m-b")]
    assert await store.adopt_orphans(ME, 10) == []  # each record was handed out once


async def test_an_adoption_whose_only_call_failed_raises() -> None:
    store = FailingAdoption(chat_key("a"), applies=False)
    await left_by_the_dead(store, ["a"])
    with pytest.raises(StoreError, match="adoption failed"):
        await store.adopt_orphans(ME, 10)
    assert adopted_ids(await store.adopt_orphans(ME, 10)) == ["m-a"]


async def test_a_lost_adoption_that_cannot_be_read_back_yet_is_read_back_later() -> None:
    store = FailingAdoption(chat_key("a"), applies=True)
    await left_by_the_dead(store, ["a"])
    with pytest.raises(StoreError):
        await store.adopt_orphans(ME, 10)
    store.reads_refused = 1  # the read back fails; the scan after it reads
    assert await store.adopt_orphans(ME, 10) == []
    assert adopted_ids(await store.adopt_orphans(ME, 10)) == ["m-a"]
    assert await store.adopt_orphans(ME, 10) == []


async def test_what_is_read_back_is_returned_though_the_scan_after_it_fails() -> None:
    store = FailingAdoption(chat_key("a"), applies=True)
    await left_by_the_dead(store, ["a", "b"])
    assert adopted_ids(await store.adopt_orphans(ME, 10)) == ["m-b"]
    store.scans_refused = 1
    assert adopted_ids(await store.adopt_orphans(ME, 10)) == ["m-a"]  # never dropped
    assert await store.adopt_orphans(ME, 10) == []
