"""The PostgreSQL store's session data: fenced commits, persistent fields, transcripts, marks.

The fenced commit is one statement, in its own transaction: a call of the
schema's ``chatlane_commit`` (:mod:`~chatlane.stores.postgres.routines`), which
takes the session's lock and reads the server's clock itself. Every other
function that writes runs inside one of the store's transactions (``moment`` is
the server's clock read in it, after the session's lock). What stays true:

* The fenced commit checks the generation before it writes; then one
  statement makes every write, setting only answered marks past their
  retention; if any mark was kept, the whole commit rolls back, so a refused
  commit writes nothing.
* Two commits answering one message, from any processes and sessions, are
  ordered by the mark's row lock: the second finds the first's mark.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from asyncpg import PostgresError

from chatlane.errors import AlreadyAnswered, StaleGeneration
from chatlane.stores.base import AnsweredMark, Conversation, TranscriptEntry, WriteBatch
from chatlane.stores.codec import decode_attachments, decode_value, encode_attachments
from chatlane.stores.ids import new_conversation_id
from chatlane.stores.postgres import ledger
from chatlane.stores.postgres.db import Db, Row
from chatlane.stores.postgres.routines import ALREADY_ANSWERED
from chatlane.stores.postgres.text import unescape
from chatlane.types import SessionKey

__all__ = [
    "commit",
    "conversations",
    "current",
    "load_fields",
    "load_persistent",
    "mark",
    "new_conversation",
    "resume",
    "transcript",
]

_COMMIT = (
    "SELECT * FROM chatlane_commit($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, "
    "$14, $15, $16, $17, $18, $19, $20, $21, $22, $23, $24, $25, $26, $27, $28)"
)
"""One statement, one round trip: the session's lock and clock, the fence, and every write
of the commit (:mod:`~chatlane.stores.postgres.routines`)."""


async def commit(
    db: Db,
    key: SessionKey,
    generation: int | None,
    batch: WriteBatch,
    fields: list[tuple[str, str]],
    retention: float,
    notice: tuple[str, str],
    lock: str,
    token: str = "",
) -> bool:
    """Fenced: the generation is checked before the writes, in the statement that writes;
    the batch's deliveries are recorded with them.

    :param notice: the store's channel and the session's token on it: the waiters to wake.
    :param lock: the store's delivery target lock prefix (:func:`~.ledger.target_lock`).
    :param token: a lease's token: free that lease with the writes.
    :returns: whether a lease was freed.
    :raises StaleGeneration: the generation moved on (nothing was written).
    :raises AlreadyAnswered: a message of ``batch.answered`` was answered within
        ``retention`` (nothing was written).
    """
    wanted = list(dict.fromkeys(batch.answered))  # one row per message: a statement sets it once
    entries = batch.transcript
    try:
        row = await db.fetchrow(
            _COMMIT,
            key,
            generation,
            new_conversation_id(),  # the session's first conversation, if it has none
            batch.answer,
            wanted,
            retention,
            *_entry_columns(entries),
            [encode_attachments(e.attachments) for e in entries],
            [name for name, _ in fields],
            [value for _, value in fields],
            batch.done,
            token,
            *notice,
            batch.title,
            batch.rename,
            *ledger.columns(batch.deliveries, lock),
            batch.failure,
        )
    except PostgresError as error:
        if error.sqlstate != ALREADY_ANSWERED:
            raise
        repeated = {unescape(m) for m in json.loads(error.detail)}  # as the server keeps them
        named = [m for m in batch.answered if m in repeated]  # as the batch names them
        raise AlreadyAnswered(named, key=key) from None
    assert row is not None
    current, freed = int(row[0]), bool(row[1])
    if generation is not None and generation != current:
        raise StaleGeneration(key, generation, current, "commit")
    return freed


def _entry_columns(entries: Sequence[TranscriptEntry]) -> tuple[list[Any], ...]:
    """The entries' columns as ``chatlane_commit`` takes them, one array each: the
    conversation each names ("" for the one it is appended to), role, content, generation,
    message id and time (0: the commit's)."""
    return (
        [e.conversation_id for e in entries],
        [e.role for e in entries],
        [e.content for e in entries],
        [e.generation for e in entries],
        [e.message_id for e in entries],
        [e.created_at for e in entries],
    )


async def load_persistent(db: Db, key: SessionKey) -> dict[str, Any]:
    rows = await db.fetch(
        "SELECT field, value FROM persistent WHERE key = $1 ORDER BY position", key
    )
    return {name: decode_value(key, name, value) for name, value in rows}


async def load_fields(db: Db, key: SessionKey, names: list[str]) -> dict[str, Any]:
    rows = await db.fetch(
        "SELECT field, value FROM persistent WHERE key = $1 AND field = ANY($2::text[]) "
        "ORDER BY position",
        key,
        names,
    )
    return {name: decode_value(key, name, value) for name, value in rows}


async def transcript(db: Db, conversation: str, limit: int) -> list[TranscriptEntry]:
    if limit <= 0:
        return []
    rows = await db.fetch(
        "SELECT role, content, generation, coalesce(entry_conversation, conversation_id), "
        "message_id, created_at, attachments FROM (SELECT * FROM transcript "
        "WHERE conversation_id = $1 ORDER BY id DESC LIMIT $2) t ORDER BY id",
        conversation,
        limit,
    )
    return [
        TranscriptEntry(r[0], r[1], int(r[2]), r[3], r[4], r[5], decode_attachments(r[6]))
        for r in rows
    ]


async def mark(db: Db, message_id: str, retention: float) -> AnsweredMark | None:
    """``message_id``'s mark, if it is within ``retention`` (server time)."""
    row = await db.fetchrow(
        "SELECT answer, key, failure FROM answered "
        "WHERE message_id = $1 AND at > extract(epoch FROM now()) - $2",
        message_id,
        retention,
    )
    return None if row is None else AnsweredMark(row[0], SessionKey(row[1]), row[2])


# -- conversations -------------------------------------------------------------------

_CONVERSATION = "SELECT c.id, c.key, c.started_at, c.ended_at, c.title FROM conversations c"


def _conversation(row: Row) -> Conversation:
    """A row of :data:`_CONVERSATION` as a conversation (the key was stored from one)."""
    id_, key, started_at, ended_at, title = row
    return Conversation(id_, SessionKey(key), started_at, ended_at, title)


async def current(db: Db, moment: float, key: SessionKey) -> Conversation:
    """``key``'s current conversation, started (and made current) if it has none."""
    row = await db.fetchrow(
        f"{_CONVERSATION} JOIN sessions s ON c.id = s.current_conversation WHERE s.key = $1", key
    )
    return await _start(db, moment, key, "") if row is None else _conversation(row)


async def _start(db: Db, moment: float, key: SessionKey, title: str) -> Conversation:
    conversation = Conversation(new_conversation_id(), key, moment, title=title)
    await db.execute(
        "INSERT INTO conversations (id, key, started_at, title) VALUES ($1, $2, $3, $4)",
        conversation.id,
        key,
        moment,
        title,
    )
    await db.execute(
        "INSERT INTO sessions (key, current_conversation) VALUES ($1, $2) ON CONFLICT (key) "
        "DO UPDATE SET current_conversation = excluded.current_conversation",
        key,
        conversation.id,
    )
    return conversation


async def _end_current(db: Db, moment: float, key: SessionKey) -> None:
    await db.execute(
        "UPDATE conversations SET ended_at = $1 "
        "WHERE id = (SELECT current_conversation FROM sessions WHERE key = $2)",
        moment,
        key,
    )


async def new_conversation(db: Db, moment: float, key: SessionKey, title: str) -> Conversation:
    await _end_current(db, moment, key)
    return await _start(db, moment, key, title)


async def resume(db: Db, moment: float, key: SessionKey, conversation_id: str) -> Conversation:
    """Make ``conversation_id`` current again.

    :raises KeyError: ``key`` has no such conversation.
    """
    ours = "SELECT 1 FROM conversations WHERE id = $1 AND key = $2"
    if not await db.fetchval(ours, conversation_id, key):
        raise KeyError(conversation_id)
    await _end_current(db, moment, key)
    await db.execute("UPDATE conversations SET ended_at = 0 WHERE id = $1", conversation_id)
    await db.execute(
        "UPDATE sessions SET current_conversation = $1 WHERE key = $2", conversation_id, key
    )
    row = await db.fetchrow(f"{_CONVERSATION} WHERE c.id = $1", conversation_id)
    assert row is not None
    return _conversation(row)


async def conversations(db: Db, moment: float, key: SessionKey, limit: int) -> list[Conversation]:
    """Newest first; equal start times keep the order they were started in (their ids')."""
    await current(db, moment, key)
    rows = await db.fetch(
        f"{_CONVERSATION} WHERE c.key = $1 ORDER BY c.started_at DESC, c.id LIMIT $2",
        key,
        None if limit < 0 else limit,  # LIMIT NULL: all of them
    )
    return [_conversation(row) for row in rows][:limit]
