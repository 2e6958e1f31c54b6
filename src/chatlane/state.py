"""What is remembered per session, and for how long: one container per key, reset by scope.

Each session owns one :class:`SessionState`, made of three scope containers:

* :class:`TurnState` is cleared at the end of every turn (lease tokens excepted:
  each is released exactly once by the turn that acquired it);
* :class:`ConversationState` is cleared at every conversation boundary;
* :class:`PersistentState` is never cleared wholesale; each field has its own
  lifecycle, and ``run_generation`` only grows.

A scope's ``clear()`` walks :func:`dataclasses.fields`, so fields added later —
in this module or by an application's subclass — are reset with the rest.
:class:`SessionRegistry` hands out one state per key and evicts idle sessions so
memory stays bounded, never a session that is running a turn, and a session
holding what only memory keeps (:attr:`ConversationState.MEMORY_ONLY`) last.
"""

from __future__ import annotations

import enum
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar, Final, Literal, NamedTuple

from chatlane.errors import ConfigError, LeaseError
from chatlane.identity import NO_SESSION, SessionKey
from chatlane.logs import turn_fields

if TYPE_CHECKING:
    from chatlane.runtime.turn import Turn

log = logging.getLogger("chatlane.state")

__all__ = [
    "AGENT_PENDING",
    "SERVICE_TIER_UNSET",
    "ConversationState",
    "EvictHook",
    "PersistentState",
    "Scope",
    "SessionRegistry",
    "SessionState",
    "SlotPhase",
    "TurnState",
    "UserGrant",
    "default_value",
    "reset_field",
    "reset_scope",
]


class AgentPending(enum.Enum):
    """Type of :data:`AGENT_PENDING`: a turn has claimed the session, its agent is starting."""

    AGENT_PENDING = "agent-pending"


class ServiceTierUnset(enum.Enum):
    """Type of :data:`SERVICE_TIER_UNSET`: no service tier override was ever chosen."""

    SERVICE_TIER_UNSET = "service-tier-unset"


AGENT_PENDING: Final = AgentPending.AGENT_PENDING
"""What the legacy ``agent`` projection shows while a turn is claimed or collecting."""
SERVICE_TIER_UNSET: Final = ServiceTierUnset.SERVICE_TIER_UNSET

ServiceTier = str | None | Literal[ServiceTierUnset.SERVICE_TIER_UNSET]


class UserGrant(NamedTuple):
    """An approval grant bound to the user who gave it: it approves ``command`` in that
    user's turns only (what a grant given in a shared session is)."""

    user_id: str
    command: str


def _field_default(f: Field[Any]) -> Any:
    """A fresh default for ``f``: its ``default``, or a new value from its ``default_factory``."""
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    raise ConfigError(f"state field {f.name!r} has no default, so a scope cannot reset it")


def default_value(scope: object, name: str) -> Any:
    """A fresh default for field ``name`` of a scope instance or class.

    A projected field (:attr:`TurnState.agent`) has the default its legacy dict had.

    :raises AttributeError: if the scope has no field ``name``.
    """
    for f in fields(scope):  # type: ignore[arg-type]
        if f.name == name:
            return _field_default(f)
    projected: dict[str, Any] = getattr(scope, "PROJECTED_DEFAULTS", {})
    if name in projected:
        return projected[name]
    raise AttributeError(f"{type(scope).__name__} has no state field {name!r}")


def reset_field(scope: object, name: str) -> None:
    """Set field ``name`` of ``scope`` back to its default (a new list for a list field)."""
    setattr(scope, name, default_value(scope, name))


_ResetStep = tuple[str, Any, bool]
"""One field of a reset: its name, its default or default factory, and which of the two."""

_RESET_PLANS: dict[tuple[type[Any], frozenset[str]], tuple[_ResetStep, ...]] = {}


def _reset_plan(cls: type[Any], keep: frozenset[str]) -> tuple[_ResetStep, ...]:
    """The fields a reset of ``cls`` touches, computed once per class (resets run every turn)."""
    plan = _RESET_PLANS.get((cls, keep))
    if plan is None:
        plan = tuple(_reset_step(f) for f in fields(cls) if f.name not in keep)
        _RESET_PLANS[(cls, keep)] = plan
    return plan


def _reset_step(f: Field[Any]) -> _ResetStep:
    if f.default is not MISSING:
        return (f.name, f.default, False)
    if f.default_factory is not MISSING:
        return (f.name, f.default_factory, True)
    raise ConfigError(f"state field {f.name!r} has no default, so a scope cannot reset it")


def _reset_fields(scope: object, keep: frozenset[str] = frozenset()) -> None:
    for name, default, is_factory in _reset_plan(type(scope), keep):
        setattr(scope, name, default() if is_factory else default)


_KEEP_LEASE_TOKENS: Final = frozenset({"lease_tokens"})


class SlotPhase(enum.Enum):
    """Where a session's turn slot is; a slot moves idle → claimed → running → idle.

    ``collecting`` is the wait before a ``collect`` follow-up claims it.
    """

    IDLE = "idle"
    """No turn: a message for the session starts one at once."""
    COLLECTING = "collecting"
    """Waiting out a collect debounce; the next turn claims the slot after it."""
    ENDING = "ending"
    """A conversation boundary (``/new``, ``/reset``, ``/resume``, an auto-reset) runs:
    the slot is held empty, and a message arriving meanwhile waits for the new
    conversation (:meth:`chatlane.runtime.slots.Slots.begin_boundary`)."""
    CLAIMED = "claimed"
    """A turn holds the slot and waits for its lease."""
    RUNNING = "running"
    """The turn's agent runs under its lease."""


_IDLE, _CLAIMED, _RUNNING = SlotPhase.IDLE, SlotPhase.CLAIMED, SlotPhase.RUNNING
"""The phases the slot moves through on every turn, as globals: on Python 3.11 a
member read through its enum class costs about ten times a global read."""


@dataclass(slots=True)
class TurnState:
    """One session's turn slot and what its turn holds; :meth:`clear` runs after every turn.

    The slot is a small state machine (:class:`SlotPhase`) moved only by
    :meth:`claim`, :meth:`run`, :meth:`collect`, :meth:`hold_for_boundary` and
    :meth:`clear`; ``current``
    is the claimed or running :class:`~chatlane.runtime.turn.Turn`.
    ``started_ts`` and ``busy_ack_ts`` are ``0.0`` when unset.
    ``lease_tokens`` maps the generation that acquired a token to the token; it
    survives :meth:`clear`, because a displaced turn's unwind must free only
    its own token, never its successor's.

    ``agent`` is the old dict-per-field name, projected from the slot for
    the legacy views (:mod:`chatlane.legacy`): ``None`` while idle,
    :data:`AGENT_PENDING` while claimed or collecting, the running agent
    (or turn) while running; assigning it moves the slot the same way.
    """

    PROJECTED_DEFAULTS: ClassVar[dict[str, Any]] = {"agent": None}

    phase: SlotPhase = SlotPhase.IDLE
    current: Turn | None = None
    started_ts: float = 0.0
    lease: Any = None
    """A lease a legacy runner holds (the engine keeps its own in ``lease_tokens``)."""
    busy_ack_ts: float = 0.0
    lease_tokens: dict[int, Any] = field(default_factory=dict)
    approval_requests: dict[str, Any] = field(default_factory=dict)
    """This turn's approval requests still waiting, by id: live futures, never stored."""
    legacy_agent: Any = None
    """What a legacy runner assigned to ``agent`` while running (not a chatlane turn)."""

    @property
    def is_running(self) -> bool:
        """A turn has claimed the session (its agent may still be starting)."""
        return self.phase is not _IDLE or self.started_ts != 0.0

    def claim(self, turn: Turn, now: float) -> None:
        """``turn`` takes the slot (idle or collecting) and waits for its lease.

        The caller has seen the slot free, with no ``await`` since: a claimed or
        running slot is never claimed again (:meth:`chatlane.runtime.slots.Slots.promote`).
        """
        self.phase, self.current, self.started_ts = _CLAIMED, turn, now

    def run(self, turn: Turn) -> None:
        """``turn``, which claimed the slot, took its lease: its agent runs."""
        if self.current is turn:
            self.phase = _RUNNING

    def collect(self, now: float) -> None:
        """Hold the slot empty while a collect debounce runs out."""
        self.phase, self.current, self.started_ts = SlotPhase.COLLECTING, None, now

    def hold_for_boundary(self, now: float) -> None:
        """Hold the free slot empty while a conversation boundary runs."""
        self.phase, self.current, self.started_ts = SlotPhase.ENDING, None, now

    def holds(self, turn: object) -> bool:
        """Whether ``turn`` is the slot's current turn."""
        return self.current is turn and turn is not None

    @property
    def agent(self) -> Any:
        """The legacy projection of the slot (see the class docstring)."""
        if self.phase is SlotPhase.RUNNING:
            return self.current if self.current is not None else self.legacy_agent
        if self.phase is SlotPhase.IDLE:
            return None
        return AGENT_PENDING

    @agent.setter
    def agent(self, value: Any) -> None:
        if value is None:
            self.phase, self.current, self.legacy_agent = SlotPhase.IDLE, None, None
        elif value is AGENT_PENDING:
            self.phase = SlotPhase.CLAIMED
        else:
            self.phase, self.legacy_agent = SlotPhase.RUNNING, value

    def clear(self) -> None:
        """Reset every field, including subclass fields, except ``lease_tokens``.

        A plain :class:`TurnState` (not a subclass) is reset field by field
        here, as every turn ends with this; an empty ``approval_requests`` is
        kept, since it already is its default. A test checks this against
        the walk over :func:`dataclasses.fields` that resets any other class.
        """
        if type(self) is not TurnState:
            _reset_fields(self, keep=_KEEP_LEASE_TOKENS)
            return
        self.phase, self.current, self.started_ts, self.lease = _IDLE, None, 0.0, None
        self.busy_ack_ts, self.legacy_agent = 0.0, None
        if self.approval_requests:
            self.approval_requests = {}

    def store_lease_token(self, generation: int, token: Any) -> None:
        """Record the lease token acquired by the turn of ``generation``.

        :raises LeaseError: if that generation already holds a different token.
        """
        held = self.lease_tokens.get(generation, token)
        if held is not token and held != token:
            raise LeaseError(f"generation {generation} already holds a lease token")
        self.lease_tokens[generation] = token

    def release_lease_token(self, generation: int) -> Any | None:
        """Pop the token of ``generation``: the first call returns it, later calls ``None``.

        The last token out frees the dict's table (an emptied dict keeps it),
        so an idle session costs no more than one that never ran a turn.
        """
        tokens = self.lease_tokens
        token = tokens.pop(generation, None)
        if not tokens:
            tokens.clear()
        return token


@dataclass(slots=True)
class ConversationState:
    """Choices that last one conversation; :meth:`clear` runs at each conversation boundary.

    ``service_tier_override`` is decided by presence, not truthiness:
    :data:`SERVICE_TIER_UNSET` means no choice, ``None`` an explicit normal
    tier, a string such as ``"priority"`` that tier.
    """

    model_override: Any = None
    one_turn_restore: Any = None
    reasoning_override: Any = None
    service_tier_override: ServiceTier = SERVICE_TIER_UNSET
    last_resolved_model: str = ""
    queued_events: list[Any] = field(default_factory=list)
    kept_seqs: frozenset[int] = frozenset()
    """Queued messages that wait here again after a drop the store may have made all the
    same (its answer lost): they count as stored while they wait
    (:mod:`~chatlane.runtime.pending`). Replaced, never changed in place: the empty
    default is one shared object, so a session that never needs it pays nothing for it
    (an empty ``set`` of its own cost 216 bytes a session)."""
    sidecar_notes: list[Any] = field(default_factory=list)
    ephemeral_pin: Any = None
    channel_pin: Any = None
    vc_last: Any = None
    interrupt_streak: int = 0
    """Turns of this conversation interrupted in a row (the ``rollback`` busy policy's depth)."""
    approval_grants: list[str] = field(default_factory=list)
    """Commands approved with ``/approve session``: allowed until the conversation ends.
    Bound to no one: they count in a session of one person only."""
    approval_grants_by_user: tuple[UserGrant, ...] = ()
    """Commands approved with ``/approve session`` in a shared session, each for its
    giver's turns only, until the conversation ends. Replaced, never changed in place
    (the empty default is one shared object, as ``kept_seqs``)."""
    conversation_id: str = ""
    """The store's id of the conversation this scope belongs to, as last read ("" if none)."""
    pending_command_text: str | None = None
    """The command a plain "yes" confirms (``/new confirm``); any other message cancels it."""
    pending_command_generation: int = 0
    """The session's generation when that confirmation was asked: a turn another process ran
    since (its generation higher, and not this process's) lapses it."""
    titled: bool = False
    """A commit of this process titled the conversation: later turns send no title of their own."""
    overheard: list[Any] = field(default_factory=list)
    """What was said here without mentioning the bot since the last message for it
    (:class:`~chatlane.types.ContextLine`, oldest first; :mod:`chatlane.overheard`). Kept
    in this process only: an evicted session loses it, as nothing the store must keep."""

    MEMORY_ONLY: ClassVar[frozenset[str]] = frozenset(
        {"one_turn_restore", "approval_grants", "approval_grants_by_user", "pending_command_text"}
    )
    """The fields a person set that no store keeps: a ``/model --once`` not used yet,
    ``/approve session`` grants (either kind), a confirmation waiting for its "yes". A
    session holding one is evicted last (:class:`SessionRegistry`); a subclass may name
    more."""

    def clear(self) -> None:
        """Reset every field to its default, including fields added by a subclass."""
        _reset_fields(self)

    def holds_memory_only_data(self) -> bool:
        """Whether a field of :attr:`MEMORY_ONLY` is off its default (eviction would lose it)."""
        only = self.MEMORY_ONLY
        return any(
            getattr(self, name) != (default() if is_factory else default)
            for name, default, is_factory in _reset_plan(type(self), frozenset())
            if name in only
        )


@dataclass(slots=True)
class PersistentState:
    """Fields with their own lifecycles; there is deliberately no ``clear()``.

    ``run_generation`` only grows: assigning a smaller (or negative) value
    raises :class:`ValueError`, so a generation is never handed out twice.
    """

    update_prompt_pending: bool = False
    native_image_paths: list[str] = field(default_factory=list)
    run_generation: int = 0
    hygiene_failure_streak: int = 0
    busy_policy: Any = None
    """This session's own busy policy (``/busy``), or None for the gateway's."""
    approval_allowlist: list[str] = field(default_factory=list)
    """Exact commands approved with ``/approve always`` (kept in the store), bound to no
    one: each approves every turn of a session of one person, and none in a shared
    session (an entry kept before grants were bound may have been anyone's)."""
    approval_allowlist_by_user: tuple[UserGrant, ...] = ()
    """Exact commands approved with ``/approve always`` in a shared session, each for its
    giver's turns only (kept in the store). Replaced, never changed in place."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "run_generation":
            _check_generation(getattr(self, "run_generation", 0), value)
        object.__setattr__(self, name, value)

    def advance_generation(self, generation: int) -> None:
        """Take ``generation`` (a lease's) as ``run_generation``; as assigning it, checked once.

        :raises ValueError: for a generation smaller than the current one.
        """
        if type(generation) is not int:
            _check_generation(self.run_generation, generation)
        elif generation < self.run_generation:
            raise ValueError(
                f"run_generation only grows: cannot go from {self.run_generation} to {generation}"
            )
        object.__setattr__(self, "run_generation", generation)

    def bump_generation(self) -> int:
        """Advance ``run_generation`` by one and return the new value."""
        self.run_generation += 1
        return self.run_generation

    def restart_generation(self, generation: int) -> None:
        """Take ``generation`` from the store that hands generations out, even if it is lower.

        Only for a state a registry just made, before its first turn: its
        ``run_generation`` was the registry's floor, the highest generation of
        *other* sessions it evicted, never one handed out for this session.

        :raises ValueError: for a negative generation.
        """
        _check_generation(0, generation)
        object.__setattr__(self, "run_generation", generation)


def _check_generation(current: int, new: object) -> None:
    if not isinstance(new, int) or isinstance(new, bool):
        raise TypeError(f"run_generation must be an int, not {type(new).__name__}")
    if new < current:
        raise ValueError(f"run_generation only grows: cannot go from {current} to {new}")


@dataclass(slots=True)
class SessionState:
    """Everything one session remembers, grouped by scope; ``last_access`` is a clock reading.

    ``key`` may be left out (``SessionState()`` has
    :data:`~chatlane.identity.NO_SESSION`), as a gateway that keeps its own
    ``{key: state}`` dict does.
    """

    key: SessionKey = NO_SESSION
    turn: TurnState = field(default_factory=TurnState)
    conversation: ConversationState = field(default_factory=ConversationState)
    persistent: PersistentState = field(default_factory=PersistentState)
    last_access: float = 0.0
    loaded: bool = False
    """Whether the persistent scope was read from the store since this state was created."""
    read_at: float = 0.0
    """When (``time.monotonic()``) the stored choices were last read from the store."""
    generation_floor: int = 0
    """The ``run_generation`` the registry made this state with (its floor then)."""

    def touch(self, now: float) -> None:
        """Record an access at clock reading ``now``."""
        self.last_access = now

    @property
    def is_busy(self) -> bool:
        """A turn runs, or a lease or lease token is still held."""
        turn = self.turn
        return turn.is_running or turn.lease is not None or bool(turn.lease_tokens)

    def holds_unsaved_data(self) -> bool:
        """Eviction would lose data: queued messages or a persistent field off its default.

        ``run_generation`` does not count: the registry keeps a generation floor.
        An ``on_evict`` hook may save this data; what only memory keeps is
        :meth:`ConversationState.holds_memory_only_data`.
        """
        if self.conversation.queued_events:
            return True
        persistent = self.persistent
        return any(
            getattr(persistent, f.name) != _field_default(f)
            for f in fields(persistent)
            if f.name != "run_generation"
        )


class Scope(enum.Enum):
    """Where a field is cleared; the value names the attribute of :class:`SessionState`."""

    TURN = "turn"
    CONVERSATION = "conversation"
    PERSISTENT = "persistent"


def reset_scope(state: SessionState, scope: Scope) -> None:
    """Clear one scope of ``state``.

    :raises ValueError: for :attr:`Scope.PERSISTENT`, which is never reset wholesale.
    """
    if scope is Scope.TURN:
        state.turn.clear()
    elif scope is Scope.CONVERSATION:
        state.conversation.clear()
    else:
        raise ValueError("persistent state has per-field lifecycles and is never reset wholesale")


EvictHook = Callable[[SessionKey, SessionState], None]
"""Called with ``(key, state)`` before a session leaves the registry; may persist it."""


def _check_scope_class(name: str, cls: type[Any], base: type[Any]) -> None:
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise ConfigError(f"{name} must be a subclass of {base.__name__}, not {cls!r}")
    for f in fields(cls):
        if f.default is MISSING and f.default_factory is MISSING:
            raise ConfigError(f"{name}: field {f.name!r} needs a default so its scope can reset it")


def _check_limits(max_sessions: int, idle_ttl: float | None) -> None:
    if max_sessions < 1:
        raise ConfigError(f"max_sessions must be at least 1, not {max_sessions}")
    if idle_ttl is not None and idle_ttl <= 0:
        raise ConfigError(f"idle_ttl must be positive seconds or None, not {idle_ttl}")


class SessionRegistry:
    """One :class:`SessionState` per key, created on first :meth:`get`, evicted when idle.

    Eviction keeps memory bounded: at most ``max_sessions`` sessions (least
    recently used go first) and none unused for more than ``idle_ttl`` seconds.
    What stays true:

    * a busy session (:attr:`SessionState.is_busy`) is never evicted;
    * a session holding unsaved data is evicted only when ``on_evict`` is set,
      and only after ``on_evict`` returned (if it raises, the session stays);
    * a session holding what only memory keeps
      (:meth:`ConversationState.holds_memory_only_data`) is passed over for
      ``max_sessions``; only when nothing else can go is the least recently
      used of them evicted, one per new session and logged as a warning, so
      such sessions never hold the registry above ``max_sessions``. Past
      ``idle_ttl`` it is evicted as any idle session: what it held lapses;
    * a session that could not be evicted counts as used now, so the registry
      may hold more than ``max_sessions`` while that many are pinned (busy, or
      holding unsaved data with no ``on_evict``);
    * generations are not reused after eviction: a new session starts at the
      highest ``run_generation`` any evicted session reached.

    :param clock: returns seconds; injectable for tests.
    :raises ConfigError: for a bad limit or a scope class that is not a
        dataclass subclass of the scope with a default for every field.
    """

    def __init__(
        self,
        *,
        turn_cls: type[TurnState] = TurnState,
        conversation_cls: type[ConversationState] = ConversationState,
        persistent_cls: type[PersistentState] = PersistentState,
        max_sessions: int = 10_000,
        idle_ttl: float | None = None,
        on_evict: EvictHook | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        _check_scope_class("turn_cls", turn_cls, TurnState)
        _check_scope_class("conversation_cls", conversation_cls, ConversationState)
        _check_scope_class("persistent_cls", persistent_cls, PersistentState)
        _check_limits(max_sessions, idle_ttl)
        self._classes = (turn_cls, conversation_cls, persistent_cls)
        self._max_sessions = max_sessions
        self._idle_ttl = idle_ttl
        self._on_evict = on_evict
        self._clock = clock
        self._sessions: OrderedDict[SessionKey, SessionState] = OrderedDict()
        self._generation_floor = 0

    def get(self, key: SessionKey) -> SessionState:
        """The state of ``key``, created if needed; counts as an access and may evict others."""
        sessions = self._sessions
        state = sessions.get(key)
        if state is None:
            state = self._create(key)
        now = state.last_access = self._clock()
        sessions.move_to_end(key)
        if self._idle_ttl is not None or len(sessions) > self._max_sessions:
            self._sweep(key, now)
        return state

    def peek(self, key: SessionKey) -> SessionState | None:
        """The state of ``key`` if it exists; neither creates nor counts as an access."""
        return self._sessions.get(key)

    def __contains__(self, key: object) -> bool:
        return key in self._sessions

    def __len__(self) -> int:
        return len(self._sessions)

    def __iter__(self) -> Iterator[SessionKey]:
        """Keys, least recently used first, from a snapshot (safe while sessions change)."""
        return iter(list(self._sessions))

    def items(self) -> list[tuple[SessionKey, SessionState]]:
        """A snapshot of ``(key, state)`` pairs, least recently used first."""
        return list(self._sessions.items())

    @property
    def max_sessions(self) -> int:
        """How many sessions the registry keeps before it evicts idle ones."""
        return self._max_sessions

    @property
    def generation_floor(self) -> int:
        """The highest ``run_generation`` of any evicted session; new sessions start there."""
        return self._generation_floor

    def end_turn(self, key: SessionKey) -> None:
        """Clear the turn scope of ``key`` (lease tokens stay); no-op for an unknown key."""
        self._end(key, Scope.TURN)

    def end_conversation(self, key: SessionKey) -> None:
        """Clear the conversation scope of ``key`` only; no-op for an unknown key.

        The turn scope is left alone: a boundary such as ``/new`` may arrive
        while a turn runs, and that turn ends (and clears) on its own.
        """
        self._end(key, Scope.CONVERSATION)

    def evict_idle(self) -> list[SessionKey]:
        """Evict every evictable session idle for longer than ``idle_ttl``; return their keys."""
        now = self._clock()
        return self._evict_while(self._expired(now), None, now)

    def _end(self, key: SessionKey, scope: Scope) -> None:
        state = self._sessions.get(key)
        if state is not None:
            reset_scope(state, scope)
            self._touch(key, state, self._clock())

    def _create(self, key: SessionKey) -> SessionState:
        turn_cls, conversation_cls, persistent_cls = self._classes
        state = SessionState(key, turn_cls(), conversation_cls(), persistent_cls())
        state.persistent.run_generation = state.generation_floor = self._generation_floor
        self._sessions[key] = state
        return state

    def _touch(self, key: SessionKey, state: SessionState, now: float) -> None:
        state.touch(now)
        self._sessions.move_to_end(key)

    def _sweep(self, keep: SessionKey, now: float) -> None:
        self._evict_while(self._expired(now), keep, now)
        spared: list[tuple[SessionKey, SessionState]] = []
        self._evict_while(self._over_cap, keep, now, spared)
        if spared and self._over_cap():  # nothing else could go: the last resort
            self._evict_spared(*spared[0])

    def _over_cap(self, _: object = None) -> bool:
        return len(self._sessions) > self._max_sessions

    def _expired(self, now: float) -> Callable[[SessionState], bool]:
        ttl = self._idle_ttl
        return lambda state: ttl is not None and now - state.last_access > ttl

    def _evict_while(
        self,
        wanted: Callable[[SessionState], bool],
        keep: SessionKey | None,
        now: float,
        spared: list[tuple[SessionKey, SessionState]] | None = None,
    ) -> list[SessionKey]:
        """Walk sessions oldest first while ``wanted(oldest)``; each is evicted or refreshed.

        With ``spared``, a session holding what only memory keeps is refreshed
        too, and added to it (least recently used first) instead of evicted.
        """
        evicted: list[SessionKey] = []
        for _ in range(len(self._sessions)):
            key, state = next(iter(self._sessions.items()))
            if key == keep or not wanted(state):
                break
            if not self._can_evict(state):
                self._touch(key, state, now)
            elif spared is not None and state.conversation.holds_memory_only_data():
                spared.append((key, state))
                self._touch(key, state, now)
            else:
                self._evict(key, state)
                evicted.append(key)
        return evicted

    def _evict_spared(self, key: SessionKey, state: SessionState) -> None:
        """Evict ``key`` although it holds what only memory keeps: nothing else could go."""
        self._evict(key, state)
        log.warning(
            "evicted a session holding a /model --once, /approve session grants or a "
            "confirmation, now lost: no other of the %d sessions kept could go",
            self._max_sessions,
            extra=turn_fields(key),
        )

    def _can_evict(self, state: SessionState) -> bool:
        if state.is_busy:
            return False
        return self._on_evict is not None or not state.holds_unsaved_data()

    def _evict(self, key: SessionKey, state: SessionState) -> None:
        if self._on_evict is not None:
            self._on_evict(key, state)
        del self._sessions[key]
        self._generation_floor = max(self._generation_floor, state.persistent.run_generation)
