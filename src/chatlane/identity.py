"""Who is talking: a message's source and the one function that names its session.

A session key is ``<namespace>:<platform>:<chat_type>:<chat_id>[:<thread_id>][:<user_id>]``.
What stays true:

* :func:`build_session_key` is deterministic and the only producer of keys.
* Every component is escaped (``%`` → ``%25``, ``:`` → ``%3A``), so no id can
  forge a separator: two sources get the same key exactly when they agree on
  every component the :class:`KeyPolicy` puts into the key.
* When the user id is part of the key, the thread slot is always written (empty
  when there is no thread), so the segment count tells a thread from a user and
  :func:`parse_session_key` inverts the key without guessing.
* Empty ids are the same as missing ids.
* A session name a client chooses (:func:`check_session_name`) is used exactly
  as written or refused — never stripped or normalised — so two distinct
  accepted names always name two distinct sessions.
"""

from __future__ import annotations

import enum
import functools
import unicodedata
from dataclasses import dataclass, field
from typing import Final, NewType

from chatlane.errors import InvalidSessionKey, InvalidSessionName, InvalidSource

__all__ = [
    "NO_SESSION",
    "ChatType",
    "KeyPolicy",
    "SessionKey",
    "SessionKeyParts",
    "SessionSource",
    "build_session_key",
    "check_session_key",
    "check_session_name",
    "is_shared",
    "parse_session_key",
]

SEPARATOR = ":"
_ESCAPES = (("%", "%25"), (":", "%3A"))
MAX_SESSION_NAME = 256
"""Most characters a session name may have."""
_REFUSED_CATEGORIES = {
    "Cc": "a control character",
    "Cs": "a lone surrogate",
    "Zl": "a line separator",
    "Zp": "a paragraph separator",
}

SessionKey = NewType("SessionKey", str)
"""The name of one session, as :func:`build_session_key` makes it.

What a ``SessionKey`` guarantees is where it came from, so that a chat id, a
user id or a session name is never taken for one (under ``mypy --strict``,
passing one where a key is expected is an error). A key comes from
:func:`build_session_key` (the one producer of keys for sources), from
:func:`check_session_key` (text from outside that :func:`parse_session_key`
reads), from a store reading back the keys it was given, or is one of the
keys chatlane reserves and no source can be given: the scheduler's records,
local cron jobs' sessions and :data:`NO_SESSION`. At run time it is a plain
``str``: JSON, dict keys and store keys are unchanged.
"""

NO_SESSION: Final = SessionKey("")
"""The empty key, which names no session: an outbound notice to a sender who
has none, a :class:`~chatlane.state.SessionState` made without a key."""


class ChatType(enum.StrEnum):
    """Where a message was written; decides which ids make up the session key."""

    DM = "dm"
    GROUP = "group"
    CHANNEL = "channel"
    THREAD = "thread"


def _optional_id(value: object) -> str | None:
    """Normalise an id: ``None`` and ``""`` are missing; ints become strings."""
    if value is None or value == "":
        return None
    return str(value)


@dataclass(frozen=True, slots=True)
class SessionSource:
    """Where one inbound message came from. Only ``platform`` is required.

    Ids are normalised on creation: ints become strings and ``""`` becomes
    ``None``, so ``SessionSource("tg", chat_id=42)`` equals
    ``SessionSource("tg", chat_id="42")``.

    :raises InvalidSource: for an unknown ``chat_type``.
    """

    platform: str
    chat_id: str | None = None
    chat_type: ChatType = ChatType.DM
    chat_name: str = ""
    thread_id: str | None = None
    user_id: str | None = None
    user_name: str = ""
    message_id: str | None = None

    def __post_init__(self) -> None:
        # Each field is rewritten only when it is not in its normal form already
        # (a source is made for every message; most come normalised).
        if type(self.chat_type) is not ChatType:
            try:
                chat_type = ChatType(self.chat_type)
            except ValueError:
                allowed = ", ".join(t.value for t in ChatType)
                raise InvalidSource(
                    f"unknown chat_type {self.chat_type!r}; expected one of: {allowed}"
                ) from None
            object.__setattr__(self, "chat_type", chat_type)
        for name in _ID_FIELDS:
            value = getattr(self, name)
            if value is not None and (type(value) is not str or not value):
                object.__setattr__(self, name, _optional_id(value))
        for name in _NAME_FIELDS:  # a falsy name that is not "" (None) becomes ""
            value = getattr(self, name)
            if not value and type(value) is not str:
                object.__setattr__(self, name, "")


_NAME_FIELDS: Final = ("chat_name", "user_name")
"""The fields of a :class:`SessionSource` whose missing value is ``""``."""


_ID_FIELDS: Final = ("chat_id", "thread_id", "user_id", "message_id")
"""The fields of a :class:`SessionSource` normalised by :func:`_optional_id`."""


@dataclass(frozen=True, slots=True)
class KeyPolicy:
    """Which ids split a chat into sessions.

    :param namespace: profile name, the first key segment; lets two gateways
        (or two bots) share one store without sharing sessions.
    :param group_sessions_per_user: in groups and channels, outside threads,
        each user gets their own session.
    :param thread_sessions_per_user: inside a thread, each user gets their own
        session (by default a thread is one shared session).
    """

    namespace: str = "main"
    group_sessions_per_user: bool = True
    thread_sessions_per_user: bool = False

    def __post_init__(self) -> None:
        if not self.namespace:
            raise InvalidSource("KeyPolicy.namespace must be a non-empty string")


@dataclass(frozen=True, slots=True)
class SessionKeyParts:
    """The components of a session key, as :func:`parse_session_key` reads them back."""

    namespace: str
    platform: str
    chat_type: ChatType
    chat_id: str | None
    thread_id: str | None = None
    user_id: str | None = None
    segments: tuple[str, ...] = field(default=(), repr=False, compare=False)


def escape_component(value: str) -> str:
    """Escape one key component so it can contain no separator."""
    if "%" not in value and ":" not in value:
        return value
    for raw, escaped in _ESCAPES:
        value = value.replace(raw, escaped)
    return value


def unescape_component(value: str) -> str:
    """Invert :func:`escape_component`."""
    for raw, escaped in reversed(_ESCAPES):
        value = value.replace(escaped, raw)
    return value


_DM = ChatType.DM
"""Compared for every key built; a global, since on Python 3.11 a member read through
its enum class costs about ten times a global read."""


def _includes_user(
    chat_id: str | None, chat_type: ChatType, thread_id: str | None, policy: KeyPolicy
) -> bool:
    if chat_id is None:
        return True
    if chat_type is _DM:
        return False
    if thread_id is not None:
        return policy.thread_sessions_per_user
    return policy.group_sessions_per_user


def build_session_key(source: SessionSource, policy: KeyPolicy = KeyPolicy()) -> SessionKey:
    """Name the session ``source`` belongs to under ``policy``.

    :raises InvalidSource: if the source has no platform, or neither a chat id
        nor a user id.
    """
    if not source.platform:
        raise InvalidSource("a session source needs a platform")
    if source.chat_id is None and source.user_id is None:
        raise InvalidSource(
            f"a session source needs a chat id or a user id (platform {source.platform!r})"
        )
    return _key_of(
        source.platform,
        source.chat_type,
        source.chat_id,
        source.thread_id,
        source.user_id,
        policy.namespace,
        policy.group_sessions_per_user,
        policy.thread_sessions_per_user,
    )


@functools.lru_cache(maxsize=4096)
def _key_of(
    platform: str,
    chat_type: ChatType,
    chat_id: str | None,
    thread_id: str | None,
    user_id: str | None,
    namespace: str,
    group_sessions_per_user: bool,
    thread_sessions_per_user: bool,
) -> SessionKey:
    """The key of a valid source, from the only fields a key depends on (recent ones cached).

    The policy comes as its fields, not as a :class:`KeyPolicy`, so the cache
    hashes and compares only strings and flags.
    """
    policy = KeyPolicy(namespace, group_sessions_per_user, thread_sessions_per_user)
    parts = [namespace, platform, chat_type.value, chat_id or ""]
    if user_id is not None and _includes_user(chat_id, chat_type, thread_id, policy):
        parts += [thread_id or "", user_id]
    elif thread_id is not None:
        parts.append(thread_id)
    return SessionKey(SEPARATOR.join([escape_component(part) for part in parts]))


def is_shared(key: SessionKey) -> bool:
    """Whether ``key`` names a session several people write in: not a DM, and no user in it
    (a group's or thread's session when the key policy does not split it by user)."""
    parts = parse_session_key(key)
    return parts.chat_type is not ChatType.DM and parts.user_id is None


def parse_session_key(key: str) -> SessionKeyParts:
    """Read a key made by :func:`build_session_key` back into its components.

    :raises InvalidSessionKey: if ``key`` does not have that shape.
    """
    segments = tuple(unescape_component(s) for s in key.split(SEPARATOR))
    if not 4 <= len(segments) <= 6:
        raise InvalidSessionKey(f"not a session key (expected 4 to 6 segments): {key!r}")
    namespace, platform, chat_type_text, chat_id = segments[:4]
    if not namespace or not platform:
        raise InvalidSessionKey(f"session key lacks a namespace or platform: {key!r}")
    try:
        chat_type = ChatType(chat_type_text)
    except ValueError:
        raise InvalidSessionKey(f"unknown chat type {chat_type_text!r} in key {key!r}") from None
    thread_id = segments[4] if len(segments) >= 5 else ""
    user_id = segments[5] if len(segments) == 6 else ""
    if (len(segments) == 5 and not thread_id) or (len(segments) == 6 and not user_id):
        raise InvalidSessionKey(f"session key has an empty trailing segment: {key!r}")
    if not chat_id and not user_id:
        raise InvalidSessionKey(f"session key names neither a chat nor a user: {key!r}")
    return SessionKeyParts(
        namespace=namespace,
        platform=platform,
        chat_type=chat_type,
        chat_id=chat_id or None,
        thread_id=thread_id or None,
        user_id=user_id or None,
        segments=segments,
    )


def check_session_key(key: str) -> SessionKey:
    """``key`` itself, as a :data:`SessionKey`, if it has the shape of one.

    The way in for a key kept or sent as text (typed by an operator, read from
    a file) to an API that takes a key.

    :raises InvalidSessionKey: if :func:`parse_session_key` cannot read it.
    """
    parse_session_key(key)
    return SessionKey(key)


def check_session_name(name: str, what: str = "the session name") -> str:
    """``name`` itself, if a client may name a session with it.

    Names are used exactly as written, never stripped or normalised, so two
    distinct accepted names always name two distinct sessions. Refused are the
    names something on the way would change or split (``str.strip`` and HTTP
    drop outer whitespace; ``str.splitlines`` splits on ``\\x1c``-``\\x1f``,
    ``\\x85``, U+2028 and U+2029): empty or longer than
    :data:`MAX_SESSION_NAME`, starting or ending with whitespace, or holding a
    control character, a line or paragraph separator or a lone surrogate.
    Everything else — inner spaces, any script, emoji with joiners — is kept.

    :param what: how the error names the value, e.g. ``"the 'user' field"``.
    :raises InvalidSessionName: naming the offending character and its position.
    """
    if not name:
        raise InvalidSessionName(f"{what} is empty")
    if len(name) > MAX_SESSION_NAME:
        raise InvalidSessionName(f"{what} is longer than {MAX_SESSION_NAME} characters")
    found = _first_refused(name)
    if found is not None:
        position, kind = found
        raise InvalidSessionName(
            f"{what} has {_describe(name[position])}, {kind}, at position {position} "
            "(counting from 0): session names are used exactly as sent, so they may not "
            "start or end with whitespace or hold control or separator characters"
        )
    return name


def _first_refused(name: str) -> tuple[int, str] | None:
    """The position and kind of the first character ``name`` may not hold where it is."""
    if name.isprintable() and not (name[0].isspace() or name[-1].isspace()):
        return None
    last = len(name) - 1
    for position, char in enumerate(name):
        kind = _REFUSED_CATEGORIES.get(unicodedata.category(char))
        if kind is None and char.isspace() and position in (0, last):
            kind = "whitespace at the start" if position == 0 else "whitespace at the end"
        if kind is not None:
            return position, kind
    return None


def _describe(char: str) -> str:
    """``U+001C`` or ``U+00A0 (NO-BREAK SPACE)``."""
    name = unicodedata.name(char, "")
    return f"U+{ord(char):04X}" + (f" ({name})" if name else "")
