"""Which per-session choices the store keeps, how they are encoded, and one-turn overrides.

What stays true:

* The store keeps only JSON values: a busy policy by its name, a model
  choice as ``{"name", "provider", "base_url"}`` — never an API key — and the
  service tier as ``"priority"``, ``"normal"`` (explicitly normal) or nothing
  (unset), so its three states survive a restart.
* The approval allowlist keeps what it always kept: ``approval_allowlist``, a
  list of commands bound to no one. Grants bound to their giver (given in a
  shared session) are kept beside it, in ``approval_allowlist_by_user`` as
  ``{"<user id>": ["<command>", …]}``: an entry of either field read back is
  the entry written, and what an earlier version wrote reads as it did.
* A one-turn override (``/model --once``) is for the next turn of a person
  whose agent is called: that turn settles it on every exit path, restoring
  the snapshot taken by the *first* ``--once``. Anything else the agent answers
  meanwhile (a turn of internal messages, a side answer) runs with the
  conversation's own model (:func:`without_once`) and leaves it in place.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from typing import Any, Final

import msgspec

from chatlane.errors import ConfigError
from chatlane.logs import turn_fields
from chatlane.runtime.busy import BusyPolicy
from chatlane.runtime.turn import Turn, TurnOverrides
from chatlane.state import SERVICE_TIER_UNSET, ServiceTier, SessionState, UserGrant
from chatlane.stores.fields import (
    APPROVAL_ALLOWLIST,
    APPROVAL_ALLOWLIST_BY_USER,
    BUSY_POLICY,
    CONVERSATION_ID,
    MODEL_OVERRIDE,
    REASONING_OVERRIDE,
    SERVICE_TIER_OVERRIDE,
)
from chatlane.types import ModelChoice, SessionKey

log = logging.getLogger("chatlane.runtime")


def encode_tier(tier: ServiceTier) -> str | None:
    """The stored form of a service tier override."""
    if tier is SERVICE_TIER_UNSET:
        return None
    return "normal" if tier is None else str(tier)


def decode_tier(value: object) -> ServiceTier:
    """Read a stored service tier back into its three states."""
    if value is None:
        return SERVICE_TIER_UNSET
    return None if value == "normal" else str(value)


def encode_user_grants(grants: Iterable[UserGrant]) -> dict[str, list[str]]:
    """The stored form of grants bound to users: each user's commands, in the order given."""
    stored: dict[str, list[str]] = {}
    for user_id, command in grants:
        stored.setdefault(user_id, []).append(command)
    return stored


def decode_user_grants(value: object) -> tuple[UserGrant, ...] | None:
    """Grants bound to users, read back from their stored form; ``None`` for a value that
    is not one (nothing is taken up). An entry that is not text is left out: a grant
    is never read as someone else's, nor as no one's."""
    if not isinstance(value, dict):
        return None
    return tuple(
        UserGrant(user_id, command)
        for user_id, commands in value.items()
        if isinstance(user_id, str) and user_id and isinstance(commands, list)
        for command in commands
        if isinstance(command, str)
    )


def stored_fields(fields: Mapping[str, object]) -> dict[str, Any]:
    """Persistent fields as the store keeps them (JSON values only)."""
    stored: dict[str, Any] = {}
    for name, value in fields.items():
        if isinstance(value, BusyPolicy):
            value = value.value
        elif isinstance(value, ModelChoice):
            value = msgspec.to_builtins(value)
        elif name == SERVICE_TIER_OVERRIDE:
            value = encode_tier(value)  # type: ignore[arg-type]
        elif name == APPROVAL_ALLOWLIST_BY_USER and isinstance(value, tuple):
            value = encode_user_grants(value)
        stored[name] = value
    return stored


def load_overrides(state: SessionState, fields: Mapping[str, object]) -> None:
    """Apply the stored conversation overrides and approval allowlist to a fresh state."""
    model = fields.get(MODEL_OVERRIDE)
    if isinstance(model, dict) and isinstance(model.get("name"), str):
        state.conversation.model_override = msgspec.convert(model, ModelChoice)
    reasoning = fields.get(REASONING_OVERRIDE)
    state.conversation.reasoning_override = reasoning if isinstance(reasoning, str) else None
    state.conversation.service_tier_override = decode_tier(fields.get(SERVICE_TIER_OVERRIDE))
    allowlist = fields.get(APPROVAL_ALLOWLIST)
    if isinstance(allowlist, list):
        state.persistent.approval_allowlist = [p for p in allowlist if isinstance(p, str)]
    by_user = decode_user_grants(fields.get(APPROVAL_ALLOWLIST_BY_USER))
    if by_user is not None:
        state.persistent.approval_allowlist_by_user = by_user


def apply_once(state: SessionState, model: ModelChoice) -> None:
    """Use ``model`` for the next turn only; the earliest snapshot is the one restored."""
    conversation = state.conversation
    if conversation.one_turn_restore is None:
        conversation.one_turn_restore = {"model_override": conversation.model_override}
    conversation.model_override = model


def without_once(state: SessionState) -> TurnOverrides:
    """The overrides of ``state``'s conversation with its own model, a ``--once`` left aside."""
    overrides = TurnOverrides.of(state)
    snapshot = state.conversation.one_turn_restore
    if snapshot is None:
        return overrides
    return msgspec.structs.replace(overrides, model=snapshot["model_override"])


def settle_once(turn: Turn) -> None:
    """Restore the model a ``--once`` override replaced, if ``turn`` is the one that used it."""
    snapshot = turn.once_restore
    if snapshot is None:
        return
    conversation = turn.session_state.conversation
    if conversation.one_turn_restore is not snapshot:
        return
    if conversation.model_override is not turn.overrides.model:
        return  # a newer --once arrived during this turn: the next turn uses it, then restores
    conversation.model_override = snapshot["model_override"]
    conversation.one_turn_restore = None


def nothing_to_save(key: SessionKey, state: SessionState) -> None:
    """The ``on_evict`` hook of a registry whose sessions the store keeps: it does nothing.

    Its persistent fields and queue live in the store, so evicting a session
    that holds them loses nothing; passing this hook, rather than none, is
    what lets the registry evict it. What no store keeps (a ``/model --once``,
    ``/approve session`` grants, a confirmation waiting:
    :attr:`~chatlane.state.ConversationState.MEMORY_ONLY`) this hook cannot
    save: the registry evicts such a session last.
    """


def load_persistent(state: SessionState, fields: Mapping[str, object], generation: int) -> None:
    """Fill a fresh state's persistent scope and overrides from what the store keeps (once).

    The store's ``generation`` is the session's: the registry's floor a fresh
    state started at only stood in for it (a session evicted at a lower
    generation than others comes back at its own, or its leases would all
    look stale). Bumps made here since the state was made still count.
    """
    if not state.loaded:
        persistent = state.persistent
        bumped_here = persistent.run_generation - state.generation_floor
        persistent.restart_generation(max(generation, bumped_here))
        state.conversation.conversation_id = _text(fields.get(CONVERSATION_ID))
        _apply_choices(state, fields)
        state.loaded = True


def refresh_persistent(state: SessionState, fields: Mapping[str, object]) -> bool:
    """Re-apply the stored choices to a state this process has held for a while.

    Another process may have changed them (``/model``, ``/busy`` …) or
    started a new conversation since they were read. A new conversation
    clears this process's conversation scope first — its queue excepted — as
    a boundary here would. A ``/model --once`` waiting here keeps its model.

    :returns: whether the conversation changed.
    """
    conversation = state.conversation
    stored_id = _text(fields.get(CONVERSATION_ID))
    changed = stored_id != conversation.conversation_id
    if changed:
        queued = conversation.queued_events
        conversation.clear()
        conversation.queued_events, conversation.conversation_id = queued, stored_id
    once = conversation.one_turn_restore is not None
    model = conversation.model_override
    conversation.model_override = None
    _apply_choices(state, fields)
    if once:
        conversation.model_override = model
    return changed


_CHOICES: Final = frozenset(
    {
        BUSY_POLICY,
        MODEL_OVERRIDE,
        REASONING_OVERRIDE,
        SERVICE_TIER_OVERRIDE,
        APPROVAL_ALLOWLIST,
        APPROVAL_ALLOWLIST_BY_USER,
    }
)
"""The stored fields :func:`refresh_persistent` takes up besides the conversation id."""


def at_rest(state: SessionState, fields: Mapping[str, object]) -> bool:
    """Whether :func:`refresh_persistent` of ``fields`` would change nothing but ``read_at``.

    True for the common case only, and then exactly: the stored fields name
    no choice and the conversation this process holds, and ``state`` holds no
    choice either (no model, reasoning or service tier override, no busy
    policy of its own). Anything else is taken up in full.
    """
    conversation = state.conversation
    if (
        conversation.model_override is not None
        or conversation.reasoning_override is not None
        or conversation.service_tier_override is not SERVICE_TIER_UNSET
        or state.persistent.busy_policy is not None
    ):
        return False
    if not fields:  # a session the store keeps nothing of: no conversation named either
        return not conversation.conversation_id
    stored_id = _text(fields.get(CONVERSATION_ID))
    return stored_id == conversation.conversation_id and _CHOICES.isdisjoint(fields)


def _apply_choices(state: SessionState, fields: Mapping[str, object]) -> None:
    """The stored busy policy and overrides, taken as read now."""
    state.persistent.busy_policy = _stored_policy(state.key, fields.get(BUSY_POLICY))
    load_overrides(state, fields)
    state.read_at = time.monotonic()


def _text(value: object) -> str:
    return value if isinstance(value, str) else ""


def _stored_policy(key: SessionKey, value: object) -> BusyPolicy | None:
    if not value:
        return None
    try:
        return BusyPolicy.parse(str(value))
    except ConfigError as error:
        log.warning("ignoring the stored busy policy: %s", error, extra=turn_fields(key))
        return None
