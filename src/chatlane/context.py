"""Task-local session context: who the code running right now is working for.

Session identity (platform, chat, thread, user, session key) and the cron
auto-delivery target live in one :class:`contextvars.ContextVar` per field,
never in ``os.environ``: the process environment is shared by every message
handled at once, while each asyncio task — and each executor thread handed a
copy of its context — sees only its own values. What stays true:

1. **No cross-talk.** Code running for one message never sees another's
   values: not in its task, in tasks started with :func:`spawn`, in threads
   started with :func:`run_in_thread`, in child environments from
   :func:`subprocess_env`, or inside :func:`cron_context`. A handler that calls
   :func:`reset_session_vars` on entry starts clean, not from its creator's copy.
2. **Cleared is not unset.** Every variable is *never set* (its private
   sentinel default), *set*, or *cleared* (``""``). After a turn clears its
   context, lookups return ``""`` and never fall back to stale process
   environment; only code that never bound a session (CLI, cron scheduler,
   plain scripts) falls back to ``os.environ``. A turn's context
   (:func:`bound_context`) is bound: its cron delivery variables are cleared.

Each name below is also readable under its ``HERMES_`` alias (same variable),
so code written for a Hermes-style gateway changes only its import.
See ``docs/context.md`` for the whole picture.
"""

from __future__ import annotations

import asyncio
import contextvars
import enum
import functools
import logging
import operator
import os
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import astuple, dataclass, fields, replace
from typing import Any, Final, ParamSpec, TypeAlias, TypeVar

from chatlane.errors import InvalidSource
from chatlane.identity import SessionSource

__all__ = [
    "CRON_VAR_NAMES",
    "SESSION_VAR_NAMES",
    "ContextToken",
    "CronTarget",
    "SessionContext",
    "bind_session",
    "bound_context",
    "clear_session_vars",
    "cron_context",
    "current_cron_target",
    "current_session",
    "get_session_env",
    "reset_session_vars",
    "run_in_thread",
    "set_cron_delivery",
    "set_session_vars",
    "spawn",
    "spawned_tasks",
    "subprocess_env",
]

logger = logging.getLogger("chatlane.context")

P = ParamSpec("P")
T = TypeVar("T")


class _Unset(enum.Enum):
    """The value of a variable that was never set in the current context."""

    NEVER = "never set"


_NEVER: Final = _Unset.NEVER

_Var: TypeAlias = "contextvars.ContextVar[str | _Unset]"
ContextToken: TypeAlias = "contextvars.Token[str | _Unset]"
"""A reset token returned by :func:`set_session_vars` and :func:`set_cron_delivery`."""

FieldValue: TypeAlias = str | int | None
"""What a caller may pass for a field; ``None`` becomes ``""``, ints become strings."""

PREFIX: Final = "CHATLANE_"
ALIAS_PREFIX: Final = "HERMES_"

SESSION_VAR_NAMES: Final = (
    "CHATLANE_SESSION_PLATFORM",
    "CHATLANE_SESSION_CHAT_ID",
    "CHATLANE_SESSION_CHAT_NAME",
    "CHATLANE_SESSION_THREAD_ID",
    "CHATLANE_SESSION_USER_ID",
    "CHATLANE_SESSION_USER_NAME",
    "CHATLANE_SESSION_KEY",
)
CRON_VAR_NAMES: Final = (
    "CHATLANE_CRON_AUTO_DELIVER_PLATFORM",
    "CHATLANE_CRON_AUTO_DELIVER_CHAT_ID",
    "CHATLANE_CRON_AUTO_DELIVER_THREAD_ID",
)

_VARS: Final[dict[str, _Var]] = {
    name: contextvars.ContextVar(name, default=_NEVER)
    for name in SESSION_VAR_NAMES + CRON_VAR_NAMES
}
_SESSION_VARS: Final = tuple(_VARS[name] for name in SESSION_VAR_NAMES)
_CRON_VARS: Final = tuple(_VARS[name] for name in CRON_VAR_NAMES)
_BACKGROUND: Final[set[asyncio.Task[Any]]] = set()


@dataclass(frozen=True, slots=True)
class SessionContext:
    """The session bound to the current context; field order matches ``SESSION_VAR_NAMES``."""

    platform: str = ""
    chat_id: str = ""
    chat_name: str = ""
    thread_id: str = ""
    user_id: str = ""
    user_name: str = ""
    session_key: str = ""


@dataclass(frozen=True, slots=True)
class CronTarget:
    """Where a cron job delivers its output; field order matches ``CRON_VAR_NAMES``."""

    platform: str = ""
    chat_id: str = ""
    thread_id: str = ""


_SESSION_FIELDS: Final = tuple(f.name for f in fields(SessionContext))


def _text(value: FieldValue) -> str:
    return "" if value is None else str(value)


def _alias(name: str) -> str:
    """The other prefix's spelling of a known ``CHATLANE_``/``HERMES_`` name."""
    if name.startswith(PREFIX):
        return ALIAS_PREFIX + name.removeprefix(PREFIX)
    return PREFIX + name.removeprefix(ALIAS_PREFIX)


def _known(name: str) -> _Var | None:
    if name.startswith(ALIAS_PREFIX):
        name = _alias(name)
    return _VARS.get(name)


def _set_all(variables: Sequence[_Var], values: Sequence[str | _Unset]) -> list[ContextToken]:
    return [var.set(value) for var, value in zip(variables, values, strict=True)]


def _set_each(variables: Sequence[_Var], values: Sequence[str]) -> None:
    """:func:`_set_all` for a context nobody resets (no tokens kept)."""
    for var, value in zip(variables, values, strict=True):
        var.set(value)


def _reset_all(tokens: Sequence[ContextToken]) -> None:
    for token in reversed(tokens):
        token.var.reset(token)


def _values(variables: Sequence[_Var]) -> list[str] | None:
    """The variables' values (never-set read as ``""``), or None when none holds text."""
    values = [value if isinstance(value, str) else "" for value in (v.get() for v in variables)]
    return values if any(values) else None


# --- compatibility API -------------------------------------------------------


def set_session_vars(
    platform: FieldValue = "",
    chat_id: FieldValue = "",
    chat_name: FieldValue = "",
    thread_id: FieldValue = "",
    user_id: FieldValue = "",
    user_name: FieldValue = "",
    session_key: FieldValue = "",
) -> list[ContextToken]:
    """Set the seven session variables; return their reset tokens in ``SESSION_VAR_NAMES`` order."""
    values = (platform, chat_id, chat_name, thread_id, user_id, user_name, session_key)
    return _set_all(_SESSION_VARS, [_text(v) for v in values])


def clear_session_vars(tokens: Sequence[ContextToken] = ()) -> None:
    """Mark the seven session variables *cleared* (``""``); cron variables are untouched.

    ``tokens`` is accepted for compatibility and ignored: clearing, unlike
    resetting, never lets a lookup fall back to the process environment.
    """
    _set_all(_SESSION_VARS, [""] * len(_SESSION_VARS))


def reset_session_vars() -> None:
    """Return all ten variables to *never set* in the current context (for handler entry)."""
    _set_all(tuple(_VARS.values()), [_NEVER] * len(_VARS))


def get_session_env(name: str, default: str = "") -> str:
    """Read a session or cron variable by its ``CHATLANE_`` or ``HERMES_`` name.

    A variable set in this context — even to ``""`` — is returned as is. One
    never set here falls back to ``os.environ[name]``, then to the other
    prefix's name, then to ``default``. Unknown names read ``os.environ`` only.
    """
    var = _known(name)
    if var is None:
        return os.environ.get(name, default)
    value = var.get()
    if isinstance(value, str):
        return value
    return os.environ.get(name, os.environ.get(_alias(name), default))


def set_cron_delivery(
    platform: FieldValue, chat_id: FieldValue, thread_id: FieldValue = None
) -> list[ContextToken]:
    """Set the three cron delivery variables; return their tokens in ``CRON_VAR_NAMES`` order."""
    return _set_all(_CRON_VARS, [_text(platform), _text(chat_id), _text(thread_id)])


# --- modern API ---------------------------------------------------------------


def _from_fields(fields_: Mapping[str, FieldValue]) -> SessionContext:
    unknown = sorted(set(fields_) - set(_SESSION_FIELDS))
    if unknown:
        raise InvalidSource(f"unknown session field(s) {unknown}; expected {list(_SESSION_FIELDS)}")
    return SessionContext(**{name: _text(value) for name, value in fields_.items()})


def _from_source(source: SessionSource, session_key: str | None) -> SessionContext:
    return SessionContext(*_source_values(source, session_key or ""))


def _source_values(source: SessionSource, session_key: str) -> tuple[str, ...]:
    """``source``'s session fields as text, in ``SESSION_VAR_NAMES`` order."""
    return (
        source.platform,
        source.chat_id or "",
        source.chat_name,
        source.thread_id or "",
        source.user_id or "",
        source.user_name,
        session_key,
    )


def _to_context(
    source: SessionSource | SessionContext | Mapping[str, FieldValue], session_key: str | None
) -> SessionContext:
    if isinstance(source, SessionSource):
        return _from_source(source, session_key)
    context = source if isinstance(source, SessionContext) else _from_fields(source)
    if session_key is None:
        return context
    return replace(context, session_key=session_key)


_context_values: Final = operator.attrgetter(*_SESSION_FIELDS)


class _Binding(AbstractContextManager[SessionContext]):
    """The context manager :func:`bind_session` returns (a class: it runs on every turn)."""

    __slots__ = ("_context", "_tokens")

    def __init__(self, context: SessionContext) -> None:
        self._context = context
        self._tokens: list[ContextToken] = []

    def __enter__(self) -> SessionContext:
        self._tokens = _set_all(_SESSION_VARS, _context_values(self._context))
        return self._context

    def __exit__(self, *exc_info: object) -> None:
        _reset_all(self._tokens)
        for var in _SESSION_VARS:
            if var.get() is _NEVER:
                var.set("")


def bind_session(
    source: SessionSource | SessionContext | Mapping[str, FieldValue],
    session_key: str | None = None,
) -> AbstractContextManager[SessionContext]:
    """Bind a session for the body of the ``with`` block and yield what was bound.

    ``source`` is a :class:`~chatlane.identity.SessionSource` (``None`` ids
    become ``""``), a :class:`SessionContext`, or a mapping of field names.
    ``session_key``, when given, overrides the source's key. On exit, normal
    or by exception, each variable goes back to what it was before the block,
    except that a variable that was never set becomes *cleared* (``""``): an
    outermost binding always leaves the context cleared.

    :raises InvalidSource: if a mapping names a field ``SessionContext`` lacks.
    """
    return _Binding(_to_context(source, session_key))


_BOUND_TEMPLATES: dict[tuple[str, ...], contextvars.Context] = {}
"""Contexts that only bind a session, by its values: :func:`bound_context` hands out copies.

A copy shares its template's immutable mapping and costs far less than
setting seven variables, and a variable set in one copy is set in that
copy alone. Kept in insertion order; the oldest goes when the limit is hit.
"""
_BOUND_TEMPLATE_LIMIT: Final = 4096
_CLEARED_CRON: Final = ("",) * len(CRON_VAR_NAMES)


def bound_context(source: SessionSource, session_key: str) -> contextvars.Context:
    """A new :class:`contextvars.Context` holding ``source``'s session and nothing else.

    A task created with it (``asyncio.create_task(..., context=...)``) runs
    with the session bound from its first step to its last, as if its whole
    body were inside :func:`bind_session`. The cron delivery variables are
    *cleared* there (``""``), whatever the creator's context or the process
    environment holds: a turn is bound, so nothing in it falls back to
    ``os.environ``, and a stale delivery target can never reach a tool or a
    child process. The engine runs each turn this way: binding once costs a
    fraction of entering and leaving a ``with`` block, and the context dies
    with the task.
    """
    values = _source_values(source, session_key)
    template = _BOUND_TEMPLATES.get(values)
    if template is None:
        template = contextvars.Context()
        template.run(_set_each, _SESSION_VARS + _CRON_VARS, values + _CLEARED_CRON)
        if len(_BOUND_TEMPLATES) >= _BOUND_TEMPLATE_LIMIT:
            _BOUND_TEMPLATES.pop(next(iter(_BOUND_TEMPLATES)), None)
        _BOUND_TEMPLATES[values] = template
    return template.copy()


def current_session() -> SessionContext | None:
    """The bound session, or None when every session variable is never set or cleared.

    Never reads ``os.environ``: only :func:`get_session_env` has the legacy fallback.
    """
    values = _values(_SESSION_VARS)
    return None if values is None else SessionContext(*values)


@contextmanager
def cron_context(
    platform: FieldValue, chat_id: FieldValue, thread_id: FieldValue = None
) -> Iterator[CronTarget]:
    """Run a cron job's body: session variables cleared, delivery target set.

    On exit, normal or by exception, all ten variables get back their previous
    values (including *never set*) through their tokens.
    """
    target = CronTarget(_text(platform), _text(chat_id), _text(thread_id))
    tokens = _set_all(_SESSION_VARS, [""] * len(_SESSION_VARS))
    tokens += _set_all(_CRON_VARS, astuple(target))
    try:
        yield target
    finally:
        _reset_all(tokens)


def current_cron_target() -> CronTarget | None:
    """The cron delivery target, or None when every cron variable is never set or cleared."""
    values = _values(_CRON_VARS)
    return None if values is None else CronTarget(*values)


# --- propagation ----------------------------------------------------------------


async def run_in_thread(func: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
    """Run ``func`` in the default executor with a copy of the current context.

    Plain ``loop.run_in_executor`` runs in the worker thread's own context,
    where no session is bound.
    """
    call = functools.partial(contextvars.copy_context().run, func, *args, **kwargs)
    return await asyncio.get_running_loop().run_in_executor(None, call)


def spawn(coro: Coroutine[Any, Any, T], *, name: str | None = None) -> asyncio.Task[T]:
    """Start ``coro`` as a background task with a copy of the creator's context.

    The task is strongly referenced until it finishes, so it cannot be
    garbage-collected mid-flight; an exception it raises is logged to
    ``chatlane.context`` (and still raised to anyone awaiting the task). A
    ``SystemExit`` is raised as a ``RuntimeError`` from it: let out of a task,
    asyncio would stop the whole gateway.
    """
    task = asyncio.get_running_loop().create_task(_contained(coro), name=name)
    _BACKGROUND.add(task)
    task.add_done_callback(_spawned_done)
    return task


async def _contained(coro: Coroutine[Any, Any, T]) -> T:
    try:
        return await coro
    except SystemExit as error:
        raise RuntimeError(f"a background task called exit ({error.code!r})") from error


def _spawned_done(task: asyncio.Task[Any]) -> None:
    _BACKGROUND.discard(task)
    error = None if task.cancelled() else task.exception()
    if error is not None:
        logger.error("spawned task %r failed", task.get_name(), exc_info=error)


def spawned_tasks() -> frozenset[asyncio.Task[Any]]:
    """The tasks started by :func:`spawn` that have not finished yet."""
    return frozenset(_BACKGROUND)


def subprocess_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """An environment for a child process that carries this context's variables.

    Starts from a copy of ``base`` (default ``os.environ``); every variable set
    in this context is written under its ``CHATLANE_`` name and its ``HERMES_``
    alias, cleared ones as ``""``. Never-set variables are left as in ``base``.
    """
    env = dict(os.environ if base is None else base)
    for name, var in _VARS.items():
        value = var.get()
        if isinstance(value, str):
            env[name] = env[_alias(name)] = value
    return env
