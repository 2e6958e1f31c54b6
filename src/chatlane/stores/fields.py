"""The names of the persistent fields chatlane keeps in a store, in one place.

A store keeps, per session key, a map of field name to JSON value
(:meth:`~chatlane.stores.base.Store.load_persistent`). These are the names the
runtime reads and writes; every module names a field through this module,
never by a string of its own, so a stored name cannot drift between the
writer and the reader. A stored name outlives the process that wrote it:
renaming one is a data migration, not a refactoring.
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "APPROVALS_WAITING",
    "APPROVAL_ALLOWLIST",
    "APPROVAL_ALLOWLIST_BY_USER",
    "APPROVAL_ANSWERS",
    "BUSY_POLICY",
    "CONVERSATION_ID",
    "CONVERSATION_OVERRIDES",
    "INTERRUPTED_GENERATION",
    "JOB_PREFIX",
    "LAST_TICK",
    "LAST_TICK_CLOCK",
    "MODEL_OVERRIDE",
    "MOVED_PREFIX",
    "REASONING_OVERRIDE",
    "REDIRECT_GENERATION",
    "SERVICE_TIER_OVERRIDE",
    "job_field",
    "moved_field",
]

# -- a session's fields ----------------------------------------------------------------

CONVERSATION_ID: Final = "conversation_id"
"""The session's current conversation, written at each conversation boundary."""

BUSY_POLICY: Final = "busy_policy"
"""The session's busy policy, by name (``/busy``); absent or null: the default."""

MODEL_OVERRIDE: Final = "model_override"
"""The conversation's model, as ``{"name", "provider", "base_url"}`` (never an API key)."""

REASONING_OVERRIDE: Final = "reasoning_override"
"""The conversation's reasoning effort, by name."""

SERVICE_TIER_OVERRIDE: Final = "service_tier_override"
"""The conversation's service tier: ``"priority"``, ``"normal"``, or null (unset)."""

CONVERSATION_OVERRIDES: Final = (MODEL_OVERRIDE, REASONING_OVERRIDE, SERVICE_TIER_OVERRIDE)
"""The conversation-scoped fields: a conversation boundary clears them together."""

APPROVAL_ALLOWLIST: Final = "approval_allowlist"
"""Commands the session approved for good (``always``), as a list of strings, bound to
no one: written for a session of one person (and, before grants were bound to their
giver, for any session); a shared session does not take them as anyone's approval."""

APPROVAL_ALLOWLIST_BY_USER: Final = "approval_allowlist_by_user"
"""Commands approved for good (``always``) in a shared session, as ``{"<user id>":
["<command>", …]}``: each approves its user's turns only. A field of its own, so a
process of an earlier version, which reads only :data:`APPROVAL_ALLOWLIST`, neither
applies these to everyone nor drops them when it writes its list."""

APPROVALS_WAITING: Final = "approvals_waiting"
"""The approval requests the running turn waits on, oldest first, each as ``{"id",
"holder", "generation", "user_id", "command"}``; written by the process that runs it."""

APPROVAL_ANSWERS: Final = "approval_answers"
"""Answers given in another process to waiting requests: request id → ``{"approved",
"grant", "note", "user_id"}``; read by the process where the request waits."""

INTERRUPTED_GENERATION: Final = "interrupted_generation"
"""The generation another process interrupted (so its turn ends as interrupted, not lost)."""

REDIRECT_GENERATION: Final = "redirect_generation"
"""The generation another process asked to stop at a safe point and keep its work."""

# -- the scheduler's fields (kept under the scheduler's own keys) -------------------------

JOB_PREFIX: Final = "job:"
"""A stored cron job is the field ``job:<id>`` of the scheduler's key."""

LAST_TICK: Final = "last_tick"
"""The last tick of a job that was claimed, kept under the job's claim key."""

LAST_TICK_CLOCK: Final = "last_tick_clock"
"""The host whose clock claimed :data:`LAST_TICK` (its name), kept beside it."""


def job_field(job_id: str) -> str:
    """The field that holds the stored cron job ``job_id``."""
    return f"{JOB_PREFIX}{job_id}"


# -- the Telegram adapter's fields (kept under its own key) ---------------------------------

MOVED_PREFIX: Final = "moved:"
"""A Telegram group upgraded to a supergroup is the field ``moved:<group id>`` (the
supergroup's id) of the adapter's key."""


def moved_field(chat_id: str) -> str:
    """The field that holds where the Telegram group ``chat_id`` moved."""
    return f"{MOVED_PREFIX}{chat_id}"
