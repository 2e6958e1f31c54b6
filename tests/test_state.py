"""Lifecycle-scoped state: scope clears, lease tokens, generations, the registry and eviction."""

from __future__ import annotations

import copy
import pickle
import sys
from dataclasses import dataclass, field, fields
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from chatlane.errors import ConfigError, LeaseError
from chatlane.identity import SessionKey
from chatlane.runtime import pending
from chatlane.state import (
    AGENT_PENDING,
    SERVICE_TIER_UNSET,
    ConversationState,
    EvictHook,
    PersistentState,
    Scope,
    SessionRegistry,
    SessionState,
    SlotPhase,
    TurnState,
    UserGrant,
    _reset_fields,
    default_value,
    reset_field,
    reset_scope,
)


@dataclass(slots=True)
class MyTurn(TurnState):
    progress: list[str] = field(default_factory=list)


@dataclass(slots=True)
class MyConversation(ConversationState):
    topic: str = ""
    tags: set[str] = field(default_factory=set)


@dataclass(slots=True)
class MyPersistent(PersistentState):
    karma: int = 0


A, B, C = SessionKey("a"), SessionKey("b"), SessionKey("c")
"""Three sessions' keys (the registry never reads what a key says)."""


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def dirty_turn(turn: TurnState) -> None:
    turn.agent, turn.lease = "agent", "lease"
    turn.approval_requests["a1"] = "request"
    turn.started_ts = turn.busy_ack_ts = 5.0
    turn.store_lease_token(1, "token-1")


def dirty_conversation(conv: ConversationState) -> None:
    for f in fields(conv):
        setattr(conv, f.name, {"marker": f.name})


class TestSentinels:
    def test_distinct_from_none_and_each_other(self) -> None:
        assert AGENT_PENDING is not None
        assert SERVICE_TIER_UNSET is not None
        assert len({AGENT_PENDING, SERVICE_TIER_UNSET, None}) == 3

    def test_survive_copy_and_pickle(self) -> None:
        assert copy.deepcopy(AGENT_PENDING) is AGENT_PENDING
        assert pickle.loads(pickle.dumps(SERVICE_TIER_UNSET)) is SERVICE_TIER_UNSET


class TestTurnState:
    def test_defaults_mean_idle(self) -> None:
        turn = TurnState()
        assert turn.agent is None
        assert turn.started_ts == 0.0
        assert turn.busy_ack_ts == 0.0
        assert not turn.is_running

    @pytest.mark.parametrize(
        ("phase", "started"),
        [
            (SlotPhase.CLAIMED, 0.0),
            (SlotPhase.COLLECTING, 0.0),
            (SlotPhase.RUNNING, 0.0),
            (SlotPhase.IDLE, 3.0),
        ],
    )
    def test_running_while_claimed_collecting_running_or_started(
        self, phase: SlotPhase, started: float
    ) -> None:
        assert TurnState(phase=phase, started_ts=started).is_running

    def test_the_slot_moves_claimed_running_idle(self) -> None:
        slot, turn, other = TurnState(), object(), object()
        slot.claim(turn, 5.0)  # type: ignore[arg-type]
        assert (slot.phase, slot.agent, slot.started_ts) == (SlotPhase.CLAIMED, AGENT_PENDING, 5.0)
        assert slot.holds(turn)
        assert not slot.holds(other)
        assert not slot.holds(None)
        slot.run(other)  # type: ignore[arg-type]
        assert slot.phase is SlotPhase.CLAIMED  # only the claiming turn runs
        slot.run(turn)  # type: ignore[arg-type]
        assert (slot.phase, slot.agent) == (SlotPhase.RUNNING, turn)
        slot.clear()
        assert (slot.phase, slot.current, slot.agent) == (SlotPhase.IDLE, None, None)
        slot.collect(6.0)
        assert (slot.phase, slot.agent, slot.is_running) == (
            SlotPhase.COLLECTING,
            AGENT_PENDING,
            True,
        )

    def test_the_legacy_agent_name_moves_the_slot_too(self) -> None:
        slot = TurnState()
        slot.agent = AGENT_PENDING
        assert slot.phase is SlotPhase.CLAIMED
        slot.agent = "an agent of the old runner"
        assert (slot.phase, slot.agent) == (SlotPhase.RUNNING, "an agent of the old runner")
        slot.agent = None
        assert (slot.phase, slot.agent, slot.legacy_agent) == (SlotPhase.IDLE, None, None)

    def test_clear_resets_every_field_but_lease_tokens(self) -> None:
        turn = TurnState()
        dirty_turn(turn)
        turn.clear()
        assert turn == TurnState(lease_tokens={1: "token-1"})

    def test_clear_resets_subclass_fields(self) -> None:
        turn = MyTurn()
        turn.progress.append("x")
        turn.clear()
        assert turn.progress == []

    def test_clear_of_a_plain_slot_matches_the_walk_over_its_fields(self) -> None:
        walked = TurnState()
        dirty_turn(walked)
        cleared = copy.deepcopy(walked)
        _reset_fields(walked, keep=frozenset({"lease_tokens"}))  # what a subclass gets
        cleared.clear()
        assert cleared == walked
        assert [f.name for f in fields(TurnState)] == [
            "phase",
            "current",
            "started_ts",
            "lease",
            "busy_ack_ts",
            "lease_tokens",
            "approval_requests",
            "legacy_agent",
        ], "a new TurnState field must be reset by TurnState.clear too"

    def test_clear_gives_a_fresh_dict_for_waiting_approval_requests(self) -> None:
        turn = TurnState()
        requests = turn.approval_requests
        requests["r1"] = "a request"
        turn.clear()
        assert turn.approval_requests == {}
        assert requests == {"r1": "a request"}  # what held the old one keeps it


class TestLeaseTokens:
    def test_release_exactly_once(self) -> None:
        turn = TurnState()
        turn.store_lease_token(3, "t3")
        assert turn.release_lease_token(3) == "t3"
        assert turn.release_lease_token(3) is None

    def test_displaced_turn_frees_only_its_own_token(self) -> None:
        turn = TurnState()
        turn.store_lease_token(1, "old")
        turn.store_lease_token(2, "new")
        turn.clear()  # the displaced turn unwinds
        assert turn.release_lease_token(1) == "old"
        assert turn.lease_tokens == {2: "new"}

    def test_storing_the_same_token_twice_is_idempotent(self) -> None:
        turn = TurnState()
        turn.store_lease_token(1, "t")
        turn.store_lease_token(1, "t")
        assert turn.lease_tokens == {1: "t"}

    def test_a_second_token_for_one_generation_is_refused(self) -> None:
        turn = TurnState()
        turn.store_lease_token(1, "t")
        with pytest.raises(LeaseError):
            turn.store_lease_token(1, "other")
        assert turn.lease_tokens == {1: "t"}

    def test_the_last_token_out_frees_the_dicts_table(self) -> None:
        turn = TurnState()
        empty = sys.getsizeof(turn.lease_tokens)
        tokens = turn.lease_tokens
        turn.store_lease_token(1, "t")
        turn.release_lease_token(1)
        assert turn.lease_tokens is tokens
        assert sys.getsizeof(turn.lease_tokens) == empty


class TestConversationState:
    def test_defaults(self) -> None:
        conv = ConversationState()
        assert conv.service_tier_override is SERVICE_TIER_UNSET
        assert conv.last_resolved_model == ""
        assert conv.queued_events == []
        assert conv.sidecar_notes == []

    def test_clear_resets_every_field(self) -> None:
        conv = ConversationState()
        dirty_conversation(conv)
        conv.clear()
        assert conv == ConversationState()

    def test_clear_gives_fresh_lists(self) -> None:
        conv = ConversationState()
        old = conv.queued_events
        old.append("event")
        conv.clear()
        assert conv.queued_events == []
        assert conv.queued_events is not old

    def test_clear_resets_subclass_fields(self) -> None:
        conv = MyConversation(topic="cats", tags={"a"})
        conv.model_override = "m"
        conv.clear()
        assert conv == MyConversation()

    def test_explicit_normal_tier_is_kept_until_clear(self) -> None:
        conv = ConversationState(service_tier_override=None)
        assert conv.service_tier_override is None
        conv.clear()
        assert conv.service_tier_override is SERVICE_TIER_UNSET


class TestPersistentState:
    def test_has_no_wholesale_clear(self) -> None:
        assert not hasattr(PersistentState(), "clear")

    def test_bump_generation(self) -> None:
        persistent = PersistentState()
        assert persistent.bump_generation() == 1
        assert persistent.bump_generation() == 2
        assert persistent.run_generation == 2

    def test_generation_only_grows(self) -> None:
        persistent = PersistentState(run_generation=5)
        persistent.run_generation = 5
        persistent.run_generation = 9
        with pytest.raises(ValueError, match="only grows"):
            persistent.run_generation = 8
        with pytest.raises(ValueError, match="only grows"):
            persistent.run_generation -= 1
        assert persistent.run_generation == 9

    def test_advancing_the_generation_is_checked_as_assigning_it(self) -> None:
        persistent = PersistentState(run_generation=3)
        persistent.advance_generation(3)
        persistent.advance_generation(5)
        assert persistent.run_generation == 5
        with pytest.raises(ValueError, match="only grows"):
            persistent.advance_generation(4)
        with pytest.raises(TypeError):
            persistent.advance_generation(True)
        assert persistent.run_generation == 5

    def test_reset_field_cannot_lower_the_generation(self) -> None:
        persistent = PersistentState(run_generation=1)
        with pytest.raises(ValueError, match="only grows"):
            reset_field(persistent, "run_generation")

    def test_restart_takes_the_stores_generation_even_if_lower(self) -> None:
        persistent = PersistentState(run_generation=7)
        persistent.restart_generation(3)
        assert persistent.run_generation == 3
        with pytest.raises(ValueError, match="only grows"):
            persistent.restart_generation(-1)
        with pytest.raises(ValueError, match="only grows"):
            persistent.run_generation = 2

    def test_generation_cannot_start_negative(self) -> None:
        with pytest.raises(ValueError, match="only grows"):
            PersistentState(run_generation=-1)

    @pytest.mark.parametrize("value", [1.5, "3", True])
    def test_generation_must_be_an_int(self, value: Any) -> None:
        with pytest.raises(TypeError):
            PersistentState().run_generation = value

    def test_subclass_keeps_the_guard(self) -> None:
        persistent = MyPersistent(run_generation=2, karma=1)
        with pytest.raises(ValueError, match="only grows"):
            persistent.run_generation = 1


class TestFieldHelpers:
    def test_default_value_is_fresh(self) -> None:
        assert default_value(ConversationState, "queued_events") == []
        first = default_value(ConversationState(), "queued_events")
        assert first is not default_value(ConversationState(), "queued_events")

    def test_default_value_unknown_field(self) -> None:
        with pytest.raises(AttributeError):
            default_value(TurnState, "nope")

    def test_reset_field(self) -> None:
        conv = ConversationState(model_override="m", last_resolved_model="x")
        reset_field(conv, "model_override")
        assert conv.model_override is None
        assert conv.last_resolved_model == "x"


class TestResetScope:
    def test_turn_scope_only(self) -> None:
        state = SessionState()
        dirty_turn(state.turn)
        state.conversation.model_override = "m"
        reset_scope(state, Scope.TURN)
        assert not state.turn.is_running
        assert state.conversation.model_override == "m"

    def test_conversation_scope_only(self) -> None:
        state = SessionState()
        dirty_conversation(state.conversation)
        state.turn.agent = "agent"
        state.persistent.busy_policy = "a"
        reset_scope(state, Scope.CONVERSATION)
        assert state.conversation == ConversationState()
        assert state.turn.agent == "agent"
        assert state.persistent.busy_policy == "a"

    def test_persistent_scope_is_never_reset_wholesale(self) -> None:
        state = SessionState(persistent=PersistentState(busy_policy="a"))
        with pytest.raises(ValueError, match="never reset wholesale"):
            reset_scope(state, Scope.PERSISTENT)
        assert state.persistent.busy_policy == "a"


class TestSessionState:
    def test_busy_while_running_or_holding_a_lease(self) -> None:
        assert not SessionState().is_busy
        assert SessionState(turn=TurnState(phase=SlotPhase.CLAIMED)).is_busy
        assert SessionState(turn=TurnState(lease="l")).is_busy
        assert SessionState(turn=TurnState(lease_tokens={1: "t"})).is_busy

    @pytest.mark.parametrize(
        "persistent",
        [
            PersistentState(busy_policy="a"),
            PersistentState(update_prompt_pending=True),
            PersistentState(native_image_paths=["/x.png"]),
            PersistentState(approval_allowlist=["ls"]),
            PersistentState(approval_allowlist_by_user=(UserGrant("alice", "ls"),)),
            PersistentState(hygiene_failure_streak=2),
            MyPersistent(karma=1),
        ],
    )
    def test_unsaved_persistent_data(self, persistent: PersistentState) -> None:
        assert SessionState(persistent=persistent).holds_unsaved_data()

    def test_queued_events_are_unsaved_data(self) -> None:
        state = SessionState()
        state.conversation.queued_events.append("e")
        assert state.holds_unsaved_data()

    def test_generation_and_conversation_choices_are_not_unsaved_data(self) -> None:
        state = SessionState(persistent=PersistentState(run_generation=7))
        state.conversation.model_override = "m"
        assert not state.holds_unsaved_data()

    @pytest.mark.parametrize(
        "held",
        [
            {"one_turn_restore": {"model_override": None}},
            {"approval_grants": ["ls"]},
            {"approval_grants_by_user": (UserGrant("alice", "ls"),)},
            {"pending_command_text": "/new confirm"},
        ],
    )
    def test_what_only_memory_keeps(self, held: dict[str, Any]) -> None:
        assert ConversationState(**held).holds_memory_only_data()

    def test_stored_choices_are_not_what_only_memory_keeps(self) -> None:
        conversation = ConversationState(model_override="m", reasoning_override="high")
        assert not conversation.holds_memory_only_data()


class TestFootprint:
    """What a session holds of its own: a registry keeps many thousands resident."""

    OWNED = frozenset(
        {
            "turn.lease_tokens",
            "turn.approval_requests",
            "conversation.queued_events",
            "conversation.sidecar_notes",
            "conversation.approval_grants",
            "conversation.overheard",
            "persistent.native_image_paths",
            "persistent.approval_allowlist",
        }
    )
    """The fields whose default is a container of each session's own (filled in place)."""

    def test_a_fresh_session_owns_only_the_containers_it_fills_in_place(self) -> None:
        """A field added with a container of its own (an empty ``set`` costs 216 bytes
        a session) fails here: share an immutable default, or add it above with reason."""
        one, other = SessionState(), SessionState()
        owned = {
            f"{scope}.{name}"
            for scope in ("turn", "conversation", "persistent")
            for name in type(getattr(one, scope)).__slots__
            if _owned(getattr(getattr(one, scope), name), getattr(getattr(other, scope), name))
        }
        assert owned == self.OWNED

    def test_kept_seqs_are_shared_until_some_are_kept(self) -> None:
        one, other = SessionState(), SessionState()
        assert one.conversation.kept_seqs is other.conversation.kept_seqs
        pending.kept_after_drop(one, [3, 5], unsure=True)
        assert one.conversation.kept_seqs == {3, 5}
        assert other.conversation.kept_seqs == frozenset()
        one.conversation.clear()
        assert one.conversation.kept_seqs is other.conversation.kept_seqs


def _owned(value: object, fresh: object) -> bool:
    """Whether ``value`` is a container that another fresh session does not share."""
    return isinstance(value, list | dict | set | bytearray) and value is not fresh


class TestRegistryBasics:
    def test_get_creates_once(self) -> None:
        registry = SessionRegistry()
        state = registry.get(A)
        assert state.key == A
        assert registry.get(A) is state
        assert A in registry
        assert len(registry) == 1

    def test_peek_does_not_create(self) -> None:
        registry = SessionRegistry()
        assert registry.peek(A) is None
        assert A not in registry
        assert len(registry) == 0

    def test_iteration_and_items(self) -> None:
        registry = SessionRegistry()
        a, b = registry.get(A), registry.get(B)
        assert list(registry) == [A, B]
        assert registry.items() == [(A, a), (B, b)]

    def test_iteration_is_a_snapshot(self) -> None:
        registry = SessionRegistry()
        registry.get(A)
        for key in registry:
            registry.get(SessionKey(key + "x"))
        assert list(registry) == [A, SessionKey("ax")]

    def test_uses_the_given_scope_classes(self) -> None:
        registry = SessionRegistry(
            turn_cls=MyTurn, conversation_cls=MyConversation, persistent_cls=MyPersistent
        )
        state = registry.get(A)
        assert isinstance(state.turn, MyTurn)
        assert isinstance(state.conversation, MyConversation)
        assert isinstance(state.persistent, MyPersistent)

    def test_end_turn_clears_turn_scope_only(self) -> None:
        registry = SessionRegistry()
        state = registry.get(A)
        dirty_turn(state.turn)
        state.conversation.model_override = "m"
        registry.end_turn(A)
        assert state.turn == TurnState(lease_tokens={1: "token-1"})
        assert state.conversation.model_override == "m"

    def test_end_conversation_clears_conversation_scope_only(self) -> None:
        registry = SessionRegistry(conversation_cls=MyConversation)
        state = registry.get(A)
        assert isinstance(state.conversation, MyConversation)
        state.conversation.topic = "cats"
        state.turn.agent = "agent"
        registry.end_conversation(A)
        assert state.conversation == MyConversation()
        assert state.turn.agent == "agent"

    def test_end_on_unknown_key_creates_nothing(self) -> None:
        registry = SessionRegistry()
        registry.end_turn(A)
        registry.end_conversation(A)
        assert len(registry) == 0


class TestRegistryConfig:
    @pytest.mark.parametrize(
        "kwargs",
        [
            {"max_sessions": 0},
            {"idle_ttl": 0},
            {"idle_ttl": -1.0},
            {"turn_cls": ConversationState},
            {"persistent_cls": dict},
        ],
    )
    def test_bad_settings(self, kwargs: dict[str, Any]) -> None:
        with pytest.raises(ConfigError):
            SessionRegistry(**kwargs)

    def test_field_without_default_is_refused(self) -> None:
        @dataclass(slots=True, kw_only=True)
        class Needy(ConversationState):
            required: str

        with pytest.raises(ConfigError, match="required"):
            SessionRegistry(conversation_cls=Needy)


class TestEvictionByCap:
    def test_least_recently_used_goes_first(self) -> None:
        registry = SessionRegistry(max_sessions=2)
        registry.get(A)
        registry.get(B)
        registry.get(A)
        registry.get(C)
        assert list(registry) == [A, C]

    def test_peek_is_not_an_access(self) -> None:
        registry = SessionRegistry(max_sessions=2)
        registry.get(A)
        registry.get(B)
        registry.peek(A)
        registry.get(C)
        assert list(registry) == [B, C]

    def test_running_session_is_never_evicted(self) -> None:
        registry = SessionRegistry(max_sessions=1)
        registry.get(A).turn.agent = AGENT_PENDING
        registry.get(B)
        assert A in registry
        assert B in registry

    def test_registry_shrinks_back_once_the_turn_ends(self) -> None:
        registry = SessionRegistry(max_sessions=1)
        registry.get(A).turn.started_ts = 1.0
        registry.get(B)
        registry.end_turn(A)
        registry.get(C)
        assert list(registry) == [C]

    def test_unsaved_data_is_kept_without_a_hook(self) -> None:
        registry = SessionRegistry(max_sessions=1)
        registry.get(A).persistent.busy_policy = "pending"
        registry.get(B)
        assert A in registry

    @pytest.mark.parametrize("hook", [None, lambda key, state: None])
    def test_a_session_holding_what_only_memory_keeps_is_passed_over(
        self, hook: EvictHook | None
    ) -> None:
        registry = SessionRegistry(max_sessions=2, on_evict=hook)
        registry.get(A).conversation.approval_grants.append("make deploy")
        registry.get(B)
        registry.get(C)
        assert set(registry) == {A, C}  # A was passed over: it counts as used now
        assert registry.get(A).conversation.approval_grants == ["make deploy"]

    def test_sessions_holding_what_only_memory_keeps_still_leave_at_the_cap(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        """When nothing else can go, the least recently used of them goes, with a warning."""
        registry = SessionRegistry(max_sessions=2)
        for key in (A, B):
            registry.get(key).conversation.pending_command_text = "/new confirm"
        registry.get(C)
        assert set(registry) == {B, C}
        assert "evicted a session holding a /model --once" in caplog.text

    @given(
        st.lists(
            st.tuples(st.sampled_from("abcdefgh").map(SessionKey), st.booleans()), max_size=40
        ),
        st.integers(1, 4),
    )
    def test_never_exceeds_the_cap_however_many_hold_what_only_memory_keeps(
        self, steps: list[tuple[SessionKey, bool]], cap: int
    ) -> None:
        registry = SessionRegistry(max_sessions=cap)
        for key, holds in steps:
            registry.get(key).conversation.approval_grants = ["ls"] if holds else []
            assert len(registry) <= cap
            assert key in registry

    def test_on_evict_sees_the_state_before_removal(self) -> None:
        seen: list[tuple[str, Any, bool]] = []

        def on_evict(key: str, state: SessionState) -> None:
            seen.append((key, state.persistent.busy_policy, key in registry))

        registry = SessionRegistry(max_sessions=1, on_evict=on_evict)
        registry.get(A).persistent.busy_policy = "pending"
        registry.get(B)
        assert seen == [(A, "pending", True)]
        assert list(registry) == [B]

    def test_failing_hook_keeps_the_session(self) -> None:
        def on_evict(key: str, state: SessionState) -> None:
            raise OSError("store down")

        registry = SessionRegistry(max_sessions=1, on_evict=on_evict)
        registry.get(A)
        with pytest.raises(OSError, match="store down"):
            registry.get(B)
        assert A in registry

    def test_generation_is_not_reused_after_eviction(self) -> None:
        registry = SessionRegistry(max_sessions=1)
        registry.get(A).persistent.run_generation = 7
        registry.get(B)
        assert A not in registry
        assert registry.generation_floor == 7
        state = registry.get(A)
        assert state.persistent.run_generation == state.generation_floor == 7

    @given(st.lists(st.sampled_from("abcdefgh").map(SessionKey), max_size=40), st.integers(1, 4))
    def test_never_exceeds_the_cap_when_nothing_is_pinned(
        self, keys: list[SessionKey], cap: int
    ) -> None:
        registry = SessionRegistry(max_sessions=cap)
        for key in keys:
            registry.get(key)
            assert len(registry) <= cap
            assert list(registry)[-1] == key


class TestEvictionByIdleTime:
    def test_idle_session_is_evicted_on_next_access(self) -> None:
        clock = FakeClock()
        registry = SessionRegistry(idle_ttl=60, clock=clock)
        registry.get(A)
        clock.now += 61
        registry.get(B)
        assert list(registry) == [B]

    def test_access_within_ttl_keeps_it(self) -> None:
        clock = FakeClock()
        registry = SessionRegistry(idle_ttl=60, clock=clock)
        registry.get(A)
        clock.now += 59
        registry.get(A)
        clock.now += 59
        assert registry.evict_idle() == []
        assert A in registry

    def test_accessed_key_survives_its_own_expiry(self) -> None:
        clock = FakeClock()
        registry = SessionRegistry(idle_ttl=60, clock=clock)
        state = registry.get(A)
        clock.now += 100
        assert registry.get(A) is state

    def test_evict_idle_returns_keys_and_spares_running_sessions(self) -> None:
        clock = FakeClock()
        evicted: list[str] = []
        registry = SessionRegistry(
            idle_ttl=60, clock=clock, on_evict=lambda key, _: evicted.append(key)
        )
        registry.get(A)
        registry.get(B).turn.agent = "agent"
        registry.get(C)
        clock.now += 61
        assert registry.evict_idle() == [A, C]
        assert evicted == [A, C]
        assert list(registry) == [B]

    def test_spared_session_counts_as_used_now(self) -> None:
        clock = FakeClock()
        registry = SessionRegistry(idle_ttl=60, clock=clock)
        registry.get(A).turn.agent = "agent"
        clock.now += 61
        registry.evict_idle()
        assert registry.get(A).turn.agent == "agent"
        registry.end_turn(A)
        clock.now += 30
        assert registry.evict_idle() == []
        clock.now += 31
        assert registry.evict_idle() == [A]

    def test_what_only_memory_keeps_lapses_with_an_idle_session(self) -> None:
        clock = FakeClock()
        registry = SessionRegistry(idle_ttl=60, clock=clock)
        registry.get(A).conversation.one_turn_restore = {"model_override": None}
        clock.now += 61
        assert registry.evict_idle() == [A]

    def test_without_ttl_nothing_expires(self) -> None:
        clock = FakeClock()
        registry = SessionRegistry(clock=clock)
        registry.get(A)
        clock.now += 10**9
        assert registry.evict_idle() == []
