"""The commands people use every day: conversations, model overrides and approvals.

``/new`` ``/reset`` ``/resume`` go through the one boundary funnel
(:func:`chatlane.lifecycle.end_conversation`); ``/model`` ``/reasoning``
``/fast`` set conversation-scoped overrides that the store keeps;
``/approve`` ``/deny`` answer a tool's approval request. All of them run
while a turn is busy (an approval is answered *while* its turn waits).
"""

from __future__ import annotations

import shlex
import time
from typing import NamedTuple

import msgspec

from chatlane.approvals import Decision, Grant, is_request_id
from chatlane.approvals_elsewhere import Meant
from chatlane.commands import CommandBusy, CommandCall, CommandSpec, UsageError, quoted
from chatlane.endpoints import EndpointRefused, endpoint_policy
from chatlane.lifecycle import RESUMABLE, Ended, EndReason, end_conversation
from chatlane.redaction import CREDENTIALS_REFUSED, looks_like_credential
from chatlane.runtime.persisted import apply_once
from chatlane.state import SERVICE_TIER_UNSET
from chatlane.stores.base import Conversation
from chatlane.stores.fields import MODEL_OVERRIDE, REASONING_OVERRIDE, SERVICE_TIER_OVERRIDE
from chatlane.types import ModelChoice, default_model, disguising, visible

YES = frozenset({"yes", "y", "ok", "confirm"})
NO = frozenset({"no", "n", "cancel"})


YES_OR_NO = YES | NO
"""Every word that answers a pending question (an approval, a confirmation)."""


def is_yes_or_no(text: str) -> bool:
    """Whether ``text`` is a plain yes or no (what answers a pending question)."""
    return text.strip().lower() in YES_OR_NO


REASONING = ("none", "low", "medium", "high")


# -- conversations ------------------------------------------------------------------


async def _new(call: CommandCall) -> str:
    return await _boundary(call, EndReason.NEW)


async def _reset(call: CommandCall) -> str:
    return await _boundary(call, EndReason.RESET)


async def _boundary(call: CommandCall, reason: EndReason) -> str:
    options = call.router.options
    if options.confirm_new and call.args.lower() != "confirm":
        state = await call.engine.session(call.session_key)
        asked_at = await call.engine.store.generation(call.session_key)
        conversation = state.conversation
        conversation.pending_command_text = f"/{reason.value} confirm"
        conversation.pending_command_generation = max(asked_at, state.persistent.run_generation)
        return (
            f"Start a new conversation? The current one will be closed. "
            f"Reply yes (or /{reason.value} confirm) to go ahead; anything else cancels."
        )
    ended = await end_conversation(
        call.engine, call.session_key, reason, before_reset=options.before_reset
    )
    return "Started a new conversation." + _dropped(ended)


def _dropped(ended: Ended) -> str:
    """What the boundary dropped: here, and what other gateway processes had taken."""
    count, elsewhere = ended.dropped, ended.dropped_elsewhere
    if not count and not elsewhere:
        return ""
    text = f" Dropped {count} queued {_messages(count)}"
    if elsewhere:
        text += f", and {elsewhere} {_messages(elsewhere)} other gateway processes had taken"
    return text + "."


def _messages(count: int) -> str:
    return "message" if count == 1 else "messages"


LISTED = 20
"""Conversations ``/resume`` lists, and numbers, newest first."""


async def _resume(call: CommandCall) -> str:
    store, key = call.engine.store, call.session_key
    if not call.args:
        listed = await store.conversations(key, LISTED)
        return _listing(listed, (await store.conversation(key)).id)
    conversations = await store.conversations(key, RESUMABLE)
    chosen, others = _find(conversations, call.args.strip())
    if chosen is None:
        raise UsageError(f"No conversation matches {quoted(call.args)}; send /resume to list them.")
    if chosen.id == (await store.conversation(key)).id:  # nothing to switch to: nothing ends
        return f"Already in {_named(chosen)}." + _also_matching(others)
    ended = await end_conversation(
        call.engine,
        key,
        EndReason.RESUME,
        resume_id=chosen.id,
        before_reset=call.router.options.before_reset,
    )
    return f"Resumed {_named(chosen)}." + _also_matching(others) + _dropped(ended)


def _listing(conversations: list[Conversation], current: str) -> str:
    """The numbered list ``/resume <number>`` picks from: titles and dates, never ids."""
    lines = ["Recent conversations (newest first):"]
    for number, c in enumerate(conversations, start=1):
        mark = " (current)" if c.id == current else ""
        lines.append(f"{number}. {c.title or '(untitled)'} — {_started(c)}{mark}")
    lines.append("Send /resume <number or title words> to switch.")
    return "\n".join(lines)


def _started(conversation: Conversation) -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(conversation.started_at))


def _named(conversation: Conversation) -> str:
    """How a reply names a conversation: by its title and start, or its start alone."""
    if conversation.title:
        return f"“{conversation.title}” (started {_started(conversation)})"
    return f"the untitled conversation started {_started(conversation)}"


def _find(conversations: list[Conversation], wanted: str) -> tuple[Conversation | None, int]:
    """The conversation ``wanted`` picks, and how many others its title words match too.

    ``wanted`` is a number in the listed order (``/resume 2``), a conversation's
    id (what the web chat sends), or words its title holds, in any order and
    case; of several titles holding them, the newest is picked.
    """
    if (
        wanted.isascii()
        and wanted.isdigit()
        and 1 <= int(wanted) <= min(LISTED, len(conversations))
    ):
        return conversations[int(wanted) - 1], 0
    for c in conversations:
        if c.id == wanted:
            return c, 0
    words = wanted.lower().split()
    matching = [c for c in conversations if c.title and all(w in c.title.lower() for w in words)]
    if not matching:
        return None, 0
    return matching[0], len(matching) - 1


def _also_matching(others: int) -> str:
    if not others:
        return ""
    if others == 1:
        return " Another conversation matches too: send /resume to pick it by number."
    return f" {others} other conversations match too: send /resume to pick one by number."


# -- model overrides ------------------------------------------------------------------


def _parse_model(args: str) -> tuple[ModelChoice, bool]:
    """``[--once] <name> [--provider P] [--base-url URL]``, credentials refused unrepeated.

    Each value given — the name, and each option's — is checked alike
    (:func:`_checked`); an option is given at most once.

    :raises UsageError: for malformed arguments, an API key, or anything shaped
        like a credential in the name, the provider or the URL.
    """
    if looks_like_credential(args):
        raise UsageError(CREDENTIALS_REFUSED)
    try:
        words = shlex.split(args)
    except ValueError as error:
        raise UsageError(f"could not read the arguments: {error}") from None
    once = "--once" in words
    names, options = _model_words([w for w in words if w != "--once"])
    if len(names) != 1:
        raise UsageError("name exactly one model.")
    name = _checked("a model name", names[0], MODEL_NAME_MAX)
    return ModelChoice(name, options.get("--provider", ""), options.get("--base-url", "")), once


MODEL_NAME_MAX = 200
"""The longest model or provider name ``/model`` takes (real ones are far shorter)."""

BASE_URL_MAX = 2000
"""The longest ``--base-url`` ``/model`` takes."""

_MODEL_OPTIONS = {"--provider": MODEL_NAME_MAX, "--base-url": BASE_URL_MAX}
"""``/model``'s options that take a value, with the longest value each takes."""


def _model_words(words: list[str]) -> tuple[list[str], dict[str, str]]:
    """The names among ``words``, and the options with their checked values.

    :raises UsageError: an API key, an unknown option, an option without a
        value or given twice, or a value :func:`_checked` refuses.
    """
    names: list[str] = []
    options: dict[str, str] = {}
    while words:
        word = words.pop(0)
        if word in ("--api-key", "--key") or word.startswith("--api-key="):
            raise UsageError(CREDENTIALS_REFUSED)
        option, equals, value = word.partition("=")
        if not word.startswith("--"):
            names.append(word)
            continue
        if option not in _MODEL_OPTIONS:
            raise UsageError(f"unknown option {quoted(option)}.")
        if not equals:  # --provider P
            if not words:
                raise UsageError(f"{option} needs a value.")
            value = words.pop(0)
        if option in options:
            raise UsageError(f"{option} is given twice.")
        options[option] = _checked(option, value, _MODEL_OPTIONS[option])
    return names, options


def _checked(what: str, value: str, limit: int) -> str:
    """``value`` (of ``what``), if a chat may set it: it holds a visible character, is at
    most ``limit`` characters, and holds no control character or bidirectional override
    (which could change how it, or what follows it, is shown where it is repeated).

    :raises UsageError: naming what is wrong in one line, repeating none of ``value``.
    """
    if not visible(value):
        raise UsageError(f"{what} needs visible characters.")
    if len(value) > limit:
        raise UsageError(f"{what} is at most {limit} characters.")
    if disguising(value):
        raise UsageError(f"{what} may hold no control characters or bidirectional overrides.")
    return value


def _described(choice: ModelChoice | None, default: str) -> str:
    """``choice`` for a reply; none is the agent's ``default`` (named, if the agent says)."""
    if choice:
        return choice.describe()
    return f"{default} (the default)" if default else "the default"


async def _model(call: CommandCall) -> str:
    engine, key = call.engine, call.session_key
    if not call.args:
        conversation = (await engine.fresh_session(key)).conversation
        current, once = conversation.model_override, conversation.one_turn_restore
        default = default_model(engine.agent)
        shown = f"Model: {_described(current, default)}"
        if once is None:
            return shown
        then = _described(once["model_override"], default)
        return f"{shown}, for the next turn only; then {then}"
    if call.args.strip().lower() == "default":
        await engine.persist_conversation(key, **{MODEL_OVERRIDE: None})
        (await engine.session(key)).conversation.one_turn_restore = None
        default = default_model(engine.agent)
        return f"Model: back to {_described(None, default)}."
    choice, once = _parse_model(call.args)
    if choice.base_url:
        choice = await _allowed_endpoint(call, choice)
    state = await engine.session(key)
    if once:
        apply_once(state, choice)
        return f"Next turn only: {choice.describe()}"
    await engine.persist_conversation(key, **{MODEL_OVERRIDE: choice})
    state.conversation.one_turn_restore = None
    return f"Model for this conversation: {choice.describe()}"


async def _allowed_endpoint(call: CommandCall, choice: ModelChoice) -> ModelChoice:
    """``choice`` with its endpoint normalized, if the agent lets a chat choose it.

    :raises UsageError: if the agent takes no endpoint from a chat or its policy refuses this one.
    """
    policy = endpoint_policy(call.engine.agent)
    if policy is None:
        raise UsageError("this agent takes no endpoint from a chat.")
    try:
        base_url = await policy.check(choice.base_url)
    except EndpointRefused as refused:
        raise UsageError(str(refused)) from None
    return msgspec.structs.replace(choice, base_url=base_url)


async def _reasoning(call: CommandCall) -> str:
    engine, key = call.engine, call.session_key
    value = call.args.strip().lower()
    if not value:
        effort = (await engine.fresh_session(key)).conversation.reasoning_override
        return f"Reasoning effort: {effort or 'the default'}"
    if value == "default":
        await engine.persist_conversation(key, **{REASONING_OVERRIDE: None})
        return "Reasoning effort: back to the default."
    if value not in REASONING:
        raise UsageError(f"{quoted(value)} is not one of: {', '.join(REASONING)}, default.")
    await engine.persist_conversation(key, **{REASONING_OVERRIDE: value})
    return f"Reasoning effort for this conversation: {value}"


async def _fast(call: CommandCall) -> str:
    engine, key = call.engine, call.session_key
    tiers = {"on": "priority", "off": None, "default": SERVICE_TIER_UNSET}
    value = call.args.strip().lower()
    if not value:
        tier = (await engine.fresh_session(key)).conversation.service_tier_override
        shown = "default" if tier is SERVICE_TIER_UNSET else ("off" if tier is None else "on")
        return f"Fast mode: {shown}"
    if value not in tiers:
        raise UsageError(f"{quoted(value)} is not one of: on, off, default.")
    await engine.persist_conversation(key, **{SERVICE_TIER_OVERRIDE: tiers[value]})
    return f"Fast mode: {value}"


# -- approvals ---------------------------------------------------------------------------


class _ApprovalArgs(NamedTuple):
    everything: bool
    words: list[str]
    """The rest: a grant for ``/approve``, the reason for ``/deny``."""
    generation: int | None = None
    """``#<generation>``: answer only the requests of that turn."""
    request_id: str | None = None
    """``#<request id>`` (``#a1b2c3d4``): answer only that request (what buttons send)."""


def _approval_args(args: str) -> _ApprovalArgs:
    """``[all] [#<request id>|#<generation>] rest…``; only the first word may name one.

    :raises UsageError: if that first word starts with ``#`` but names neither.
    """
    words = args.split()
    everything = bool(words) and words[0].lower() == "all"
    if everything:
        words = words[1:]
    if not words or not words[0].startswith("#"):
        return _ApprovalArgs(everything, words)
    named, rest = words[0][1:], words[1:]
    if named.isascii() and named.isdigit():
        return _ApprovalArgs(everything, rest, generation=int(named))
    if is_request_id(named):
        return _ApprovalArgs(everything, rest, request_id=named)
    raise UsageError(f"{quoted(words[0])} names no request (buttons send #<request id>).")


async def _approve(call: CommandCall) -> str:
    args = _approval_args(call.args)
    words = args.words
    if len(words) > 1 or (words and words[0].lower() not in {g.value for g in Grant}):
        raise UsageError("say once, session or always.")
    grant = Grant(words[0].lower()) if words else Grant.ONCE
    return await _answer(call, Decision(True, grant), args)


async def _deny(call: CommandCall) -> str:
    args = _approval_args(call.args)
    return await _answer(call, Decision(False, note=_reason(args.words)), args)


REASON_MAX = 500
"""The longest reason ``/deny`` takes."""


def _reason(words: list[str]) -> str:
    """The reason a ``/deny`` gives (repeated in the chat, and kept with a passed-on answer).

    :raises UsageError: longer than :data:`REASON_MAX`, or holding a control
        character or bidirectional override.
    """
    reason = " ".join(words)
    if len(reason) > REASON_MAX:
        raise UsageError(f"a reason is at most {REASON_MAX} characters.")
    if disguising(reason):
        raise UsageError("a reason may hold no control characters or bidirectional overrides.")
    return reason


async def _answer(call: CommandCall, decision: Decision, args: _ApprovalArgs) -> str:
    """Resolve the requests waiting here; with none here, pass the answer on to another
    process whose turn waits for it (through the store), if one does."""
    approvals, key = call.engine.approvals, call.session_key
    state = await call.engine.session(key)
    user = call.message.source.user_id
    if not approvals.has_pending(state):
        meant = Meant(args.everything, args.generation, args.request_id)
        passed = await approvals.pass_on(key, user, decision, meant)
        if passed is not None:
            return passed
    return await approvals.resolve(
        state,
        user,
        decision,
        args.everything,
        generation=args.generation,
        request_id=args.request_id,
    )


SESSION_COMMANDS = (
    CommandSpec("new", "start a new conversation", "/new [confirm]", CommandBusy.DISPATCH, _new),
    CommandSpec(
        "reset",
        "start a new conversation (same as /new)",
        "/reset [confirm]",
        CommandBusy.DISPATCH,
        _reset,
    ),
    CommandSpec(
        "resume",
        "list recent conversations, or switch to one",
        "/resume [number | title words]",
        CommandBusy.DISPATCH,
        _resume,
    ),
    CommandSpec(
        "model",
        "show or set the model (--once: next turn only; default: the agent's own)",
        "/model [--once] <name> [--provider P] [--base-url URL] | /model default",
        CommandBusy.DISPATCH,
        _model,
    ),
    CommandSpec(
        "reasoning",
        "show or set the reasoning effort",
        "/reasoning [none|low|medium|high|default]",
        CommandBusy.DISPATCH,
        _reasoning,
    ),
    CommandSpec(
        "fast",
        "priority service tier on, off, or default",
        "/fast [on|off|default]",
        CommandBusy.DISPATCH,
        _fast,
    ),
    CommandSpec(
        "approve",
        "allow what a tool asked for",
        "/approve [all] [#request] [once|session|always]",
        CommandBusy.DISPATCH,
        _approve,
    ),
    CommandSpec(
        "deny",
        "refuse what a tool asked for",
        "/deny [all] [#request] [reason]",
        CommandBusy.DISPATCH,
        _deny,
    ),
)
"""Conversation, override and approval commands; every one runs while a turn is busy."""
