"""Streamed replies in Slack: one message, edited as the chunks come
(:mod:`~chatlane.adapters.drafts`), its text as mrkdwn.

Slack's ``chat.update`` is rate limited per workspace; a draft is edited at
most once per :data:`~chatlane.adapters.drafts.EDIT_INTERVAL`.
"""

from __future__ import annotations

from chatlane.adapters.drafts import EDIT_INTERVAL, Draft, Drafts, Show
from chatlane.adapters.slack_format import MESSAGE_LIMIT, split_message, to_mrkdwn
from chatlane.types import clean_text

__all__ = ["EDIT_INTERVAL", "MORE", "Draft", "Drafts", "Show", "draft_text"]

MORE = " …"
"""Ends a draft that shows only the beginning of a longer text."""


def draft_text(streamed: str) -> str:
    """What a draft shows of the text streamed so far: its first message's worth, as mrkdwn."""
    parts = split_message(to_mrkdwn(clean_text(streamed)), MESSAGE_LIMIT - len(MORE))
    return parts[0] + MORE if len(parts) > 1 else parts[0]
