"""What Slack sends, read into chatlane's terms: messages, button presses, approval blocks.

Nothing here talks to Slack or imports slack-sdk: these are pure functions of
the payloads, so :mod:`chatlane.serve` can check the configuration without
the ``slack`` extra.

What stays true:

* A conversation's chat type depends on its id alone, never on which event
  brought a message (``message`` events name ``channel_type``, ``app_mention``
  events do not): a DM (``im``, ids starting with ``D``) is ``dm``; a channel,
  a private channel and a group DM — each a room of several people — are
  ``group`` (chatlane's ``channel`` is a broadcast channel without authors).
  So one message has one session, whichever event arrives first.
* A message's id is made from its conversation, its ``ts`` and its author
  (:func:`message_id`): a retried event and a second event for the same
  message (``message`` and ``app_mention``) name the same message, and the
  author of every turn can be read back from its messages' ids
  (:func:`author_of`), so an approval prompt's buttons name who may press them.
* Only people's messages are read: a bot's (``bot_id``, subtype
  ``bot_message``), the bot's own, an edit, a deletion and every other subtype
  but ``thread_broadcast`` and ``file_share`` are not.
* A message's files are its attachments (:mod:`~chatlane.adapters.slack_files`);
  with some, its text may be empty. A message with neither text nor files is
  not read.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs

from chatlane.adapters.recent import Recent
from chatlane.adapters.slack_files import files_of
from chatlane.approvals import is_request_id
from chatlane.config import SlackConfig, SlackMode
from chatlane.errors import ConfigError
from chatlane.identity import ChatType, SessionSource
from chatlane.secrets import missing_secret, where_to_set
from chatlane.types import Attachment, InboundMessage, clean_text

__all__ = [
    "APPROVE_ACTION",
    "DENY_ACTION",
    "PLATFORM",
    "Posted",
    "Press",
    "Recent",
    "approval_blocks",
    "author_of",
    "chat_type_of",
    "check_secrets",
    "message_id",
    "read_interaction",
    "read_posted",
    "read_press",
]

PLATFORM = "slack"
ID_PREFIX = "slack"
APPROVE_ACTION = "chatlane_approve"
DENY_ACTION = "chatlane_deny"
_ANSWERS = {APPROVE_ACTION: "/approve", DENY_ACTION: "/deny"}
"""A button's ``action_id`` → the command a press sends."""
_READ_SUBTYPES = frozenset({None, "thread_broadcast", "file_share"})
"""Message subtypes that are a person writing (a thread reply also sent to the channel,
a message with files)."""
_ENTITIES = (("&lt;", "<"), ("&gt;", ">"), ("&amp;", "&"))
_APP_TOKEN = re.compile(r"xapp-[A-Za-z0-9-]+")
"""The shape of an app-level token (``xapp-1-A0123-456-abc…``)."""


def check_secrets(
    settings: SlackConfig, bot_token: str, signing_secret: str, app_token: str
) -> None:
    """Every mode needs the bot token; the Events API the signing secret, Socket Mode an
    app-level token (``xapp-…``) instead, each read from where ``settings`` say. A value
    is never part of the error.

    :raises ConfigError: in one line, naming what is missing or malformed and where the
        configuration reads it from (:func:`~chatlane.secrets.where_to_set`).
    """
    mode = settings.mode
    if not bot_token:
        raise missing_secret(
            "slack is enabled but has no bot token", settings.bot_token, "slack.bot_token"
        )
    if mode is SlackMode.EVENTS and not signing_secret:
        where = where_to_set(settings.signing_secret, "slack.signing_secret")
        raise ConfigError(
            f"slack is enabled but has no signing secret: {where}, "
            'or use Socket Mode (slack.mode = "socket")'
        )
    if mode is SlackMode.SOCKET and not app_token:
        raise missing_secret(
            "slack is in socket mode but has no app token", settings.app_token, "slack.app_token"
        )
    if mode is SlackMode.SOCKET and not _APP_TOKEN.fullmatch(app_token):
        raise ConfigError(
            "slack's app token is not an app-level token: expected 'xapp-' followed by "
            "letters, digits and dashes (Basic Information → App-Level Tokens, with the "
            "connections:write scope)"
        )


def chat_type_of(channel: str, channel_type: str | None = None) -> ChatType:
    """``dm`` for a DM, ``group`` for every other conversation (see the module docstring)."""
    return ChatType.DM if channel_type == "im" or channel.startswith("D") else ChatType.GROUP


def message_id(channel: str, ts: str, user: str) -> str:
    """chatlane's id of the message ``ts`` that ``user`` wrote in ``channel``."""
    return f"{ID_PREFIX}-{channel}-{ts}-{user}"


def author_of(message_ids: tuple[str, ...]) -> str | None:
    """Who wrote the messages of a turn, read from their ids; None when they do not say."""
    authors = {_author(message) for message in message_ids}
    return authors.pop() if len(authors) == 1 else None


def _author(message: str) -> str | None:
    prefix, *parts = message.split("-")
    return parts[-1] if prefix == ID_PREFIX and len(parts) == 3 and parts[-1] else None


@dataclass(frozen=True, slots=True)
class Posted:
    """A person's message in a conversation the bot is in."""

    channel: str
    chat_type: ChatType
    ts: str
    thread_ts: str | None
    """The thread the message is in; None at the top level."""
    user: str
    text: str
    """As chatlane reads it: the bot's mentions taken out, Slack's escapes undone."""
    mentions_bot: bool
    parent_user: str | None
    """Who wrote the thread's first message (for a message in a thread)."""
    files: tuple[Attachment, ...] = ()
    """The files shared with the message, as attachments."""

    @property
    def id(self) -> str:
        return message_id(self.channel, self.ts, self.user)

    def inbound(self) -> InboundMessage:
        """The message chatlane gets; its replies go to the same conversation and thread."""
        source = SessionSource(
            PLATFORM,
            chat_id=self.channel,
            chat_type=self.chat_type,
            thread_id=self.thread_ts,
            user_id=self.user,
            message_id=self.ts,
        )
        return InboundMessage(source, self.text, id=self.id, attachments=self.files)


def _read_subtype(subtype: object) -> bool:
    """Whether a message of ``subtype`` is a person writing (any shape Slack might send)."""
    return (subtype is None or isinstance(subtype, str)) and subtype in _READ_SUBTYPES


def read_posted(event: Mapping[str, Any], bot_user: str) -> Posted | None:
    """The person's message ``event`` carries, or None (see the module docstring)."""
    kind, user, subtype = event.get("type"), event.get("user"), event.get("subtype")
    if kind not in ("message", "app_mention") or not _read_subtype(subtype):
        return None
    if event.get("bot_id") or not isinstance(user, str) or not user or user == bot_user:
        return None
    channel, ts, text = event.get("channel"), event.get("ts"), event.get("text", "")
    if not (isinstance(channel, str) and isinstance(ts, str) and isinstance(text, str)):
        return None
    mention = re.compile(rf"<@{re.escape(bot_user)}(?:\|[^>]*)?>")
    cleaned = _unescape(mention.sub("", clean_text(text))).strip()
    files = files_of(event)
    if not channel or not (cleaned or files):
        return None
    thread = event.get("thread_ts")
    parent = event.get("parent_user_id")
    return Posted(
        channel=channel,
        chat_type=chat_type_of(channel, event.get("channel_type")),
        ts=ts,
        thread_ts=thread if isinstance(thread, str) and thread and thread != ts else None,
        user=user,
        text=cleaned,
        mentions_bot=kind == "app_mention" or mention.search(text) is not None,
        parent_user=parent if isinstance(parent, str) else None,
        files=files,
    )


def _unescape(text: str) -> str:
    for escaped, plain in _ENTITIES:
        text = text.replace(escaped, plain)
    return text


@dataclass(frozen=True, slots=True)
class Press:
    """A press of one of chatlane's buttons (or of one it no longer knows: ``command`` empty)."""

    channel: str
    thread_ts: str | None
    user: str
    action_ts: str
    command: str
    """``/approve #<request>`` or ``/deny #<request>``; empty for a button not chatlane's."""
    asker: str | None
    """The user whose turn asked; None when the prompt did not say."""

    def inbound(self) -> InboundMessage:
        """The command the press sends, as the user who pressed, where the prompt is."""
        source = SessionSource(
            PLATFORM,
            chat_id=self.channel,
            chat_type=chat_type_of(self.channel),
            thread_id=self.thread_ts,
            user_id=self.user,
        )
        pressed = message_id(self.channel, f"press{self.action_ts}", self.user)
        return InboundMessage(source, self.command, id=pressed)


def read_interaction(body: bytes) -> Mapping[str, Any]:
    """The JSON ``payload`` field of an interaction request's form body.

    :raises ValueError: if there is none, or it is not a JSON object.
    """
    fields = parse_qs(body.decode("utf-8"), strict_parsing=True)
    try:
        payload = json.loads(fields["payload"][0]) if "payload" in fields else None
    except RecursionError:  # nested past the parser's depth
        payload = None
    if not isinstance(payload, dict):
        raise ValueError("an interaction needs a JSON object in its 'payload' field")
    return payload


def read_press(payload: Mapping[str, Any]) -> Press | None:
    """The button press a ``block_actions`` payload carries; None for anything else."""
    user, channel, message = payload.get("user"), payload.get("channel"), payload.get("message")
    actions = payload.get("actions")
    if payload.get("type") != "block_actions" or not isinstance(actions, list) or not actions:
        return None
    if not (isinstance(user, dict) and isinstance(channel, dict) and isinstance(message, dict)):
        return None
    action = actions[0] if isinstance(actions[0], dict) else {}
    user_id, channel_id = user.get("id"), channel.get("id")
    if not (isinstance(user_id, str) and user_id and isinstance(channel_id, str) and channel_id):
        return None
    command, asker = _answer(action)
    thread, ts = message.get("thread_ts"), message.get("ts")
    return Press(
        channel=channel_id,
        thread_ts=thread if isinstance(thread, str) and thread and thread != ts else None,
        user=user_id,
        action_ts=str(action.get("action_ts") or payload.get("trigger_id") or ""),
        command=command,
        asker=asker,
    )


def _answer(action: Mapping[str, Any]) -> tuple[str, str | None]:
    """The command an action sends and the asker its value names (``"", None``: not ours)."""
    verb, value = _ANSWERS.get(str(action.get("action_id"))), action.get("value")
    if verb is None or not isinstance(value, str):
        return "", None
    request, _, asker = value.partition(":")
    if request and not is_request_id(request):
        return "", None
    return (f"{verb} #{request}" if request else verb), (asker or None)


def approval_blocks(text: str, request_id: str, asker: str | None) -> list[dict[str, Any]]:
    """The prompt ``text`` (mrkdwn) with Approve / Deny buttons for ``request_id``.

    The buttons' value names the request and the asker, so a press answers its
    own request or nothing, and only the asker's press counts.
    """
    value = f"{request_id}:{asker or ''}"
    return [
        {"type": "section", "text": {"type": "mrkdwn", "text": text}},
        {
            "type": "actions",
            "elements": [
                _button("Approve", APPROVE_ACTION, value, "primary"),
                _button("Deny", DENY_ACTION, value, "danger"),
            ],
        },
    ]


def _button(label: str, action_id: str, value: str, style: str) -> dict[str, Any]:
    text = {"type": "plain_text", "text": label}
    return {"type": "button", "text": text, "action_id": action_id, "value": value, "style": style}
