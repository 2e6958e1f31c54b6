"""Dict-shaped views over session state, for gateways written with one dict per field.

A gateway that kept ``self._running_agents = {}`` and seventeen siblings keyed
by session key migrates by replacing each dict with :func:`legacy_dict_property`.
The property returns a live :class:`~collections.abc.MutableMapping` over one
field of every session in ``runner._sessions``; nothing is copied, so the view
and :class:`~chatlane.state.SessionState` can never drift apart. What stays true:

* a key is in a view exactly when its field is *present* (:class:`Presence`);
* ``runner._sessions`` may be a :class:`~chatlane.state.SessionRegistry`, a
  plain dict of states, or missing (a registry is made on first use);
* reading never creates a session; writing creates it through
  ``runner._session_state(key)`` when the runner has one (even an absent
  value: ``setdefault(key, [])`` must hand back the list the session now holds);
* ``del`` resets the field to its default, so the key leaves the view;
  ``clear()`` resets it on every session, present or not;
* keys iterate in the order they entered the view, as in a dict;
* ``_session_run_generation`` still only grows: a write that would lower a
  generation (including ``del`` and ``clear``) raises :class:`ValueError`.
"""

from __future__ import annotations

import copy
import enum
from collections.abc import Callable, Collection, Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final, Generic, Protocol, Self, TypeVar, overload

from chatlane.errors import ConfigError
from chatlane.identity import SessionKey
from chatlane.state import (
    SERVICE_TIER_UNSET,
    ConversationState,
    PersistentState,
    Scope,
    SessionRegistry,
    SessionState,
    TurnState,
    default_value,
    reset_field,
)

__all__ = [
    "LEGACY_FIELD_SPECS",
    "LegacyFieldSpec",
    "LegacyFieldView",
    "LegacyLeaseTokenView",
    "LegacyProperty",
    "LegacyRunner",
    "LegacyView",
    "Presence",
    "is_present",
    "legacy_dict_property",
    "legacy_lease_token_property",
    "presence_for",
]

K = TypeVar("K")
LeaseKey = tuple[str, int]


class Presence(enum.Enum):
    """When a field counts as present, i.e. its key is in the legacy dict."""

    NOT_NONE = "not-none"  # default None: present unless None
    NOT_UNSET = "not-unset"  # default SERVICE_TIER_UNSET: present unless the sentinel (None counts)
    TRUTHY = "truthy"  # typed default (0.0, "", [], False, 0): present when truthy


def presence_for(default: object) -> Presence:
    """The presence rule implied by a field's default."""
    if default is None:
        return Presence.NOT_NONE
    if default is SERVICE_TIER_UNSET:
        return Presence.NOT_UNSET
    return Presence.TRUTHY


def is_present(presence: Presence, value: object) -> bool:
    """Whether ``value`` is present under ``presence``."""
    if presence is Presence.NOT_NONE:
        return value is not None
    if presence is Presence.NOT_UNSET:
        return value is not SERVICE_TIER_UNSET
    return bool(value)


_SCOPE_CLASSES: Final[Mapping[Scope, type[Any]]] = MappingProxyType(
    {
        Scope.TURN: TurnState,
        Scope.CONVERSATION: ConversationState,
        Scope.PERSISTENT: PersistentState,
    }
)


@dataclass(frozen=True, slots=True)
class LegacyFieldSpec:
    """Which field of which scope a legacy dict name stands for, and its presence rule."""

    name: str
    scope: Scope
    field: str
    presence: Presence

    @property
    def default(self) -> Any:
        """A fresh default of the field, read from the scope dataclass (one source of truth)."""
        return default_value(_SCOPE_CLASSES[self.scope], self.field)


_TABLE: Final = (
    ("_running_agents", Scope.TURN, "agent"),
    ("_running_agents_ts", Scope.TURN, "started_ts"),
    ("_active_session_leases", Scope.TURN, "lease"),
    ("_busy_ack_ts", Scope.TURN, "busy_ack_ts"),
    ("_session_model_overrides", Scope.CONVERSATION, "model_override"),
    ("_pending_one_turn_model_restores", Scope.CONVERSATION, "one_turn_restore"),
    ("_session_reasoning_overrides", Scope.CONVERSATION, "reasoning_override"),
    ("_session_service_tier_overrides", Scope.CONVERSATION, "service_tier_override"),
    ("_last_resolved_model", Scope.CONVERSATION, "last_resolved_model"),
    ("_queued_events", Scope.CONVERSATION, "queued_events"),
    ("_pending_turn_sidecar_notes", Scope.CONVERSATION, "sidecar_notes"),
    ("_session_ephemeral_pin", Scope.CONVERSATION, "ephemeral_pin"),
    ("_session_vc_last", Scope.CONVERSATION, "vc_last"),
    ("_pending_approvals", Scope.TURN, "approval_requests"),
    ("_update_prompt_pending", Scope.PERSISTENT, "update_prompt_pending"),
    ("_pending_native_image_paths_by_session", Scope.PERSISTENT, "native_image_paths"),
    ("_pending_messages", Scope.CONVERSATION, "pending_command_text"),
    ("_session_run_generation", Scope.PERSISTENT, "run_generation"),
)


def _spec(name: str, scope: Scope, field: str) -> LegacyFieldSpec:
    default = default_value(_SCOPE_CLASSES[scope], field)
    return LegacyFieldSpec(name, scope, field, presence_for(default))


LEGACY_FIELD_SPECS: Final[Mapping[str, LegacyFieldSpec]] = MappingProxyType(
    {name: _spec(name, scope, field) for name, scope, field in _TABLE}
)


class LegacyRunner(Protocol):
    """What a class carrying legacy properties may offer; both hooks are optional.

    ``_sessions`` is a :class:`~chatlane.state.SessionRegistry` or a plain
    ``dict`` of :class:`~chatlane.state.SessionState` by key (without one, the
    first view to touch the runner gives it a registry); ``_session_state(key)``
    gets or creates a session (without one, ``_sessions`` is asked).
    """

    _sessions: SessionRegistry | MutableMapping[str, SessionState]

    def _session_state(self, key: str) -> SessionState: ...


Sessions = SessionRegistry | MutableMapping[str, SessionState]

_ORDERS: Final = "_legacy_view_order"
"""The runner attribute holding each view's key order (views are made afresh on every access)."""


def _sessions(runner: Any) -> Sessions:
    """``runner._sessions``; a runner without one gets a :class:`SessionRegistry` now."""
    sessions: Sessions | None = getattr(runner, "_sessions", None)
    if sessions is None:
        sessions = runner._sessions = SessionRegistry()
    return sessions


def _peek(runner: Any, key: str) -> SessionState | None:
    """The session of ``key`` if it exists; never creates one nor counts as an access."""
    sessions = _sessions(runner)
    if isinstance(sessions, SessionRegistry):
        return sessions.peek(SessionKey(key))  # the runner's own key, taken as it is
    return sessions.get(key)


def _session_items(runner: Any) -> list[tuple[str, SessionState]]:
    return list(_sessions(runner).items())


def _get_or_create(runner: Any, key: str) -> SessionState:
    """The session of ``key``, through ``runner._session_state`` when the runner has one."""
    hook: Callable[[str], SessionState] | None = getattr(runner, "_session_state", None)
    if hook is not None:
        return hook(key)
    sessions = _sessions(runner)
    if isinstance(sessions, SessionRegistry):
        return sessions.get(SessionKey(key))  # the runner's own key, taken as it is
    state = sessions.get(key)
    if state is None:
        state = sessions[key] = SessionState(SessionKey(key))
    return state


class LegacyView(MutableMapping[K, Any]):
    """A live mapping over session state; equal to any mapping with the same items.

    Keys iterate in the order they entered this view, as in the dict it
    replaces: overwriting a key keeps its place, removing and adding it again
    moves it to the end, and writes through other views change nothing here.
    """

    def __init__(self, runner: Any, name: str) -> None:
        self._runner = runner
        self._name = name

    def _live(self) -> Iterator[K]:
        """The keys present now, in the runner's session order."""
        raise NotImplementedError

    def _has(self, key: K) -> bool:
        """Whether ``key`` is present now."""
        raise NotImplementedError

    def _order(self) -> dict[K, None]:
        orders: dict[str, dict[K, None]] = self._runner.__dict__.setdefault(_ORDERS, {})
        return orders.setdefault(self._name, {})

    def _write(self, key: K, write: Callable[[], None]) -> None:
        """Run ``write`` for ``key``, keeping the key's place if it stays present."""
        order = self._order()
        if not self._has(key):
            order.pop(key, None)
        write()
        if self._has(key):
            order.setdefault(key, None)
        else:
            order.pop(key, None)

    def __iter__(self) -> Iterator[K]:
        order, live = self._order(), list(self._live())
        present = set(live)
        for key in [key for key in order if key not in present]:
            del order[key]
        for key in live:
            order.setdefault(key, None)
        return iter(list(order))

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def replace(self, entries: Mapping[K, Any] | None) -> None:
        """Make the view hold exactly ``entries`` (``None`` means empty), applied in order."""
        new = dict(entries or {})
        for key in [key for key in self if key not in new]:
            del self[key]
        for key, value in new.items():
            self[key] = value

    def copy(self) -> dict[K, Any]:
        """A snapshot as a plain ``dict``, as ``dict.copy()`` gave legacy code."""
        return dict(self)

    def __or__(self, other: Mapping[K, Any]) -> dict[K, Any]:
        """``view | other``: a new ``dict`` (the view itself is not changed), as for a dict."""
        if not isinstance(other, Mapping):
            return NotImplemented
        return {**self, **other}

    def __ror__(self, other: Mapping[K, Any]) -> dict[K, Any]:
        if not isinstance(other, Mapping):
            return NotImplemented
        return {**other, **self}

    def __ior__(self, other: Mapping[K, Any]) -> Self:
        """``view |= other``: each entry of ``other`` is written through to its session."""
        self.update(other)
        return self

    def __repr__(self) -> str:
        return f"{type(self).__name__}({dict(self)!r})"


class LegacyFieldView(LegacyView[str]):
    """One field across every session of a runner, keyed by session key."""

    def __init__(self, runner: Any, spec: LegacyFieldSpec) -> None:
        super().__init__(runner, spec.name)
        self._spec = spec

    def _scope(self, state: SessionState) -> Any:
        return getattr(state, self._spec.scope.value)

    def _present(self, state: SessionState) -> bool:
        return is_present(self._spec.presence, getattr(self._scope(state), self._spec.field))

    def _present_state(self, key: str) -> SessionState:
        state = _peek(self._runner, key)
        if state is None or not self._present(state):
            raise KeyError(key)
        return state

    def _live(self) -> Iterator[str]:
        return (key for key, state in _session_items(self._runner) if self._present(state))

    def _has(self, key: str) -> bool:
        state = _peek(self._runner, key)
        return state is not None and self._present(state)

    def __getitem__(self, key: str) -> Any:
        return getattr(self._scope(self._present_state(key)), self._spec.field)

    def __setitem__(self, key: str, value: Any) -> None:
        def write() -> None:
            setattr(self._scope(_get_or_create(self._runner, key)), self._spec.field, value)

        self._write(key, write)

    def __delitem__(self, key: str) -> None:
        reset_field(self._scope(self._present_state(key)), self._spec.field)
        self._order().pop(key, None)

    def replace(self, entries: Mapping[str, Any] | None) -> None:
        """Reset the field on every session not in ``entries``, then write ``entries`` in order.

        All or nothing: every write is tried on a copy first, so one the field refuses
        (a ``run_generation`` that would go down) leaves every session as it was.
        """
        new = dict(entries or {})
        self._try_first(new)
        self._reset(keep=new.keys())
        for key, value in new.items():
            self[key] = value

    def clear(self) -> None:
        """Reset the field on every session, present or not (no ``popitem`` loop).

        A session holding an absent value (an empty list handed out by
        ``setdefault``) gets a fresh default too, so nothing stays attached. All or
        nothing, as :meth:`replace`.
        """
        self._try_first({})
        self._reset(keep=())

    def _try_first(self, new: Mapping[str, Any]) -> None:
        """Make on copies the writes :meth:`replace` would make; raise what the field refuses.

        :raises ValueError: (or the field's own error) before any session was changed.
        """
        name = self._spec.field
        known = dict(_session_items(self._runner))
        for key, state in known.items():
            trial = copy.copy(self._scope(state))
            if key in new:
                setattr(trial, name, new[key])
            else:
                reset_field(trial, name)
        for key in new.keys() - known.keys():
            setattr(self._scope(SessionState(SessionKey(key))), name, new[key])

    def _reset(self, keep: Collection[str]) -> None:
        for key, state in _session_items(self._runner):
            if key not in keep:
                reset_field(self._scope(state), self._spec.field)
                self._order().pop(key, None)


def _lease_key(key: object) -> LeaseKey:
    """``key`` as a ``(session_key, generation)`` pair; anything else is a missing key."""
    match key:
        case (str() as session_key, int() as generation):
            return session_key, generation
    raise KeyError(key)


class LegacyLeaseTokenView(LegacyView[LeaseKey]):
    """``turn.lease_tokens`` of every session, keyed by ``(session_key, generation)``.

    A key that is not a ``(session_key, generation)`` pair raises :class:`KeyError`.
    """

    def __init__(self, runner: Any) -> None:
        super().__init__(runner, "_turn_lease_tokens")

    def _tokens(self, key: LeaseKey) -> tuple[dict[int, Any], int]:
        session_key, generation = _lease_key(key)
        state = _peek(self._runner, session_key)
        if state is None or generation not in state.turn.lease_tokens:
            raise KeyError(key)
        return state.turn.lease_tokens, generation

    def _live(self) -> Iterator[LeaseKey]:
        for session_key, state in _session_items(self._runner):
            yield from ((session_key, g) for g in list(state.turn.lease_tokens))

    def _has(self, key: LeaseKey) -> bool:
        try:
            self._tokens(key)
        except KeyError:
            return False
        return True

    def __getitem__(self, key: LeaseKey) -> Any:
        tokens, generation = self._tokens(key)
        return tokens[generation]

    def __setitem__(self, key: LeaseKey, token: Any) -> None:
        session_key, generation = _lease_key(key)

        def write() -> None:
            _get_or_create(self._runner, session_key).turn.lease_tokens[generation] = token

        self._write((session_key, generation), write)

    def __delitem__(self, key: LeaseKey) -> None:
        tokens, generation = self._tokens(key)
        del tokens[generation]
        self._order().pop(key, None)

    def clear(self) -> None:
        """Drop every session's lease tokens (no ``popitem`` loop)."""
        for _, state in _session_items(self._runner):
            state.turn.lease_tokens.clear()
        self._order().clear()


class LegacyProperty(Generic[K]):
    """A class attribute standing in for a legacy dict: get a live view, set, delete.

    Assigning a mapping (or ``None``) makes the view hold exactly those entries;
    ``del runner.attr`` clears the view.
    """

    def __init__(self, make_view: Callable[[Any], LegacyView[K]], doc: str) -> None:
        self._make_view = make_view
        self.__doc__ = doc

    @overload
    def __get__(self, obj: None, owner: type[Any] | None = None) -> Self: ...

    @overload
    def __get__(self, obj: Any, owner: type[Any] | None = None) -> LegacyView[K]: ...

    def __get__(self, obj: Any | None, owner: type[Any] | None = None) -> Self | LegacyView[K]:
        return self if obj is None else self._make_view(obj)

    def __set__(self, obj: Any, entries: Mapping[K, Any] | None) -> None:
        self._make_view(obj).replace(entries)

    def __delete__(self, obj: Any) -> None:
        self._make_view(obj).clear()


def legacy_dict_property(name: str) -> LegacyProperty[str]:
    """A property exposing the field that legacy dict ``name`` stood for.

    :raises ConfigError: if ``name`` is not one of :data:`LEGACY_FIELD_SPECS`.
    """
    spec = LEGACY_FIELD_SPECS.get(name)
    if spec is None:
        raise ConfigError(f"unknown legacy dict {name!r}; known: {', '.join(LEGACY_FIELD_SPECS)}")
    doc = f"Legacy view of {spec.scope.value}.{spec.field}, keyed by session key."
    return LegacyProperty(lambda runner: LegacyFieldView(runner, spec), doc)


def legacy_lease_token_property() -> LegacyProperty[LeaseKey]:
    """A property exposing ``_turn_lease_tokens``: turn lease tokens by ``(key, generation)``."""
    doc = "Legacy view of turn.lease_tokens, keyed by (session_key, generation)."
    return LegacyProperty(LegacyLeaseTokenView, doc)
