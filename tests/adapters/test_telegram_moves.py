"""A Telegram group upgraded to a supergroup, end to end: python-telegram-bot polling the
local Bot API stand-in, a real hub with the demo agent (SQLite where a restart is tested)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from chatlane.adapters.telegram_moves import ChatMoves, Move, checked_move, moves_key
from chatlane.errors import InvalidChatMove
from chatlane.scheduling import Scheduler
from chatlane.stores.memory import MemoryStore
from chatlane.types import Outbound, OutboundKind, Target
from tests.adapters.botapi import BotApi
from tests.adapters.test_telegram import api, key_of, running, telegram_config
from tests.delivery.waits import delivered, eventually
from tests.keys import chat_key

__all__ = ["api"]  # the fixture, shared with the adapter's other tests

GROUP, SUPERGROUP = -4321, -1004321
ALICE, BOB = 42, 43


async def whoami(api: BotApi, chat: int, count: int, chat_type: str) -> str:
    """The session key ``whoami`` reports in ``chat``, the ``count``-th message sent there."""
    api.push_text(chat, ALICE, "whoami", chat_type=chat_type)
    return key_of((await api.wait_for_sent(chat, count))[-1].text)


async def test_a_send_to_an_upgraded_group_goes_straight_to_the_supergroup_once_known(
    api: BotApi, tmp_path: Path
) -> None:
    """No service message seen: the first refusal (``ChatMigrated``) teaches the move, and
    the group's later replies go to the supergroup without being refused first."""
    async with running(telegram_config(api, tmp_path)) as (hub, _):
        api.migrate(GROUP, SUPERGROUP)  # messages sent before the upgrade still come
        api.push_text(GROUP, ALICE, "first", chat_type="group")
        await api.wait_for_sent(SUPERGROUP)
        api.push_text(GROUP, BOB, "second", chat_type="group")
        replies = await api.wait_for_sent(SUPERGROUP, 2)
        await eventually(hub.gateway.delivery, lambda: delivered(hub, 2))
    assert [reply.text for reply in replies] == ["echo: first", "echo: second"]
    assert api.sent(GROUP) == []
    assert api.bounced(GROUP) == 1


async def test_an_upgraded_group_keeps_its_conversation_and_is_answered_in_the_supergroup(
    api: BotApi, tmp_path: Path
) -> None:
    async with running(telegram_config(api, tmp_path)) as (hub, _):
        before = await whoami(api, GROUP, 1, "group")
        api.upgrade(GROUP, SUPERGROUP, ALICE)
        after = await whoami(api, SUPERGROUP, 1, "supergroup")
        await eventually(hub.gateway.delivery, lambda: delivered(hub, 2))
    assert after == before
    assert api.bounced(GROUP) == 0  # the reply went straight to the supergroup


async def test_typing_follows_a_group_upgraded_while_its_turn_runs(
    api: BotApi, tmp_path: Path
) -> None:
    async with running(telegram_config(api, tmp_path)) as (_, adapter):
        assert adapter.typing is not None
        adapter.typing.every = 0.05  # shown again and again while the turn runs
        api.push_text(GROUP, ALICE, "sleep 30", chat_type="group")
        await api.wait_for(lambda: len(api.actions(GROUP)) >= 1)
        api.migrate(GROUP, SUPERGROUP)
        await api.wait_for(lambda: len(api.actions(SUPERGROUP)) >= 2)
    assert api.bounced(GROUP) == 1  # once refused, then shown straight in the supergroup


async def test_an_approval_granted_in_the_group_holds_in_the_supergroup(
    api: BotApi, tmp_path: Path
) -> None:
    async with running(telegram_config(api, tmp_path)):
        api.push_text(GROUP, ALICE, "approve make build", chat_type="group")
        [prompt] = await api.wait_for_sent(GROUP)
        assert prompt.text.startswith("Approval needed")
        api.push_text(GROUP, ALICE, "/approve session", chat_type="group")
        await api.wait_for_sent(GROUP, 3)
        api.upgrade(GROUP, SUPERGROUP, ALICE)
        api.push_text(SUPERGROUP, ALICE, "approve make build", chat_type="supergroup")
        [reply] = await api.wait_for_sent(SUPERGROUP)
    assert reply.text == "approved: make build"  # no second prompt


async def test_the_move_outlives_a_restart(api: BotApi, tmp_path: Path) -> None:
    config, store = telegram_config(api, tmp_path), f"sqlite:///{tmp_path / 'chatlane.db'}"
    async with running(config, store):
        before = await whoami(api, GROUP, 1, "group")
        api.upgrade(GROUP, SUPERGROUP, ALICE)
        await whoami(api, SUPERGROUP, 1, "supergroup")
    async with running(config, store) as (_, adapter):
        after = await whoami(api, SUPERGROUP, 2, "supergroup")
        key = chat_key(str(GROUP), "telegram")
        notice = Outbound(OutboundKind.NOTICE, key, Target("telegram", str(GROUP)), "still here")
        await adapter.deliver(notice)
        sent = await api.wait_for_sent(SUPERGROUP, 3)
    assert after == before
    assert sent[-1].text == "still here"
    assert api.bounced(GROUP) == 0


async def test_a_cron_job_made_in_the_group_belongs_to_the_supergroup_and_runs_there(
    api: BotApi, tmp_path: Path
) -> None:
    clock = Clock()
    async with running(telegram_config(api, tmp_path)) as (hub, _):
        scheduler = Scheduler(now=clock)
        hub.gateway.use_scheduler(scheduler)  # not started: this test runs its passes
        api.push_text(GROUP, ALICE, "/cron add every 1h ping", chat_type="group")
        [added] = await api.wait_for_sent(GROUP)
        assert added.text.startswith("Added job ")
        api.upgrade(GROUP, SUPERGROUP, ALICE)
        api.push_text(SUPERGROUP, ALICE, "/cron list", chat_type="supergroup")
        [listing] = await api.wait_for_sent(SUPERGROUP)
        clock.now += 3600
        await scheduler.run_once()
        await scheduler.wait_idle()
        sent = await api.wait_for_sent(SUPERGROUP, 2)
    assert "ping" in listing.text
    assert sent[-1].text == "echo: ping"
    assert api.bounced(GROUP) == 0


class Clock:
    """Epoch seconds that move only when the test moves them."""

    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


ODD_MOVES: list[tuple[int, str, dict[str, Any]]] = [
    (GROUP, "group", {"migrate_to_chat_id": GROUP}),  # to itself
    (GROUP, "group", {"migrate_to_chat_id": ALICE}),  # to a person
    (GROUP, "group", {"migrate_to_chat_id": "-100999"}),  # not a number
    (GROUP, "supergroup", {"migrate_to_chat_id": SUPERGROUP}),  # from a supergroup
    (SUPERGROUP, "group", {"migrate_from_chat_id": GROUP}),  # into a basic group
    (SUPERGROUP, "supergroup", {"migrate_from_chat_id": True}),  # not a chat id
]


@pytest.mark.parametrize(("chat", "chat_type", "fields"), ODD_MOVES)
async def test_an_odd_upgrade_message_is_logged_and_changes_nothing(
    api: BotApi,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    chat: int,
    chat_type: str,
    fields: dict[str, Any],
) -> None:
    async with running(telegram_config(api, tmp_path)):
        before = await whoami(api, SUPERGROUP, 1, "supergroup")
        with caplog.at_level(logging.WARNING, logger="chatlane.adapters.telegram"):
            api.push_message(chat, ALICE, fields, chat_type=chat_type)
            after = await whoami(api, SUPERGROUP, 2, "supergroup")
    assert after == before
    assert "ignored a group upgrade" in caplog.text
    assert "Traceback" not in caplog.text


async def test_a_chat_moves_once() -> None:
    moves = ChatMoves()
    await moves.load(MemoryStore(), "main")
    assert await moves.record(Move(GROUP, SUPERGROUP))
    assert await moves.record(Move(GROUP, SUPERGROUP))  # told twice: the same move
    assert not await moves.record(Move(GROUP, -1009999))  # a second move of the group
    assert not await moves.record(Move(SUPERGROUP, -1009999))  # a chain
    assert not await moves.record(Move(-5555, SUPERGROUP))  # two groups into one
    assert (moves.destination(str(GROUP)), moves.known_as(SUPERGROUP)) == (
        str(SUPERGROUP),
        str(GROUP),
    )
    assert (moves.destination("-5555"), moves.known_as(-1009999)) == ("-5555", "-1009999")


@pytest.mark.parametrize(
    ("group", "supergroup"), [(GROUP, GROUP), (GROUP, ALICE), ("-1", SUPERGROUP), (True, -1)]
)
def test_a_move_needs_two_distinct_group_ids(group: object, supergroup: object) -> None:
    with pytest.raises(InvalidChatMove, match="not two distinct groups"):
        checked_move(group, supergroup)


async def test_a_move_stored_in_an_odd_shape_is_skipped_at_load(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = MemoryStore()
    moves = ChatMoves()
    await moves.load(store, "main")
    await moves.record(Move(GROUP, SUPERGROUP))
    key = moves_key("main")
    await store.set_persistent(key, None, **{"moved:abc": -1, "moved:-5": "x", "other": 1})
    again = ChatMoves()
    with caplog.at_level(logging.WARNING, logger="chatlane.adapters.telegram"):
        await again.load(store, "main")
    assert again.known_as(SUPERGROUP) == str(GROUP)
    assert caplog.text.count("skipped a stored Telegram group upgrade") == 2
