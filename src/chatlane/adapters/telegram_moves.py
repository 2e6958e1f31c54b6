"""Telegram groups upgraded to supergroups: where each went, and the id chatlane knows it by.

An upgrade gives a group a new chat id, and Telegram refuses every send to
the old one (``ChatMigrated``). What stays true:

* An upgraded group keeps its conversation: chatlane goes on knowing the chat
  by the id it had first (:meth:`ChatMoves.known_as`), so a message from the
  supergroup belongs to the group's sessions — their history, settings,
  approvals and cron jobs — and the group's allowlist entry and per-chat
  settings still apply. Everything addressed to the group is sent to the
  supergroup (:meth:`ChatMoves.destination`), in the same topic.
* A move is learned from Telegram only: from an upgrade's service messages
  (:func:`move_of`: ``migrate_to_chat_id`` in the group, ``migrate_from_chat_id``
  in the supergroup) or from a send refused with ``ChatMigrated``
  (:meth:`ChatMoves.follow`). Nothing a user writes can make one.
* It is kept in the store, as the persistent field ``moved:<group id>`` of
  ``<namespace>:telegram:moves`` (a key no source can be given), so it outlives
  a restart and every process on the store knows it from its start.
* A chat moves once: a second move of a group, a move of a chat some group
  moved into (a chain) and a second group moving into the same chat are
  refused, as is an upgrade message whose ids are not a group's and the
  supergroup's it became (:class:`~chatlane.errors.InvalidChatMove`); each is
  logged as a warning, never raised to Telegram's update loop.
* A move learned while sending is followed at once and stored beside the send,
  never on its way: a slow store cannot make a delivered message look undelivered.
  A move that cannot be stored is still followed by this process.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TypeGuard

from telegram import Message

from chatlane.errors import ChatlaneError, InvalidChatMove
from chatlane.stores.fields import MOVED_PREFIX, moved_field
from chatlane.stores.protocols import SessionData
from chatlane.types import SessionKey

__all__ = ["ChatMoves", "Move", "checked_move", "move_of", "moves_key"]

log = logging.getLogger("chatlane.adapters.telegram")

_UPGRADED_FROM = {"migrate_to_chat_id": "group", "migrate_from_chat_id": "supergroup"}
"""The field of an upgrade's service message → the kind of chat it is sent in."""


@dataclass(frozen=True, slots=True)
class Move:
    """The group ``group`` became the supergroup ``supergroup`` (Telegram chat ids)."""

    group: int
    supergroup: int


def moves_key(namespace: str) -> SessionKey:
    """The store key whose fields hold the moves: no session is ever given it."""
    return SessionKey(f"{namespace}:telegram:moves")  # 3 segments: never a session's


def move_of(message: Message) -> Move | None:
    """The upgrade ``message`` tells of (a service message); None if it tells of none.

    :raises InvalidChatMove: it names ids that are not a group and the supergroup
        it became, or comes from a kind of chat that sends no such message.
    """
    for field, kind in _UPGRADED_FROM.items():
        other = getattr(message, field)
        if other is None:
            continue
        chat = message.chat
        if chat.type != kind:
            raise InvalidChatMove(f"{field} {other!r} came in a {chat.type}, not a {kind}")
        pair = (chat.id, other) if kind == "group" else (other, chat.id)
        return checked_move(*pair)
    return None


def checked_move(group: object, supergroup: object) -> Move:
    """The move of ``group`` to ``supergroup``, if both are distinct group ids.

    :raises InvalidChatMove: either is no group's id (Telegram's are negative
        numbers), or they are the same.
    """
    if _group_id(group) and _group_id(supergroup) and group != supergroup:
        return Move(group, supergroup)
    raise InvalidChatMove(f"from {group!r} to {supergroup!r}: not two distinct groups")


def _group_id(value: object) -> TypeGuard[int]:
    return type(value) is int and value < 0  # not a bool, not a person's id


class ChatMoves:
    """The moves this bot knows, both ways; stored once :meth:`load` named the store."""

    def __init__(self) -> None:
        self._to: dict[str, str] = {}
        """Group id → the supergroup it became."""
        self._from: dict[str, str] = {}
        """Supergroup id → the group it was."""
        self._store: SessionData | None = None
        self._key = moves_key("main")
        self._writes: set[asyncio.Task[None]] = set()

    async def load(self, store: SessionData, namespace: str) -> None:
        """Read the moves kept in ``store`` under ``namespace``; later ones are kept there.

        :raises StoreError: the store could not be read.
        """
        self._store, self._key = store, moves_key(namespace)
        for name, value in (await store.load_persistent(self._key)).items():
            if name.startswith(MOVED_PREFIX) and value is not None:
                self._load_one(name.removeprefix(MOVED_PREFIX), value)

    def _load_one(self, group: str, supergroup: object) -> None:
        try:
            self._remember(checked_move(int(group), supergroup))
        except (ValueError, InvalidChatMove) as error:
            log.warning("skipped a stored Telegram group upgrade (%s): %s", group, error)

    def destination(self, chat_id: str) -> str:
        """Where a send to ``chat_id`` goes: the supergroup it became, or itself."""
        return self._to.get(chat_id, chat_id)

    def known_as(self, chat_id: int) -> str:
        """The id chatlane knows the chat ``chat_id`` by: the group it was, or itself."""
        chat = str(chat_id)
        return self._from.get(chat, chat)

    async def record(self, move: Move) -> bool:
        """Remember ``move`` and store it; False (logged) if a chat would move twice.

        A store that fails is logged: the move is followed by this process all the same.
        """
        if not self._remember(move):
            return False
        await self._keep(move)
        return True

    def follow(self, chat_id: str, new_chat_id: object) -> None:
        """Remember that a send to ``chat_id`` was refused for ``new_chat_id``
        (``ChatMigrated``); it is stored in the background (:meth:`aclose` waits)."""
        try:
            move = checked_move(int(chat_id), new_chat_id)
        except (ValueError, InvalidChatMove) as error:
            log.warning("telegram: ignored a group upgrade: %s", error)
            return
        if self._remember(move):
            task = asyncio.create_task(self._keep(move), name="chatlane-telegram-move")
            self._writes.add(task)
            task.add_done_callback(self._writes.discard)

    async def aclose(self) -> None:
        """Wait for the moves still being stored."""
        while self._writes:
            await asyncio.wait(list(self._writes))

    def _remember(self, move: Move) -> bool:
        group, supergroup = str(move.group), str(move.supergroup)
        if self._to.get(group) == supergroup:
            return True
        if {group, supergroup} & (self._to.keys() | self._from.keys()):
            log.warning(
                "telegram: ignored a group upgrade from %s to %s: a chat moves once",
                group,
                supergroup,
            )
            return False
        self._to[group], self._from[supergroup] = supergroup, group
        log.info("telegram: group %s is now the supergroup %s", group, supergroup)
        return True

    async def _keep(self, move: Move) -> None:
        if self._store is None:
            return
        field = moved_field(str(move.group))
        try:
            await self._store.set_persistent(self._key, None, **{field: move.supergroup})
        except ChatlaneError as error:
            log.warning(
                "could not store that Telegram group %s is now %s (followed until a restart): %s",
                move.group,
                move.supergroup,
                error,
            )
