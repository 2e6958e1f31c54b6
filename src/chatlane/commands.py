"""Slash commands: parsing, per-command busy behaviour, and the built-in set.

A command is data — a :class:`CommandSpec` naming its handler and its
:class:`CommandBusy` behaviour — so what a command does while a turn runs is
decided in one place (:meth:`CommandRouter.run`), never inside handlers.
A handler returns the reply text; a malformed argument raises
:class:`UsageError` and the user gets the command's usage line. Nothing a user
types can crash the router: an error the gateway expects (a store outage, any
:class:`~chatlane.errors.ChatlaneError`) becomes a reply saying what went
wrong, logged as a warning; an unexpected one a clear reply and a logged
traceback.
"""

from __future__ import annotations

import enum
import logging
import re
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from chatlane.errors import ChatlaneError, ConfigError, TakenElsewhere, shown_to_users
from chatlane.lifecycle import LifecycleOptions
from chatlane.runtime import pending
from chatlane.runtime.aside import TooManyAsides
from chatlane.runtime.busy import NOW, BusyOutcome, BusyPolicy, ack_text
from chatlane.runtime.settings import StopIncomplete
from chatlane.runtime.turn import steered_here, waiting_here
from chatlane.state import SlotPhase
from chatlane.stores.fields import BUSY_POLICY
from chatlane.types import InboundMessage, SessionKey, clipped

if TYPE_CHECKING:
    from chatlane.runtime.engine import TurnEngine

log = logging.getLogger("chatlane.commands")

_COMMAND = re.compile(r"/([A-Za-z][A-Za-z0-9_-]{0,31})(?:@(\S+))?(?:\s+(.*))?", re.DOTALL)


class CommandRefused(ChatlaneError):
    """A command refused its message (``/queue`` over the cap): it is answered as a notice.

    ``outcome`` names the refusal, as :attr:`~chatlane.types.Outbound.refusal` carries it.
    """

    def __init__(self, text: str, outcome: BusyOutcome) -> None:
        super().__init__(text)
        self.text = text
        self.outcome = outcome


class UsageError(ChatlaneError, ValueError):
    """A command's arguments are malformed; the user is shown its usage line."""


SHOWN = 80
"""Characters of an argument a reply repeats; a longer one is cut, with ``…``."""


def quoted(argument: str) -> str:
    """``argument`` as a reply repeats it: quoted and escaped as Python shows a string (no
    control character or bidirectional override reaches the chat as it is), cut to
    :data:`SHOWN` characters."""
    return repr(clipped(argument, SHOWN))


class CommandBusy(enum.StrEnum):
    """What a command does when its session is running a turn."""

    DISPATCH = "dispatch"
    """Runs at once, even while busy."""
    INTERRUPT_THEN_DISPATCH = "interrupt_then_dispatch"
    """Interrupts the running turn (fencing it off), then runs."""
    REJECT = "reject"
    """Refused with a clear message while busy."""


@dataclass(frozen=True, slots=True)
class ParsedCommand:
    """``/name[@bot] args`` split into its parts; ``name`` is lower-cased."""

    name: str
    args: str
    mention: str | None = None


def parse_command(text: str) -> ParsedCommand | None:
    """Read a slash command, or ``None`` if ``text`` is not one (``/usr/bin`` is not)."""
    text = text.strip()
    if not text.startswith("/"):
        return None  # most messages: no pattern to match
    match = _COMMAND.fullmatch(text)
    if match is None:
        return None
    name, mention, args = match.groups()
    return ParsedCommand(name.lower(), (args or "").strip(), mention)


@dataclass(frozen=True, slots=True)
class CommandCall:
    """Everything a handler gets: the engine, the session, the message and its arguments."""

    engine: TurnEngine
    router: CommandRouter
    session_key: SessionKey
    message: InboundMessage
    args: str


CommandHandler = Callable[[CommandCall], Awaitable[str]]


@dataclass(frozen=True, slots=True)
class CommandSpec:
    """One command: its name, one-line summary, usage line, busy behaviour and handler."""

    name: str
    summary: str
    usage: str
    busy: CommandBusy
    handler: CommandHandler
    hidden: bool = False
    """Not listed by /help (used for the answer to a plain "no")."""
    sends_as: str = ""
    """A busy policy: the command's text is sent on as a message under it
    (``/steer``, ``/now``) instead of running ``handler``, which only runs
    when the text is missing."""
    queues_message: bool = False
    """Its handler queues the command's text as a message under the command's own id,
    to run as a turn (``/queue``): that turn's commit marks the id answered, so the
    command's reply is not kept as its answer."""


class CommandRouter:
    """The commands a gateway understands, and the one place busy behaviour is applied."""

    def __init__(
        self, specs: Iterable[CommandSpec] = (), options: LifecycleOptions | None = None
    ) -> None:
        self.options = options or LifecycleOptions()
        self._specs: dict[str, CommandSpec] = {}
        for spec in specs:
            self.register(spec)

    def register(self, spec: CommandSpec) -> None:
        """Add ``spec``; a later registration under the same name replaces it."""
        self._specs[spec.name] = spec

    def get(self, name: str) -> CommandSpec | None:
        """The command called ``name``, if any."""
        return self._specs.get(name.lower())

    def __iter__(self) -> Iterator[CommandSpec]:
        visible = (spec for spec in self._specs.values() if not spec.hidden)
        return iter(sorted(visible, key=lambda spec: spec.name))

    def names(self) -> list[str]:
        """Every listed command name, sorted."""
        return [spec.name for spec in self]

    async def run(
        self, engine: TurnEngine, key: SessionKey, message: InboundMessage, parsed: ParsedCommand
    ) -> str:
        """Run ``parsed`` for ``key`` under its busy behaviour and return the reply text."""
        spec = self.get(parsed.name)
        if spec is None:
            return self.unknown_reply(parsed.name)
        if spec.busy is not CommandBusy.DISPATCH and _session_busy(engine, key):
            if spec.busy is CommandBusy.REJECT:
                return f"/{spec.name} can't run while a turn is running; wait, or send /stop first."
            engine.interrupt(key, f"by /{spec.name}")
        call = CommandCall(engine, self, key, message, parsed.args)
        return await _call_handler(spec, call)

    def unknown_reply(self, name: str) -> str:
        """The reply to a command nobody registered."""
        listed = ", ".join(f"/{n}" for n in self.names())
        return f"Unknown command /{name}. Commands: {listed}. Send /help for details."

    def help_text(self) -> str:
        """Every command with its one-line summary."""
        lines = [f"{spec.usage} — {spec.summary}" for spec in self]
        return "Commands:\n" + "\n".join(lines)


def _session_busy(engine: TurnEngine, key: SessionKey) -> bool:
    state = engine.registry.peek(key)
    return state is not None and state.turn.is_running


async def _call_handler(spec: CommandSpec, call: CommandCall) -> str:
    try:
        return await spec.handler(call)
    except CommandRefused:
        raise  # the gateway answers it as a refusal
    except (UsageError, ConfigError) as error:
        detail = str(error)
        return f"{detail}\nUsage: {spec.usage}" if detail else f"Usage: {spec.usage}"
    except ChatlaneError as error:  # an outage the gateway expects: no traceback
        log.warning("command /%s failed for %s: %s", spec.name, call.session_key, error)
        if _maybe_applied(call, error):  # its answer lost: the store may have kept it
            return f"/{spec.name} could not be confirmed: {shown_to_users(error)}."
        return f"/{spec.name} could not finish: {shown_to_users(error)}."
    except Exception:
        log.exception("command /%s failed for %s", spec.name, call.session_key)
        return f"/{spec.name} failed unexpectedly; the error was logged."


def _maybe_applied(call: CommandCall, error: ChatlaneError) -> bool:
    """Whether the store call that failed with ``error`` may have been made all the same."""
    return call.engine.store.may_have_applied(error)


# -- the built-in commands ---------------------------------------------------------


async def _stop(call: CommandCall) -> str:
    try:
        result = await call.engine.stop(call.session_key)
    except StopIncomplete as incomplete:
        log.warning("/stop could not drop the queue of %s: %s", call.session_key, incomplete)
        kept = incomplete.kept
        head = _stopped(incomplete.stopped_turn)
        if not kept:
            return f"{head} The rest could not finish: {incomplete}."
        waits = "It still waits." if kept == 1 else "They still wait."
        return f"{head} Could not drop {kept} queued {_messages(kept)}: {incomplete}. {waits}"
    dropped, elsewhere = len(result.dropped), result.dropped_elsewhere
    head = _stopped(result.stopped_turn)
    text = f"{head} Dropped {dropped} queued {_messages(dropped)}"
    if elsewhere:
        text += f", and {elsewhere} {_messages(elsewhere)} other gateway processes had taken"
    return text + "."


def _stopped(turn: bool) -> str:
    return "Stopped the running turn." if turn else "Nothing was running here."


def _messages(count: int) -> str:
    return "message" if count == 1 else "messages"


async def _queue(call: CommandCall) -> str:
    if not call.args:
        raise UsageError("/queue needs the text to queue.")
    message = InboundMessage(
        call.message.source, call.args, id=call.message.id, attachments=call.message.attachments
    )
    try:
        outcome = await call.engine.enqueue(call.session_key, message)
    except ChatlaneError as error:  # not queued; its outcome says so (failed)
        log.warning("/queue failed for %s: %s", call.session_key, error)
        return f"Could not queue it: {shown_to_users(error)}."
    if outcome is None:
        return "Nothing was running here, so it goes in now."
    state = call.engine.registry.get(call.session_key)
    full = outcome is BusyOutcome.QUEUE_FULL  # it says what the cap counted
    text = ack_text(outcome, waiting_here(state) if full else pending.pending_count(state))
    if full:
        raise CommandRefused(text, outcome)
    return text


async def _status(call: CommandCall) -> str:
    engine, key = call.engine, call.session_key
    state = await engine.session(key)
    turn = engine.running_turn(key)
    if turn is not None and state.turn.phase is SlotPhase.CLAIMED:
        activity = "waiting for the session (another gateway process runs it)"
    elif turn is not None:
        activity = f"running for {time.monotonic() - turn.started_at:.1f}s"
    elif state.turn.phase is SlotPhase.COLLECTING:
        activity = "collecting messages for the next turn"
    elif state.turn.phase is SlotPhase.ENDING:
        activity = "ending its conversation (what arrives now waits for the new one)"
    else:
        activity = "idle"
    policy = engine.policy_for(state, call.message)
    origin = "session" if state.persistent.busy_policy is not None else "default"
    steered = steered_here(state)
    waiting = f"queued: {waiting_here(state)}"  # what queue_cap counts, as "Queue full" says
    if steered:
        waiting += f" ({len(steered)} steered into the running turn, not taken yet)"
    lines = [
        f"Status: {activity}",
        f"generation: {state.persistent.run_generation}",
        waiting,
        *(_queued_line(seq, message, STEERED_MARK) for seq, message in steered),
        *(_queued_line(seq, message) for seq, message in pending.queued(state)),
        f"busy policy: {policy} ({origin})",
    ]
    return "\n".join(lines)


STEERED_MARK = " (steered into the running turn)"
"""How ``/status`` marks a message steered into the running turn that its agent has not
taken yet: it waits, and ``/unqueue`` takes it back, as a queued one."""


def _queued_line(seq: int, message: InboundMessage, mark: str = "") -> str:
    """One waiting message: its short id (for ``/unqueue``), its age, its author, its start,
    and ``mark``."""
    age = max(0, round(time.time() - message.received_at))
    source = message.source
    author = source.user_name or source.user_id or source.chat_name or "someone"
    return f"  #{seq} {age}s {author}: {pending.preview(message)}{mark}"


_SHORT_ID = re.compile(r"#?(\d{1,18})")


async def _unqueue(call: CommandCall) -> str:
    found = _SHORT_ID.fullmatch(call.args.strip())
    if found is None:
        raise UsageError("/unqueue needs the #id of a waiting message, as /status lists it.")
    seq = int(found.group(1))
    state = call.engine.registry.peek(call.session_key)
    steered = state is not None and any(s == seq for s, _ in steered_here(state))
    try:
        message = await call.engine.unqueue(call.session_key, seq)
    except TakenElsewhere:
        where = "the turn another gateway process runs took it in first"
        return f"Could not take #{seq} back: {where}; its answer comes from there."
    except ChatlaneError as error:
        log.warning("/unqueue #%d failed for %s: %s", seq, call.session_key, error)
        return f"Could not take #{seq} out of the queue ({shown_to_users(error)}); it still waits."
    if message is None:
        return f"No message #{seq} waits here (/status lists the queue)."
    if steered:  # its agent never gets it
        where = "back from the running turn (its agent had not taken it)"
        return f"Took #{seq} {where}: {pending.preview(message)}; its sender was told."
    return f"Took #{seq} out of the queue: {pending.preview(message)}; its sender was told."


async def _busy(call: CommandCall) -> str:
    engine, key = call.engine, call.session_key
    if not call.args:
        state = await engine.fresh_session(key)
        return f"Busy policy: {engine.policy_for(state, call.message)}"
    state = await engine.session(key)
    if call.args.lower() == "default":
        await engine.persist(key, **{BUSY_POLICY: None})
        return f"Busy policy reset to the default ({engine.policy_for(state, call.message)})."
    policy = BusyPolicy.parse(clipped(call.args, SHOWN), what="/busy")  # a refusal repeats it
    await engine.persist(key, **{BUSY_POLICY: policy})
    return f"Busy policy for this session: {policy}"


async def _btw(call: CommandCall) -> str:
    question = call.args.strip()
    if not question:
        raise UsageError("/btw needs a question.")
    state = await call.engine.session(call.session_key)
    try:
        call.engine.asides.ask(state, call.message, question)
    except TooManyAsides as error:
        return f"Not answered: {error}."
    return ""  # the side answer replies when it is ready


async def _needs_text(call: CommandCall) -> str:
    raise UsageError("This command sends its text as a message: give the text.")


async def _cancelled(call: CommandCall) -> str:
    return "Cancelled; nothing changed."


async def _unclear(call: CommandCall) -> str:
    return (
        "Not done: an approval and your last command were both waiting for a yes or no, "
        "so that answered neither. Answer the approval with /approve or /deny; "
        f"send {call.args} to go ahead with the command."
    )


async def _help(call: CommandCall) -> str:
    return call.router.help_text()


GREETING = "Hello! Send a message and the agent answers it."
"""The first line of the answer to ``/start``."""


async def _start(call: CommandCall) -> str:
    return f"{GREETING}\n\n{call.router.help_text()}"


BUILTIN_COMMANDS = (
    CommandSpec(
        "stop",
        "stop the running turn and drop queued messages",
        "/stop",
        CommandBusy.DISPATCH,
        _stop,
    ),
    CommandSpec(
        "queue",
        "queue text as its own turn",
        "/queue <text>",
        CommandBusy.DISPATCH,
        _queue,
        queues_message=True,
    ),
    CommandSpec(
        "steer",
        "hand the text to the running turn (queued if it cannot take it)",
        "/steer <text>",
        CommandBusy.DISPATCH,
        _needs_text,
        sends_as="steer",
    ),
    CommandSpec(
        "now",
        "send the text now: the running turn is rolled back (redirected, under redirect)",
        "/now <text>",
        CommandBusy.DISPATCH,
        _needs_text,
        sends_as=NOW,
    ),
    CommandSpec(
        "btw",
        "a side question, answered beside the running turn without touching it",
        "/btw <question>",
        CommandBusy.DISPATCH,
        _btw,
    ),
    CommandSpec(
        "status",
        "show whether a turn runs, the generation and each waiting message",
        "/status",
        CommandBusy.DISPATCH,
        _status,
    ),
    CommandSpec(
        "unqueue",
        "take one waiting message out of the queue (its sender is told)",
        "/unqueue #<id>",
        CommandBusy.DISPATCH,
        _unqueue,
    ),
    CommandSpec(
        "busy",
        "set what happens to messages sent while a turn runs",
        "/busy [queue|collect|rollback|redirect|steer|reject|default]",
        CommandBusy.DISPATCH,
        _busy,
    ),
    CommandSpec("help", "list every command", "/help", CommandBusy.DISPATCH, _help),
    CommandSpec(
        "start",
        "a greeting and /help: the first message Telegram sends for a new user (its Start)",
        "/start",
        CommandBusy.DISPATCH,
        _start,
        hidden=True,
    ),
    CommandSpec(
        "cancelled",
        "(internal) answer to a declined confirmation",
        "no",
        CommandBusy.DISPATCH,
        _cancelled,
        hidden=True,
    ),
    CommandSpec(
        "unclear",
        "(internal) answer to a yes or no that two questions were waiting for",
        "yes",
        CommandBusy.DISPATCH,
        _unclear,
        hidden=True,
    ),
)
"""The commands every gateway has; all of them work while a turn runs."""


def default_router(options: LifecycleOptions | None = None) -> CommandRouter:
    """A router with every built-in command: turn control, conversations, overrides, approvals."""
    from chatlane.scheduling.chat import CRON_COMMAND
    from chatlane.session_commands import SESSION_COMMANDS

    return CommandRouter((*BUILTIN_COMMANDS, *SESSION_COMMANDS, CRON_COMMAND), options)


__all__ = [
    "BUILTIN_COMMANDS",
    "GREETING",
    "SHOWN",
    "CommandBusy",
    "CommandCall",
    "CommandHandler",
    "CommandRouter",
    "CommandSpec",
    "ParsedCommand",
    "UsageError",
    "default_router",
    "parse_command",
    "quoted",
]
