"""The PostgreSQL store's session data: fenced commits, persistent fields, transcripts, marks.

Each function runs inside one of the store's transactions (``moment`` is the
server's clock read in it, after the session's lock). What stays true:

* The fenced commit checks the generation before it writes; then one
  statement (:data:`_WRITE`) makes every write, setting only answered marks
  past their retention; if any mark was kept, the whole transaction rolls
  back, so a refused commit writes nothing.
* Two commits answering one message, from any processes and sessions, are
  ordered by the mark's row lock: the second finds the first's mark.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from chatlane.errors import AlreadyAnswered, StaleGeneration
from chatlane.stores.base import Conversation, TranscriptEntry, WriteBatch
from chatlane.stores.codec import decode_attachments, decode_value, encode_attachments
from chatlane.stores.ids import new_conversation_id
from chatlane.stores.postgres.db import Db, Row
from chatlane.stores.postgres.leases import WAKE
from chatlane.types import SessionKey

__all__ = [
    "answer",
    "commit",
    "conversations",
    "current",
    "load_persistent",
    "new_conversation",
    "resume",
    "transcript",
]

_WOKEN = WAKE.format(
    condition="AND (EXISTS (SELECT 1 FROM freed) OR EXISTS (SELECT 1 FROM dropped))",
    channel="$17",
    token="$18",
)

_WRITE = f"""WITH marked AS (
    INSERT INTO answered (message_id, at, answer) SELECT m, $2, $3 FROM unnest($4::text[]) m
    ON CONFLICT (message_id) DO UPDATE SET at = excluded.at, answer = excluded.answer
    WHERE answered.at <= $5
    RETURNING message_id
), appended AS (
    INSERT INTO transcript (conversation_id, entry_conversation, role, content, generation,
        message_id, created_at, attachments)
    SELECT $6, e, r, c, g, m, t, a
    FROM unnest($7::text[], $8::text[], $9::text[], $10::bigint[], $11::text[], $12::float8[],
        $21::bytea[]) WITH ORDINALITY AS x(e, r, c, g, m, t, a, n)
    ORDER BY n
), fields AS (
    INSERT INTO persistent (key, field, value)
    SELECT $1, f, v FROM unnest($13::text[], $14::text[]) WITH ORDINALITY AS x(f, v, n) ORDER BY n
    ON CONFLICT (key, field) DO UPDATE SET value = excluded.value
), dropped AS (
    DELETE FROM pending WHERE key = $1 AND seq = ANY($15::bigint[]) RETURNING 1
), freed AS (
    DELETE FROM leases WHERE key = $1 AND token = $16 RETURNING 1
), titled AS (
    UPDATE conversations SET title = $19::text
    WHERE $19::text <> '' AND id = $6 AND ($20::boolean OR title = '')
), woken AS ({_WOKEN})
SELECT array(SELECT message_id FROM marked), EXISTS (SELECT 1 FROM freed)"""
"""Every write of a commit in one statement: the answered marks (a mark within the retention
is kept, and its id not returned), the transcript entries in order, the persistent fields,
the done records, the lease carrying the token (if any) freed, the conversation titled (if
it has no title, or the batch renames it), and — if a lease was freed or
a record done while someone waits for the session — its waiters woken."""


async def commit(
    db: Db,
    moment: float,
    key: SessionKey,
    generation: int | None,
    batch: WriteBatch,
    fields: list[tuple[str, str]],
    retention: float,
    notice: tuple[str, str],
    token: str = "",
) -> bool:
    """Fenced: the generation is checked before the writes, in the transaction that writes.

    :param notice: the store's channel and the session's token on it: the waiters to wake.
    :param token: a lease's token: free that lease with the writes.
    :returns: whether a lease was freed.
    :raises StaleGeneration: the generation moved on.
    :raises AlreadyAnswered: a message of ``batch.answered`` was answered within ``retention``
        (the transaction must then roll back: the statement wrote the rest).
    """
    row = await db.fetchrow(
        "SELECT generation, current_conversation FROM sessions WHERE key = $1", key
    )
    current, conversation = (0, "") if row is None else (int(row[0]), row[1])
    if generation is not None and generation != current:
        raise StaleGeneration(key, generation, current, "commit")
    conversation = conversation or (await _start(db, moment, key, "")).id
    wanted = list(dict.fromkeys(batch.answered))  # one row per message: a statement sets it once
    entries = batch.transcript
    result = await db.fetchrow(
        _WRITE,
        key,
        moment,
        batch.answer,
        wanted,
        moment - retention,
        conversation,
        *_entry_columns(entries, conversation, moment),
        [name for name, _ in fields],
        [value for _, value in fields],
        batch.done,
        token,
        *notice,
        batch.title,
        batch.rename,
        [encode_attachments(e.attachments) for e in entries],
    )
    assert result is not None
    marked, freed = set(result[0]), bool(result[1])
    repeated = [message_id for message_id in wanted if message_id not in marked]
    if repeated:
        raise AlreadyAnswered(repeated, key=key)
    return freed


def _entry_columns(
    entries: Sequence[TranscriptEntry], conversation: str, moment: float
) -> tuple[list[Any], ...]:
    """The entries' columns as :data:`_WRITE` takes them, one array each (their attachments
    are a later parameter): the conversation each names, if another, role, content,
    generation, message id and time."""
    return (
        [
            e.conversation_id if e.conversation_id not in ("", conversation) else None
            for e in entries
        ],
        [e.role for e in entries],
        [e.content for e in entries],
        [e.generation for e in entries],
        [e.message_id for e in entries],
        [e.created_at or moment for e in entries],
    )


async def load_persistent(db: Db, key: SessionKey) -> dict[str, Any]:
    rows = await db.fetch(
        "SELECT field, value FROM persistent WHERE key = $1 ORDER BY position", key
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


async def answer(db: Db, message_id: str, retention: float) -> str | None:
    """The answer kept with ``message_id``'s mark, if it is within ``retention`` (server time)."""
    found: str | None = await db.fetchval(
        "SELECT answer FROM answered WHERE message_id = $1 AND at > extract(epoch FROM now()) - $2",
        message_id,
        retention,
    )
    return found


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
