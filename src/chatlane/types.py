"""The vocabulary of chatlane: what flows in, what flows out, and what an agent is.

Everything here is a small frozen record or a type alias; behaviour lives in
the modules that use them. The records made for every message are frozen
msgspec structs: built in C, they cost a tenth of a frozen dataclass.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import re
import secrets
import time
import unicodedata
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

import msgspec

from chatlane.identity import SessionKey as SessionKey  # named beside the one function making keys
from chatlane.identity import SessionSource

if TYPE_CHECKING:
    from chatlane.runtime.turn import Turn

AgentResult: TypeAlias = "str | AsyncIterator[str]"
"""What an agent produces: a whole reply, or text chunks streamed as they come."""

_message_ids = itertools.count(1)
_PROCESS = secrets.token_hex(4)


def new_message_id() -> str:
    """A unique id for a message that arrived without one (unique across processes too)."""
    return f"m-{_PROCESS}-{next(_message_ids)}"


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def clipped(text: str, limit: int) -> str:
    """``text`` if it has at most ``limit`` characters, else its first ``limit - 1`` and ``…``."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def visible(text: str) -> bool:
    """Whether ``text`` holds a character one can see: not only spaces, line breaks,
    controls or invisible format characters (a zero-width space, a joiner)."""
    return any(unicodedata.category(c)[0] not in "ZC" for c in text)


_DISGUISING = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
"""C0 and C1 controls (a terminal escape's ESC, a line break) and the bidirectional
embeddings, overrides and isolates (U+202A to U+202E, U+2066 to U+2069)."""


def disguising(text: str) -> bool:
    """Whether ``text`` holds a character that can change how it or what follows is shown:
    a C0 or C1 control, or a bidirectional embedding, override or isolate."""
    return _DISGUISING.search(text) is not None


def clean_text(text: str) -> str:
    """``text`` with every lone surrogate (which no UTF-8 can carry) replaced by U+FFFD."""
    if text.isascii() or _LONE_SURROGATE.search(text) is None:
        return text
    return _LONE_SURROGATE.sub("\ufffd", text)


class AttachmentKind(enum.StrEnum):
    """How a file was sent; a closed set (the MIME type says what the file holds)."""

    IMAGE = "image"
    """A picture sent as one (a Telegram photo): the platform may have recompressed it."""
    DOCUMENT = "document"
    """A file sent as a file, whatever it holds."""
    AUDIO = "audio"
    """A music or audio file."""
    VOICE = "voice"
    """A voice message recorded in the chat app."""
    VIDEO = "video"
    """A video, an animation or a round video note."""


class Attachment(msgspec.Struct, frozen=True, omit_defaults=True):
    """A reference to a file sent with a message; chatlane never downloads it.

    ``ref`` is how the file is fetched: the platform's file id (read with the
    message's ``source.platform``; on Telegram, ``getFile`` with the bot token
    gives a download path) or an ``http(s)`` URL. ``size`` is in bytes, 0 when
    the platform did not say. ``name`` is the name the sender gave, as text
    only: it may hold separators, any Unicode and be long, so it is never a
    path to write to. Stored with its message (queue and transcript) as is.
    ``private`` marks a URL only the platform's token opens (Slack's
    ``url_private``): it is never handed to anyone without that token.
    """

    kind: AttachmentKind
    ref: str
    mime_type: str = ""
    size: int = 0
    name: str = ""
    private: bool = False

    @property
    def is_url(self) -> bool:
        """Whether ``ref`` is an http(s) URL rather than a platform's file id."""
        return self.ref.startswith(("https://", "http://"))

    @property
    def is_public_url(self) -> bool:
        """Whether ``ref`` is an http(s) URL anyone may fetch (not ``private``)."""
        return self.is_url and not self.private


class ContextLine(msgspec.Struct, frozen=True, omit_defaults=True):
    """A message said in a shared chat that did not mention the bot, kept as context for
    the bot's next turn there (``unmentioned = "context"``, :mod:`chatlane.overheard`).

    ``text`` is as it was said, shortened to the platform's ``context_chars``;
    ``at`` is when it arrived (``time.time()``).
    """

    user_id: str
    text: str
    at: float
    user_name: str = ""
    message_id: str = ""


class InboundMessage(msgspec.Struct, frozen=True, omit_defaults=True):
    """One message for a session.

    ``id`` names the message across every session of the gateway and the
    processes sharing its store: the store keeps one record and one answered mark
    per id. Include the chat in it, as the built-in adapters do (Telegram
    ``tg-{chat}-{message}``), never a per-chat number alone: a message whose
    id another session's message holds is refused with a notice to its sender
    and a refused outcome, and is not run.
    ``internal`` marks messages the gateway made itself (a background task's
    completion, a cron result): they never interrupt a running turn, they queue.
    ``busy_policy`` names the busy policy this one message asks for over its
    session's (``/steer``, ``/now``); empty: the session's. It is stored with
    the message, so it holds in whichever process runs the session.
    ``idempotent`` marks a message whose id its sender's retries name too
    (an API request's ``Idempotency-Key``): its turn first asks the store,
    under the session's lease, whether it was answered already, and if so
    replays that answer instead of running the agent again.
    ``attachments`` are the files sent with it, as references; ``text`` may
    be empty when there are some. ``context`` is what was said in the same
    session's chat without mentioning the bot since its last turn, oldest first
    (:mod:`chatlane.overheard`); it travels with the message, so whichever
    process runs it sees it. ``whole_reply`` marks a message whose sender takes
    only whole replies (an API request without ``stream``, a Telegram message):
    a turn that answers only such messages sends none of its agent's chunks
    out, though each still marks the turn's progress and becomes part of the
    reply. Fields left at their defaults are not stored, so a message without
    attachments or context costs nothing more.
    """

    source: SessionSource
    text: str
    id: str = msgspec.field(default_factory=new_message_id)
    internal: bool = False
    received_at: float = msgspec.field(default_factory=time.time)
    busy_policy: str = ""
    idempotent: bool = False
    attachments: tuple[Attachment, ...] = ()
    context: tuple[ContextLine, ...] = ()
    whole_reply: bool = False

    def cleaned(self) -> InboundMessage:
        """This message, with lone surrogates in its text, source and attachments made U+FFFD.

        Returns ``self`` when there are none (the common case costs a few ``isascii`` calls).
        """
        text = clean_text(self.text)
        source = _clean_source(self.source)
        attachments = self.attachments
        if attachments:
            attachments = _clean_attachments(attachments)
        if text is self.text and source is self.source and attachments is self.attachments:
            return self
        return msgspec.structs.replace(self, text=text, source=source, attachments=attachments)


class Target(msgspec.Struct, frozen=True):
    """Where an outbound message goes: a chat, and a thread inside it if any."""

    platform: str
    chat_id: str | None
    thread_id: str | None = None

    @classmethod
    def of(cls, source: SessionSource) -> Target:
        """The chat and thread ``source`` was written in."""
        return cls(source.platform, source.chat_id or source.user_id, source.thread_id)


class OutboundKind(enum.StrEnum):
    """What an outbound message is, so adapters can render each kind its own way."""

    CHUNK = "chunk"
    """Part of a streamed reply; a ``REPLY`` with the whole text always follows."""
    REPLY = "reply"
    """A complete answer: the agent's reply for a turn, or a command's response."""
    ACK = "ack"
    """A short acknowledgement of a busy outcome (queued, interrupting, steered)."""
    APPROVAL = "approval"
    """A tool asks for approval; adapters may offer Approve / Deny buttons."""
    NOTICE = "notice"
    """An explicit notice that a message was not (or will not be) run: rejected, full, failed."""


class Asks(msgspec.Struct, frozen=True):
    """What an approval prompt asks about, as the tool gave it: its command and reason.

    An adapter whose chat renders Markdown shows the command from here, as
    code it cannot break out of (:func:`~chatlane.approvals.markdown_prompt`),
    never from the prompt's text: a command holding backticks could otherwise
    end its code span and show the rest as formatting — a spoiler, a link —
    which would hide what the user is asked to allow.
    """

    command: str
    reason: str = ""
    asker: str | None = None
    """The user id of whoever's message the asking turn runs (None: not known), so a
    button on the prompt can count only the asker's press."""


class Outbound(msgspec.Struct, frozen=True):
    """One message from chatlane to a chat.

    ``in_reply_to`` names the inbound messages this answers, so an adapter can
    route it to the connection that is waiting for it (an HTTP request, say).
    ``refusal`` is set only on a ``NOTICE`` that refuses those messages: they
    will never run. It holds the busy outcome's value, ``"rejected"`` (the
    session is busy and rejects) or ``"queue_full"``, so an adapter can answer
    in its own terms (the API: 409 or 429) even when the refusal came late,
    from a session that turned out to be busy in another process.
    ``approval_id`` is set only on an ``APPROVAL``: the request it asks about,
    which buttons name (``/approve #<approval_id>``), so that a button on an
    old prompt never answers another request; ``asks`` too (:class:`Asks`).
    """

    kind: OutboundKind
    session_key: SessionKey
    target: Target
    text: str
    generation: int = 0
    in_reply_to: tuple[str, ...] = ()
    refusal: str = ""
    approval_id: str = ""
    asks: Asks | None = None


class ModelChoice(msgspec.Struct, frozen=True):
    """A model to use: its name, and optionally the provider and endpoint. Never an API key."""

    name: str
    provider: str = ""
    base_url: str = ""

    def describe(self) -> str:
        """``name (provider at base_url)`` for replies."""
        where = " at ".join(part for part in (self.provider, self.base_url) if part)
        return f"{self.name} ({where})" if where else self.name


Deliver: TypeAlias = Callable[[Outbound], Awaitable[None]]
"""An adapter's send function. Raising is logged and never breaks a turn."""

OutboundFilter: TypeAlias = Callable[[Outbound], bool]
"""Whether an outbound message may reach its chat (False holds it back); see
:meth:`chatlane.gateway.Gateway.add_outbound_filter`."""


class Agent(Protocol):
    """An async callable that answers a turn.

    It may be an ``async def`` returning ``str`` or an async iterator of chunks,
    or an async generator function. Setting ``accepts_steering = True`` on the
    callable tells the ``steer`` busy policy that it reads ``turn.take_steers()``.
    """

    def __call__(self, turn: Turn, /) -> Awaitable[AgentResult] | AsyncIterator[str]: ...


def accepts_steering(agent: object) -> bool:
    """Whether ``agent`` declared that it reads steered text during a turn."""
    return bool(getattr(agent, "accepts_steering", False))


def default_model(agent: object) -> str:
    """The model ``agent`` uses where a conversation chose none: its ``default_model``
    attribute, if that is a name fit to show (at most 200 characters, visible, no control
    character or bidirectional override); else ``""`` (the agent does not say)."""
    name = getattr(agent, "default_model", None)
    if not isinstance(name, str) or len(name) > 200 or not visible(name) or disguising(name):
        return ""
    return name


_SOURCE_TEXTS = (
    "platform",
    "chat_id",
    "chat_name",
    "thread_id",
    "user_id",
    "user_name",
    "message_id",
)


def _clean_source(source: SessionSource) -> SessionSource:
    if _ascii_texts(source):
        return source  # the common case: one string built and checked, no field by field
    changed: dict[str, Any] = {}
    for name in _SOURCE_TEXTS:
        value = getattr(source, name)
        if isinstance(value, str) and (cleaned := clean_text(value)) is not value:
            changed[name] = cleaned
    return dataclasses.replace(source, **changed) if changed else source


def _clean_attachments(attachments: tuple[Attachment, ...]) -> tuple[Attachment, ...]:
    """``attachments`` with lone surrogates in their texts made U+FFFD (the same tuple if none)."""
    cleaned = tuple(_clean_attachment(a) for a in attachments)
    unchanged = all(new is old for new, old in zip(cleaned, attachments, strict=True))
    return attachments if unchanged else cleaned


def _clean_attachment(attachment: Attachment) -> Attachment:
    a = attachment
    ref, mime_type, name = clean_text(a.ref), clean_text(a.mime_type), clean_text(a.name)
    if ref is a.ref and mime_type is a.mime_type and name is a.name:
        return a
    return msgspec.structs.replace(a, ref=ref, mime_type=mime_type, name=name)


def _ascii_texts(source: SessionSource) -> bool:
    """Whether every text of ``source`` is ASCII (so none holds a lone surrogate)."""
    s = source
    texts = f"{s.platform}{s.chat_id}{s.chat_name}{s.thread_id}{s.user_id}{s.user_name}"
    return f"{texts}{s.message_id}".isascii()
