"""Legacy dict views: every name round-trips, presence rules, dict semantics, the setter."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from chatlane.errors import ConfigError
from chatlane.identity import SessionKey
from chatlane.legacy import (
    LEGACY_FIELD_SPECS,
    LegacyFieldView,
    LegacyProperty,
    LegacyView,
    Presence,
    is_present,
    legacy_dict_property,
    legacy_lease_token_property,
    presence_for,
)
from chatlane.state import (
    SERVICE_TIER_UNSET,
    ConversationState,
    PersistentState,
    Scope,
    SessionRegistry,
    SessionState,
    TurnState,
)

NAMES = sorted(LEGACY_FIELD_SPECS)

SAMPLES: dict[str, Any] = {
    "_running_agents": "agent",
    "_running_agents_ts": 12.5,
    "_active_session_leases": "lease",
    "_busy_ack_ts": 3.0,
    "_session_model_overrides": {"model": "m"},
    "_pending_one_turn_model_restores": {"model": "old"},
    "_session_reasoning_overrides": "high",
    "_session_service_tier_overrides": "priority",
    "_last_resolved_model": "gpt-x",
    "_queued_events": ["e1"],
    "_pending_turn_sidecar_notes": ["note"],
    "_session_ephemeral_pin": "pin",
    "_session_vc_last": ("vc", 1),
    "_pending_approvals": {"id": 1},
    "_update_prompt_pending": True,
    "_pending_native_image_paths_by_session": ["/a.png"],
    "_pending_messages": "/model x",
    "_session_run_generation": 3,
}

# Values that are absent under each name's presence rule.
ABSENT: dict[str, Any] = {
    "_running_agents_ts": 0.0,
    "_busy_ack_ts": 0.0,
    "_last_resolved_model": "",
    "_queued_events": [],
    "_pending_turn_sidecar_notes": [],
    "_update_prompt_pending": False,
    "_pending_native_image_paths_by_session": [],
    "_session_run_generation": 0,
    "_session_service_tier_overrides": SERVICE_TIER_UNSET,
}


class Runner:
    _running_agents = legacy_dict_property("_running_agents")
    _running_agents_ts = legacy_dict_property("_running_agents_ts")
    _active_session_leases = legacy_dict_property("_active_session_leases")
    _busy_ack_ts = legacy_dict_property("_busy_ack_ts")
    _session_model_overrides = legacy_dict_property("_session_model_overrides")
    _pending_one_turn_model_restores = legacy_dict_property("_pending_one_turn_model_restores")
    _session_reasoning_overrides = legacy_dict_property("_session_reasoning_overrides")
    _session_service_tier_overrides = legacy_dict_property("_session_service_tier_overrides")
    _last_resolved_model = legacy_dict_property("_last_resolved_model")
    _queued_events = legacy_dict_property("_queued_events")
    _pending_turn_sidecar_notes = legacy_dict_property("_pending_turn_sidecar_notes")
    _session_ephemeral_pin = legacy_dict_property("_session_ephemeral_pin")
    _session_vc_last = legacy_dict_property("_session_vc_last")
    _pending_approvals = legacy_dict_property("_pending_approvals")
    _update_prompt_pending = legacy_dict_property("_update_prompt_pending")
    _pending_native_image_paths_by_session = legacy_dict_property(
        "_pending_native_image_paths_by_session"
    )
    _pending_messages = legacy_dict_property("_pending_messages")
    _session_run_generation = legacy_dict_property("_session_run_generation")
    _turn_lease_tokens = legacy_lease_token_property()

    def __init__(self) -> None:
        self._sessions = SessionRegistry()

    def _session_state(self, key: str) -> SessionState:
        return self._sessions.get(SessionKey(key))  # a legacy runner's keys are its own


def view(runner: Runner, name: str) -> LegacyView[str]:
    got = getattr(runner, name)
    assert isinstance(got, LegacyFieldView)
    return got


def state_of(runner: Runner, key: str) -> SessionState:
    """The session the runner's views write ``key`` to."""
    return runner._sessions.get(SessionKey(key))


def field_of(state: SessionState, name: str) -> Any:
    spec = LEGACY_FIELD_SPECS[name]
    return getattr(getattr(state, spec.scope.value), spec.field)


class TestSpecs:
    def test_eighteen_names(self) -> None:
        assert len(LEGACY_FIELD_SPECS) == 18
        assert set(SAMPLES) == set(LEGACY_FIELD_SPECS)

    @pytest.mark.parametrize("name", NAMES)
    def test_spec_names_a_real_field_with_its_default(self, name: str) -> None:
        spec = LEGACY_FIELD_SPECS[name]
        scope = getattr(SessionState(), spec.scope.value)
        assert spec.name == name
        assert getattr(scope, spec.field) == spec.default
        assert spec.presence is presence_for(spec.default)

    def test_presence_rules(self) -> None:
        presence = {name: spec.presence for name, spec in LEGACY_FIELD_SPECS.items()}
        assert presence["_session_service_tier_overrides"] is Presence.NOT_UNSET
        assert presence["_running_agents"] is Presence.NOT_NONE
        assert presence["_pending_messages"] is Presence.NOT_NONE
        assert presence["_running_agents_ts"] is Presence.TRUTHY
        assert presence["_session_run_generation"] is Presence.TRUTHY

    def test_scopes(self) -> None:
        assert LEGACY_FIELD_SPECS["_busy_ack_ts"].scope is Scope.TURN
        assert LEGACY_FIELD_SPECS["_session_vc_last"].scope is Scope.CONVERSATION
        assert LEGACY_FIELD_SPECS["_pending_approvals"].scope is Scope.TURN

    def test_specs_are_read_only(self) -> None:
        with pytest.raises(TypeError):
            LEGACY_FIELD_SPECS["x"] = LEGACY_FIELD_SPECS["_running_agents"]  # type: ignore[index]

    def test_unknown_name(self) -> None:
        with pytest.raises(ConfigError, match="_no_such_dict"):
            legacy_dict_property("_no_such_dict")


class TestRoundTrip:
    @pytest.mark.parametrize("name", NAMES)
    def test_view_writes_the_field(self, name: str) -> None:
        runner = Runner()
        view(runner, name)["k"] = SAMPLES[name]
        assert field_of(state_of(runner, "k"), name) == SAMPLES[name]
        assert view(runner, name) == {"k": SAMPLES[name]}

    @pytest.mark.parametrize("name", NAMES)
    def test_field_shows_in_the_view(self, name: str) -> None:
        runner = Runner()
        spec = LEGACY_FIELD_SPECS[name]
        setattr(getattr(state_of(runner, "k"), spec.scope.value), spec.field, SAMPLES[name])
        assert view(runner, name)["k"] == SAMPLES[name]
        assert "k" in view(runner, name)
        assert list(view(runner, name)) == ["k"]

    @pytest.mark.parametrize("name", [n for n in NAMES if n != "_session_run_generation"])
    def test_del_resets_to_default(self, name: str) -> None:
        runner = Runner()
        view(runner, name)["k"] = SAMPLES[name]
        del view(runner, name)["k"]
        assert field_of(state_of(runner, "k"), name) == LEGACY_FIELD_SPECS[name].default
        assert "k" not in view(runner, name)

    def test_example_from_the_spec(self) -> None:
        runner = Runner()
        runner._running_agents["k"] = "agent"
        assert state_of(runner, "k").turn.agent == "agent"
        runner._running_agents = {}
        assert state_of(runner, "k").turn.agent is None


class TestPresence:
    @pytest.mark.parametrize("name", sorted(ABSENT))
    def test_typed_default_absent_when_falsy(self, name: str) -> None:
        runner = Runner()
        state_of(runner, "k")
        view(runner, name)["k"] = ABSENT[name]
        assert "k" not in view(runner, name)
        assert len(view(runner, name)) == 0

    @pytest.mark.parametrize("value", ["", 0, False, []])
    def test_none_default_present_when_falsy_but_not_none(self, value: Any) -> None:
        runner = Runner()
        runner._session_model_overrides["k"] = value
        assert runner._session_model_overrides == {"k": value}
        runner._session_model_overrides["k"] = None
        assert runner._session_model_overrides == {}

    def test_service_tier_none_is_present_and_sentinel_is_absent(self) -> None:
        runner = Runner()
        runner._session_service_tier_overrides["k"] = None
        assert runner._session_service_tier_overrides["k"] is None
        assert state_of(runner, "k").conversation.service_tier_override is None
        runner._session_service_tier_overrides["k"] = SERVICE_TIER_UNSET
        assert "k" not in runner._session_service_tier_overrides

    def test_is_present(self) -> None:
        assert is_present(Presence.NOT_UNSET, None)
        assert not is_present(Presence.NOT_UNSET, SERVICE_TIER_UNSET)
        assert is_present(Presence.NOT_NONE, 0)
        assert not is_present(Presence.TRUTHY, 0.0)


class TestDictSemantics:
    def test_absent_read_raises_key_error_and_creates_nothing(self) -> None:
        runner = Runner()
        with pytest.raises(KeyError):
            runner._running_agents["k"]
        assert runner._running_agents.get("k") is None
        assert "k" not in runner._sessions

    def test_del_absent_raises_key_error(self) -> None:
        runner = Runner()
        state_of(runner, "k")
        with pytest.raises(KeyError):
            del runner._running_agents["k"]
        with pytest.raises(KeyError):
            del runner._running_agents["unknown"]

    def test_setting_creates_the_session(self) -> None:
        runner = Runner()
        runner._busy_ack_ts["k"] = 1.0
        assert "k" in runner._sessions

    def test_setdefault_on_an_existing_session(self) -> None:
        runner = Runner()
        state_of(runner, "k")
        runner._pending_native_image_paths_by_session.setdefault("k", []).append("/a.png")
        assert runner._pending_native_image_paths_by_session == {"k": ["/a.png"]}

    def test_equality_with_plain_dicts(self) -> None:
        runner = Runner()
        runner._session_model_overrides["a"] = "m1"
        runner._session_model_overrides["b"] = "m2"
        assert runner._session_model_overrides == {"a": "m1", "b": "m2"}
        assert runner._session_model_overrides != {"a": "m1"}
        assert runner._session_model_overrides != {"a": "m1", "b": "other"}
        assert dict(runner._session_model_overrides) == {"a": "m1", "b": "m2"}

    def test_copy_and_union_give_plain_dicts_as_dicts_did(self) -> None:
        runner = Runner()
        runner._session_model_overrides["a"] = "m1"
        snapshot = runner._session_model_overrides.copy()
        merged = runner._session_model_overrides | {"b": "m2"}
        reversed_merge = {"a": "old", "c": "m3"} | runner._session_model_overrides
        assert (type(snapshot), snapshot) == (dict, {"a": "m1"})
        assert (type(merged), merged) == (dict, {"a": "m1", "b": "m2"})
        assert reversed_merge == {"a": "m1", "c": "m3"}
        assert runner._session_model_overrides == {"a": "m1"}  # unchanged by | and copy
        snapshot["a"] = "changed"
        assert runner._session_model_overrides["a"] == "m1"
        view = runner._session_model_overrides
        view |= {"b": "m2"}
        assert state_of(runner, "b").conversation.model_override == "m2"

    def test_len_iter_in_follow_presence(self) -> None:
        runner = Runner()
        runner._running_agents["a"] = "agent"
        state_of(runner, "b")
        assert len(runner._running_agents) == 1
        assert list(runner._running_agents) == ["a"]
        assert "b" not in runner._running_agents

    def test_setdefault_append_pattern(self) -> None:
        runner = Runner()
        runner._queued_events.setdefault("k", []).append("e1")
        runner._queued_events.setdefault("k", []).append("e2")
        assert state_of(runner, "k").conversation.queued_events == ["e1", "e2"]

    def test_pop_with_default(self) -> None:
        runner = Runner()
        runner._pending_messages["k"] = "/stop"
        assert runner._pending_messages.pop("k", None) == "/stop"
        assert runner._pending_messages.pop("k", None) is None

    def test_clear_resets_every_session_without_popitem(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        def no_popitem(self: object) -> tuple[str, Any]:
            raise AssertionError("clear must not loop over popitem")

        monkeypatch.setattr(LegacyFieldView, "popitem", no_popitem)
        runner = Runner()
        for key in "abc":
            runner._pending_turn_sidecar_notes[key] = ["note"]
        runner._pending_turn_sidecar_notes.clear()
        assert runner._pending_turn_sidecar_notes == {}
        assert all(state.conversation.sidecar_notes == [] for _, state in runner._sessions.items())

    def test_repr(self) -> None:
        runner = Runner()
        runner._running_agents["k"] = "agent"
        assert repr(runner._running_agents) == "LegacyFieldView({'k': 'agent'})"


class TestProperty:
    def test_class_access_returns_the_property(self) -> None:
        assert isinstance(Runner._running_agents, LegacyProperty)
        assert "turn.agent" in (Runner._running_agents.__doc__ or "")

    def test_setter_replaces_every_entry(self) -> None:
        runner = Runner()
        runner._session_model_overrides["a"] = "m1"
        runner._session_model_overrides["b"] = "m2"
        runner._session_model_overrides = {"b": "m3", "c": "m4"}
        assert runner._session_model_overrides == {"b": "m3", "c": "m4"}
        assert state_of(runner, "a").conversation.model_override is None

    def test_setter_with_none_empties(self) -> None:
        runner = Runner()
        runner._running_agents_ts["a"] = 1.0
        runner._running_agents_ts = None
        assert runner._running_agents_ts == {}
        assert state_of(runner, "a").turn.started_ts == 0.0

    def test_assigning_the_view_to_itself_keeps_it(self) -> None:
        runner = Runner()
        runner._running_agents["a"] = "agent"
        runner._running_agents = runner._running_agents
        assert runner._running_agents == {"a": "agent"}

    def test_deleter_clears(self) -> None:
        runner = Runner()
        runner._running_agents["a"] = "agent"
        del runner._running_agents
        assert runner._running_agents == {}
        assert "a" in runner._sessions


class TestRunGeneration:
    """The legacy view keeps the rule that generations only grow."""

    def test_bump_pattern_works(self) -> None:
        runner = Runner()
        gens = runner._session_run_generation
        gens["k"] = gens.get("k", 0) + 1
        gens["k"] = gens.get("k", 0) + 1
        assert gens["k"] == 2
        assert state_of(runner, "k").persistent.run_generation == 2

    def test_lowering_raises_and_keeps_the_value(self) -> None:
        runner = Runner()
        runner._session_run_generation["k"] = 5
        with pytest.raises(ValueError, match="only grows"):
            runner._session_run_generation["k"] = 4
        with pytest.raises(ValueError, match="only grows"):
            del runner._session_run_generation["k"]
        with pytest.raises(ValueError, match="only grows"):
            runner._session_run_generation.pop("k")
        assert runner._session_run_generation == {"k": 5}

    def test_clear_raises_before_changing_anything(self) -> None:
        runner = Runner()
        runner._session_run_generation["a"] = 1
        runner._session_run_generation["b"] = 2
        with pytest.raises(ValueError, match="only grows"):
            runner._session_run_generation.clear()
        assert runner._session_run_generation == {"a": 1, "b": 2}

    def test_an_assignment_one_of_whose_writes_is_refused_changes_nothing(self) -> None:
        runner = Runner()
        runner._session_run_generation["a"] = 1
        runner._session_run_generation["b"] = 3
        with pytest.raises(ValueError, match="only grows"):
            runner._session_run_generation = {"a": 5, "b": 1}  # "a" would go up first
        with pytest.raises(ValueError, match="only grows"):
            runner._session_run_generation = {"a": 2, "new": -1}
        assert runner._session_run_generation == {"a": 1, "b": 3}
        assert "new" not in runner._sessions

    def test_setter_keeps_or_raises_but_never_lowers(self) -> None:
        runner = Runner()
        runner._session_run_generation = {}
        runner._session_run_generation = {"k": 5}
        runner._session_run_generation = {"k": 5}
        runner._session_run_generation = {"k": 6}
        with pytest.raises(ValueError, match="only grows"):
            runner._session_run_generation = {}
        assert runner._session_run_generation == {"k": 6}


class TestLeaseTokenView:
    def test_keyed_by_session_and_generation(self) -> None:
        runner = Runner()
        runner._turn_lease_tokens[("k", 1)] = "t1"
        runner._turn_lease_tokens[("k", 2)] = "t2"
        assert state_of(runner, "k").turn.lease_tokens == {1: "t1", 2: "t2"}
        assert runner._turn_lease_tokens == {("k", 1): "t1", ("k", 2): "t2"}
        assert len(runner._turn_lease_tokens) == 2

    def test_reflects_state_helpers(self) -> None:
        runner = Runner()
        state_of(runner, "k").turn.store_lease_token(4, "t4")
        assert runner._turn_lease_tokens[("k", 4)] == "t4"
        state_of(runner, "k").turn.release_lease_token(4)
        assert ("k", 4) not in runner._turn_lease_tokens

    def test_pop_releases_exactly_once(self) -> None:
        runner = Runner()
        runner._turn_lease_tokens[("k", 1)] = "t1"
        assert runner._turn_lease_tokens.pop(("k", 1), None) == "t1"
        assert runner._turn_lease_tokens.pop(("k", 1), None) is None
        with pytest.raises(KeyError):
            del runner._turn_lease_tokens[("k", 1)]

    @pytest.mark.parametrize("key", ["k", ("k",), ("k", 1, 2), (1, "k"), ("k", "1")])
    def test_bad_keys_raise_key_error(self, key: Any) -> None:
        runner = Runner()
        runner._turn_lease_tokens[("k", 1)] = "t1"
        with pytest.raises(KeyError):
            runner._turn_lease_tokens[key]
        with pytest.raises(KeyError):
            runner._turn_lease_tokens[key] = "t"
        with pytest.raises(KeyError):
            del runner._turn_lease_tokens[key]
        assert key not in runner._turn_lease_tokens

    def test_reading_creates_no_session(self) -> None:
        runner = Runner()
        assert runner._turn_lease_tokens.get(("k", 1)) is None
        assert "k" not in runner._sessions

    def test_survives_turn_clear_and_clears_itself(self) -> None:
        runner = Runner()
        runner._turn_lease_tokens[("a", 1)] = "t1"
        runner._turn_lease_tokens[("b", 2)] = "t2"
        runner._sessions.end_turn(SessionKey("a"))
        assert len(runner._turn_lease_tokens) == 2
        runner._turn_lease_tokens.clear()
        assert runner._turn_lease_tokens == {}

    def test_setter_and_deleter(self) -> None:
        runner = Runner()
        runner._turn_lease_tokens[("a", 1)] = "t1"
        runner._turn_lease_tokens = {("b", 2): "t2"}
        assert runner._turn_lease_tokens == {("b", 2): "t2"}
        del runner._turn_lease_tokens
        assert runner._turn_lease_tokens == {}


def values_for(name: str) -> st.SearchStrategy[Any]:
    spec = LEGACY_FIELD_SPECS[name]
    if spec.presence is Presence.NOT_UNSET:
        return st.sampled_from([SERVICE_TIER_UNSET, None, "priority", ""])
    if spec.presence is Presence.NOT_NONE:
        return st.none() | st.text(max_size=2) | st.integers(0, 2)
    by_type: dict[type, st.SearchStrategy[Any]] = {
        float: st.sampled_from([0.0, 1.5, 2.0]),
        str: st.text(max_size=2),
        list: st.lists(st.integers(0, 3), max_size=2),
        dict: st.dictionaries(st.sampled_from(["r1", "r2"]), st.integers(0, 3), max_size=2),
        bool: st.booleans(),
        int: st.integers(0, 4),
    }
    return by_type[type(spec.default)]


class DictModel:
    """A plain dict with the same presence rule and the only-grows rule for generations."""

    def __init__(self, name: str) -> None:
        self.items: dict[str, Any] = {}
        self.presence = LEGACY_FIELD_SPECS[name].presence
        self.grows = name == "_session_run_generation"

    def set(self, key: str, value: Any) -> None:
        if self.grows and value < self.items.get(key, 0):
            raise ValueError("only grows")
        if is_present(self.presence, value):
            self.items[key] = value
        else:
            self.items.pop(key, None)

    def delete(self, key: str) -> None:
        if key not in self.items:
            raise KeyError(key)
        if self.grows:
            raise ValueError("only grows")
        del self.items[key]

    def clear(self) -> None:
        if self.grows and self.items:
            raise ValueError("only grows")
        self.items.clear()

    def replace(self, entries: dict[str, Any]) -> None:
        """All or nothing: the writes are made on a copy, kept only if none was refused."""
        trial = DictModel.__new__(DictModel)
        trial.items, trial.presence, trial.grows = dict(self.items), self.presence, self.grows
        for key in [key for key in trial.items if key not in entries]:
            trial.delete(key)
        for key, value in entries.items():
            trial.set(key, value)
        self.items = trial.items


KEYS = st.sampled_from(["a", "b", "c"])


def apply(target: Any, op: tuple[Any, ...]) -> type[Exception] | None:
    try:
        getattr(target, op[0])(*op[1:])
    except (KeyError, ValueError) as exc:
        return type(exc)
    return None


class ViewOps:
    def __init__(self, runner: Runner, name: str) -> None:
        self.runner, self.name = runner, name

    def set(self, key: str, value: Any) -> None:
        view(self.runner, self.name)[key] = value

    def delete(self, key: str) -> None:
        del view(self.runner, self.name)[key]

    def clear(self) -> None:
        view(self.runner, self.name).clear()

    def replace(self, entries: dict[str, Any]) -> None:
        setattr(self.runner, self.name, entries)


@pytest.mark.parametrize("name", NAMES)
@given(data=st.data())
def test_view_behaves_like_a_dict_model(name: str, data: st.DataObject) -> None:
    values = values_for(name)
    ops = st.one_of(
        st.tuples(st.just("set"), KEYS, values),
        st.tuples(st.just("delete"), KEYS),
        st.tuples(st.just("clear")),
        st.tuples(st.just("replace"), st.dictionaries(KEYS, values, max_size=3)),
    )
    runner, model = Runner(), DictModel(name)
    for op in data.draw(st.lists(ops, max_size=12)):
        assert apply(ViewOps(runner, name), op) == apply(model, op)
        assert view(runner, name) == model.items
        assert len(view(runner, name)) == len(model.items)
        assert list(view(runner, name)) == list(model.items)


def test_scope_classes_are_dataclasses_of_the_right_scope() -> None:
    classes = {Scope.TURN: TurnState, Scope.CONVERSATION: ConversationState}
    classes[Scope.PERSISTENT] = PersistentState
    for spec in LEGACY_FIELD_SPECS.values():
        assert hasattr(classes[spec.scope](), spec.field)


class DictRunner:
    """A runner written the old way: its own ``{key: state}`` dict, no registry."""

    _running_agents = legacy_dict_property("_running_agents")
    _queued_events = legacy_dict_property("_queued_events")
    _turn_lease_tokens = legacy_lease_token_property()

    def __init__(self) -> None:
        self._sessions: dict[str, SessionState] = {}


class BareRunner:
    """A runner with nothing but legacy properties, assigned in ``__init__`` as before."""

    _running_agents = legacy_dict_property("_running_agents")
    _queued_events = legacy_dict_property("_queued_events")

    def __init__(self) -> None:
        self._running_agents = {}
        self._queued_events = {}


class TestDropIn:
    def test_a_plain_dict_of_sessions_works(self) -> None:
        runner = DictRunner()
        runner._running_agents["k"] = "agent"
        runner._turn_lease_tokens[("k", 1)] = "t"
        state = runner._sessions["k"]
        assert (state.key, state.turn.agent, state.turn.lease_tokens) == ("k", "agent", {1: "t"})
        assert dict(runner._running_agents) == {"k": "agent"}
        assert "other" not in runner._running_agents
        runner._sessions["j"] = SessionState()
        runner._sessions["j"].turn.agent = "b"
        assert list(runner._running_agents) == ["k", "j"]

    def test_a_runner_without_sessions_gets_a_registry(self) -> None:
        runner = BareRunner()
        runner._queued_events.setdefault("k", []).append("e")
        assert runner._queued_events == {"k": ["e"]}
        assert "k" not in runner._running_agents
        sessions = vars(runner)["_sessions"]
        assert isinstance(sessions, SessionRegistry)
        assert sessions.get(SessionKey("k")).conversation.queued_events == ["e"]

    def test_session_state_needs_no_key(self) -> None:
        state = SessionState()
        assert state.key == ""
        assert not state.is_busy

    @pytest.mark.parametrize("how", ["clear", "assign", "delete attribute"])
    def test_clear_detaches_a_held_empty_list(self, how: str) -> None:
        runner = Runner()
        held = runner._queued_events.setdefault("k", [])
        assert "k" not in runner._queued_events
        if how == "clear":
            runner._queued_events.clear()
        elif how == "assign":
            runner._queued_events = {}
        else:
            del runner._queued_events
        held.append("stale")
        assert "k" not in runner._queued_events
        assert state_of(runner, "k").conversation.queued_events == []

    def test_views_keep_insertion_order_across_writes_elsewhere(self) -> None:
        runner = Runner()
        runner._running_agents["a"] = "x"
        runner._running_agents["b"] = "y"
        runner._session_model_overrides["a"] = "m"
        assert list(runner._running_agents) == ["a", "b"]
        runner._running_agents["a"] = "z"
        assert list(runner._running_agents.items()) == [("a", "z"), ("b", "y")]
        runner._turn_lease_tokens[("b", 1)] = "t1"
        runner._turn_lease_tokens[("a", 1)] = "t2"
        runner._session_model_overrides["b"] = "n"
        assert list(runner._turn_lease_tokens) == [("b", 1), ("a", 1)]
        del runner._running_agents["a"]
        runner._running_agents["a"] = "again"
        assert list(runner._running_agents) == ["b", "a"]
