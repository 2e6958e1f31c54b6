"""The SQLite store's conversations and their transcripts.

Each function is an operation of the store's writer thread
(:mod:`chatlane.stores.sqlite_writer`), or a part of one: a function of the
connection, run inside the transaction of its batch, depending on the
database alone. What stays true:

* A session has one current conversation (``sessions.current_conversation``);
  reading it starts one where there is none.
* A conversation's entries are chained, each naming the one appended before
  it (``transcript.prev``) and the conversation naming its newest
  (``conversations.last_entry``, moved on by a trigger of the schema): its last
  entries are read by walking back from its newest, and come back oldest
  first. Entries are never deleted, and never changed once chained.
* An entry naming another conversation keeps that name when read.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from typing import Any

from chatlane.stores.base import Clock, Conversation, TranscriptEntry
from chatlane.stores.codec import decode_attachments, encode_attachments
from chatlane.stores.ids import new_conversation_id
from chatlane.types import SessionKey

__all__ = [
    "append",
    "conversations",
    "current",
    "last_entries",
    "new_conversation",
    "resume",
    "set_title",
    "start",
]

# -- transcripts -----------------------------------------------------------------------

_APPEND = (
    "INSERT INTO transcript (conversation_id, entry_conversation, role, content, generation, "
    "message_id, created_at, attachments, prev) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, "
    "coalesce((SELECT last_entry FROM conversations WHERE id = ?1), 0))"
)
"""One entry, chained after the conversation's newest (whose id the schema's trigger then
moves on to this one: see :data:`chatlane.stores.sqlite_schema.MIGRATIONS`)."""
_LAST_ENTRIES = (
    "WITH RECURSIVE chain (id, depth) AS ("
    "SELECT last_entry, 1 FROM conversations WHERE id = ?1 AND last_entry != 0 "
    "UNION ALL SELECT t.prev, chain.depth + 1 FROM chain JOIN transcript t ON t.id = chain.id "
    "WHERE t.prev != 0 AND chain.depth < ?2) "
    "SELECT t.role, t.content, t.generation, coalesce(t.entry_conversation, t.conversation_id), "
    "t.message_id, t.created_at, t.attachments FROM chain JOIN transcript t ON t.id = chain.id "
    "ORDER BY t.id"
)
"""A conversation's last ``?2`` entries, oldest first: its chain walked back from its newest."""


def append(
    db: sqlite3.Connection, clock: Clock, conversation: str, entries: list[TranscriptEntry]
) -> None:
    """Append to ``conversation``; an entry naming another conversation keeps its own name."""
    moment = clock()
    rows = [
        (
            conversation,
            e.conversation_id if e.conversation_id not in ("", conversation) else None,
            e.role,
            e.content,
            e.generation,
            e.message_id,
            e.created_at or moment,
            encode_attachments(e.attachments),
        )
        for e in entries
    ]
    if len(rows) == 1:  # one statement is cheaper than a batch of one
        db.execute(_APPEND, rows[0])
    else:
        db.executemany(_APPEND, rows)


def last_entries(
    db: sqlite3.Connection, clock: Clock, key: SessionKey, conversation_id: str | None, limit: int
) -> list[TranscriptEntry]:
    """The last ``limit`` entries of ``conversation_id`` (default: ``key``'s current one)."""
    conversation = current(db, clock, key).id if conversation_id is None else conversation_id
    if limit <= 0:
        return []
    rows = db.execute(_LAST_ENTRIES, (conversation, limit)).fetchall()
    return [
        TranscriptEntry(r[0], r[1], r[2], r[3], r[4], r[5], decode_attachments(r[6])) for r in rows
    ]


# -- conversations -------------------------------------------------------------------

_CONVERSATION = "SELECT c.id, c.key, c.started_at, c.ended_at, c.title FROM conversations c"


def _conversation(row: Sequence[Any]) -> Conversation:
    """A row of :data:`_CONVERSATION` as a conversation (the key was stored from one)."""
    id_, key, started_at, ended_at, title = row
    return Conversation(id_, SessionKey(key), started_at, ended_at, title)


def current(db: sqlite3.Connection, clock: Clock, key: SessionKey) -> Conversation:
    """``key``'s current conversation, started (and made current) if it has none."""
    row = db.execute(
        f"{_CONVERSATION} JOIN sessions s ON c.id = s.current_conversation WHERE s.key = ?",
        (key,),
    ).fetchone()
    return start(db, clock, key, "") if row is None else _conversation(row)


def start(db: sqlite3.Connection, clock: Clock, key: SessionKey, title: str) -> Conversation:
    """A new conversation, made ``key``'s current one (the one before is left as it is)."""
    conversation = Conversation(new_conversation_id(), key, clock(), title=title)
    db.execute(
        "INSERT INTO conversations (id, key, started_at, title) VALUES (?, ?, ?, ?)",
        (conversation.id, key, conversation.started_at, title),
    )
    db.execute(
        "INSERT INTO sessions (key, current_conversation) VALUES (?, ?) ON CONFLICT (key) "
        "DO UPDATE SET current_conversation = excluded.current_conversation",
        (key, conversation.id),
    )
    return conversation


def _end_current(db: sqlite3.Connection, clock: Clock, key: SessionKey) -> None:
    db.execute(
        "UPDATE conversations SET ended_at = ? "
        "WHERE id = (SELECT current_conversation FROM sessions WHERE key = ?)",
        (clock(), key),
    )


def new_conversation(
    db: sqlite3.Connection, clock: Clock, key: SessionKey, title: str
) -> Conversation:
    """End ``key``'s current conversation and start another."""
    _end_current(db, clock, key)
    return start(db, clock, key, title)


def resume(
    db: sqlite3.Connection, clock: Clock, key: SessionKey, conversation_id: str
) -> Conversation:
    """Make ``key``'s conversation ``conversation_id`` current again, ending the current one.

    :raises KeyError: ``conversation_id`` is not one of ``key``'s.
    """
    ours = "SELECT 1 FROM conversations WHERE id = ? AND key = ?"
    if db.execute(ours, (conversation_id, key)).fetchone() is None:
        raise KeyError(conversation_id)
    _end_current(db, clock, key)
    db.execute("UPDATE conversations SET ended_at = 0 WHERE id = ?", (conversation_id,))
    db.execute("UPDATE sessions SET current_conversation = ? WHERE key = ?", (conversation_id, key))
    return _conversation(
        db.execute(f"{_CONVERSATION} WHERE c.id = ?", (conversation_id,)).fetchone()
    )


def conversations(
    db: sqlite3.Connection, clock: Clock, key: SessionKey, limit: int
) -> list[Conversation]:
    """Newest first; equal start times keep the order they were started in (their ids')."""
    current(db, clock, key)
    rows = db.execute(
        f"{_CONVERSATION} WHERE c.key = ? ORDER BY c.started_at DESC, c.id LIMIT ?",
        (key, limit if limit >= 0 else -1),
    ).fetchall()
    return [_conversation(row) for row in rows][:limit]


def set_title(db: sqlite3.Connection, conversation: str, title: str, rename: bool) -> None:
    """Title ``conversation``: if it has no title yet, unless ``rename``."""
    untitled = "" if rename else " AND title = ''"
    db.execute(f"UPDATE conversations SET title = ? WHERE id = ?{untitled}", (title, conversation))
