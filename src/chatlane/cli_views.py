"""What the command line prints of the admin API's answers, for people to read.

Every function returns lines of text without line breaks; the caller escapes
control characters (:func:`~chatlane.logs.escape_controls`). A field the
answer lacks is shown as missing, never a crash: the answer comes from
whatever listens at the URL.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator, Mapping
from typing import Any

TRANSCRIPT_INDENT = "    "


def session_lines(detail: Mapping[str, Any]) -> Iterator[str]:
    """``chatlane inspect``: one session's state, queue, problems and recent transcript."""
    yield f"session       {detail.get('key', '?')}"
    yield f"state         {_state(detail)}"
    conversation = detail.get("conversation")
    if isinstance(conversation, Mapping):
        yield f"conversation  {_conversation(conversation)}"
    persistent = detail.get("persistent")
    if isinstance(persistent, Mapping) and persistent:
        settings = ", ".join(f"{name}={value}" for name, value in sorted(persistent.items()))
        yield f"settings      {settings}"
    yield from _listed("queued", detail.get("pending"), _pending)
    yield from _listed("failed", detail.get("failed"), _failed)
    yield from _listed("undelivered", detail.get("dead_deliveries"), _dead)
    yield from _transcript(detail.get("transcript"))


def _state(detail: Mapping[str, Any]) -> str:
    generation = detail.get("generation", "?")
    live = detail.get("live")
    if not isinstance(live, Mapping):
        return f"not active in this gateway process (generation {generation})"
    return (
        f"{live.get('activity', '?')}, generation {generation}, {live.get('queued', '?')} "
        f"queued, idle {live.get('idle_seconds', '?')} s"
    )


def _conversation(conversation: Mapping[str, Any]) -> str:
    shown = str(conversation.get("id") or "?")
    if conversation.get("title"):
        shown += f" {str(conversation['title'])!r}"
    started = conversation.get("started_at")
    if isinstance(started, int | float) and not isinstance(started, bool):
        moment = datetime.datetime.fromtimestamp(started, datetime.UTC)
        shown += f", started {moment:%Y-%m-%d %H:%M:%S} UTC"
    return shown


def _listed(title: str, items: object, line: Any) -> Iterator[str]:
    if not isinstance(items, list) or not items:
        return
    yield f"{title:<13} {len(items)}"
    for item in items:
        if isinstance(item, Mapping):
            yield f"  {line(item)}"


def _pending(item: Mapping[str, Any]) -> str:
    owner = f" (taken by {item['owner']})" if item.get("owner") else ""
    return f"#{item.get('seq', '?')} {item.get('message_id', '?')}{owner}"


def _failed(item: Mapping[str, Any]) -> str:
    return f"{item.get('message_id', '?')}: {item.get('reason', '?')}"


def _dead(item: Mapping[str, Any]) -> str:
    return f"{item.get('id', '?')}: {item.get('reason', '?')}"


def _transcript(entries: object) -> Iterator[str]:
    if not isinstance(entries, list):
        return
    yield f"transcript    last {len(entries)} entries" if entries else "transcript    empty"
    for entry in entries:
        if not isinstance(entry, Mapping):
            continue
        lines = str(entry.get("content", "")).splitlines() or [""]
        yield f"  {entry.get('role', '?')}: {lines[0]}"
        yield from (TRANSCRIPT_INDENT + line for line in lines[1:])


__all__ = ["session_lines"]
