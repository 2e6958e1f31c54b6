"""Approvals for dangerous tool calls, tied to a session, a generation and a user.

A tool asks ``await turn.request_approval(command, reason)`` (or, from a
worker thread, ``turn.request_approval_threadsafe(...)``); the user gets a
prompt in the same chat and thread and answers ``/approve`` or ``/deny`` — or
a plain "yes"/"no" while a request is pending. What stays true:

* A request belongs to one session, one generation and one user: another
  chat cannot see it, another user in a group cannot grant it, and a request
  of a superseded turn is denied, never granted.
* Every request ends: approved, denied, timed out (counts as denied), or
  denied at once when its conversation ends — a blocked tool call always returns.
* A request ends once: the first of answer, timeout and end of turn takes it
  out of the pending set before anything is awaited, so an answer that comes
  after the deadline (even while the timeout notice is still being sent) is
  refused and grants nothing.
* Grants: ``once`` (this request), ``session`` (matching commands until the
  conversation ends), ``always`` (a pattern kept in the store's allowlist).
* A grant is an answer given in advance, so it is bound as an answer is: in a
  shared session (:func:`~chatlane.identity.is_shared`) a ``session`` or
  ``always`` grant is its giver's, and approves that user's turns only; a grant
  bound to no one (every grant of a session of one person, every entry kept
  before grants were bound) approves no turn of a shared session.
* A request waits in the process whose turn asked it; an answer that reaches
  another process goes there through the store (:mod:`chatlane.approvals_elsewhere`)
  and is resolved there exactly as a local one.
* A prompt and the notices about it reach the adapter with their turn's session
  bound, wherever they were asked or answered from (a worker thread, the upkeep
  loop applying an answer given elsewhere).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from chatlane import approvals_elsewhere as elsewhere
from chatlane.context import bind_session
from chatlane.errors import ChatlaneError, InvalidSessionKey, shown_to_users
from chatlane.identity import is_shared
from chatlane.logs import turn_fields
from chatlane.runtime.persisted import encode_user_grants
from chatlane.state import SessionState, UserGrant
from chatlane.stores.base import Store
from chatlane.stores.fields import APPROVAL_ALLOWLIST, APPROVAL_ALLOWLIST_BY_USER, APPROVALS_WAITING
from chatlane.types import Asks, Outbound, OutboundKind, SessionKey

if TYPE_CHECKING:
    from chatlane.runtime.outlet import Outlet
    from chatlane.runtime.slots import Slots

log = logging.getLogger("chatlane.approvals")


_NOT_PENDING = "That approval is no longer pending (it was answered, or its turn ended)."
_NOT_YOURS = "Only the person whose message started this turn can answer its approval."
_TOO_LATE = "Too late: the approval for {command} timed out — denied."
_NOT_KEPT = "it could not be kept for always (the store is unavailable); ask again later"
_NO_GIVER = (
    "it is not kept for later: in a shared session a grant is its giver's, and this answer "
    "came from no known user"
)


def new_request_id() -> str:
    """A request id no other request shares, across processes and restarts (``a`` + 8 hex)."""
    return f"a{secrets.token_hex(4)}"


def is_request_id(text: str) -> bool:
    """Whether ``text`` has the shape :func:`new_request_id` gives (what buttons send)."""
    return _REQUEST_ID.fullmatch(text) is not None


_REQUEST_ID = re.compile(r"a[0-9a-f]{1,32}")


class Grant(enum.StrEnum):
    """How far an approval reaches."""

    ONCE = "once"
    SESSION = "session"
    ALWAYS = "always"


@dataclass(frozen=True, slots=True)
class Decision:
    """How a request ended."""

    approved: bool
    grant: Grant | None = None
    note: str = ""


@dataclass(slots=True)
class ApprovalRequest:
    """One pending request; lives in its turn's slot (``turn.approval_requests``) until it ends."""

    id: str
    session_key: SessionKey
    generation: int
    user_id: str | None
    command: str
    reason: str
    decided: asyncio.Future[Decision] = field(repr=False)
    deadline: float = 0.0
    """The event loop's ``time()`` after which no answer is taken (the timeout)."""

    def expired(self) -> bool:
        """Whether the deadline passed: an answer now is refused, whatever is still sent."""
        return asyncio.get_running_loop().time() >= self.deadline


IsCurrent = Callable[[SessionKey, int], bool]
"""Whether a generation is still its session's current one."""


HOW_TO_ANSWER = (
    "Reply /approve (or yes) to allow once, /approve session or /approve always "
    "to allow it again, /deny (or no) to refuse."
)
"""The last line of every approval prompt."""

UNBREAKABLE_BACKTICK = "`\u200b"
"""A backtick followed by a zero-width space: no run of them closes a code block."""


def quote_command(command: str) -> str:
    """``command`` quoted as code in a notice, so that no Markdown renders any of it.

    A command without backticks or line breaks goes in a code span
    (```` `ls -l` ````), which nothing in it can end. Any other command stands in
    a fenced block of its own lines, every backtick in it followed by a
    zero-width space (as in :func:`markdown_prompt`): a backtick would end a
    span, and a blank line the paragraph holding it, and the rest would be
    rendered — a spoiler or a link hiding part of what was decided.
    """
    if "`" not in command and "\n" not in command and "\r" not in command:
        return f"`{command}`"
    return f"\n{_fenced(command)}\n"


def _fenced(command: str) -> str:
    """``command`` alone in a fenced code block that nothing in it can close."""
    return f"```\n{command.replace('`', UNBREAKABLE_BACKTICK) or ' '}\n```"


def prompt_text(request: ApprovalRequest) -> str:
    """What the user sees when a tool asks for approval, as plain text."""
    why = f" — {request.reason}" if request.reason else ""
    return f"Approval needed: `{request.command}`{why}\n{HOW_TO_ANSWER}"


def asks_of(request: ApprovalRequest) -> Asks:
    """What ``request`` asks about, for adapters that render its prompt themselves."""
    return Asks(request.command, request.reason, request.user_id)


def markdown_prompt(asks: Asks, escape: Callable[[str], str] | None = None) -> str:
    """The prompt for a chat that renders Markdown, its command shown as it is.

    The command stands alone in a fenced code block, every backtick in it
    followed by a zero-width space, so no part of it can end the block and be
    rendered as formatting (a spoiler, a link, a heading) that would hide what
    the user is asked to allow; it looks the same. The reason is shown on one
    line, passed through ``escape`` (the platform's own Markdown escape) if given.
    """
    reason = " ".join(asks.reason.split())
    shown = escape(reason) if escape is not None else reason
    why = f" — {shown}" if reason else ""
    return f"Approval needed{why}\n{_fenced(asks.command)}\n{HOW_TO_ANSWER}"


def markdown_text(outbound: Outbound, escape: Callable[[str], str] | None = None) -> str:
    """``outbound``'s text for a chat that renders Markdown: an approval prompt made
    from what it asks (:func:`markdown_prompt`), anything else as it is."""
    asks = outbound.asks
    return outbound.text if asks is None else markdown_prompt(asks, escape)


class ApprovalBroker:
    """Creates, resolves and cleans up approval requests for one engine.

    :param slots: the engine's slots: which turn runs, and which generation is current.
    :param outlet: where prompts and timeout notices go.
    :param holder: this process's lease holder id, under which its waiting
        requests are kept in the store for other processes to answer.
    """

    def __init__(
        self, store: Store, slots: Slots, outlet: Outlet, timeout: float, holder: str = ""
    ) -> None:
        self._store = store
        self._slots = slots
        self._outlet = outlet
        self._is_current = slots.generation_is
        self.timeout = timeout
        self._holder = holder
        self._publishing = asyncio.Lock()
        """One write of waiting requests at a time, each of what waits when it starts."""

    async def request(
        self,
        state: SessionState,
        generation: int,
        user_id: str | None,
        command: str,
        reason: str,
    ) -> Decision:
        """Ask the session's user; return once approved, denied, timed out or cancelled."""
        if not self._is_current(state.key, generation):
            return Decision(False, note="the turn is no longer current")
        if _granted(state, user_id, command):
            return Decision(True, note="allowed by an earlier grant")
        request = self._open(state, generation, user_id, command, reason)
        try:
            await self._publish(state, generation)
            await self._notify(request, prompt_text(request), OutboundKind.APPROVAL)
            return await self._wait(state, request)
        finally:
            _close(state, request, Decision(False, note="its turn ended"))
            self._slots.spawn(self._publish(state, generation))

    async def _publish(self, state: SessionState, generation: int) -> None:
        """Keep in the store what the turn of ``generation`` waits for, for other
        processes to answer; fenced, so a superseded turn writes nothing.

        A write that fails is logged: answers then reach these requests only here.
        """
        async with self._publishing:
            waiting = elsewhere.waiting_now(state, self._holder, generation)
            try:
                await self._store.set_persistent(
                    state.key, generation, **{APPROVALS_WAITING: waiting}
                )
            except ChatlaneError as error:
                log.info("approvals not kept for other processes: %s", error)

    async def take_answers(self, states: list[SessionState]) -> None:
        """Resolve the requests of ``states`` that another process recorded answers to,
        as answers given here, and tell each chat what was decided.

        Asked at each fence check, only for sessions whose turn waits on a request.
        """
        try:
            stored = await asyncio.gather(*(self._store.load_persistent(s.key) for s in states))
        except ChatlaneError as error:
            log.warning("could not read the approvals answered elsewhere: %s", error)
            return
        for state, fields in zip(states, stored, strict=True):
            for request_id, answer in elsewhere.answers_for(fields, state):
                request = _requests(state).get(request_id)
                if request is None:
                    continue
                decision = Decision(answer.approved, _grant_of(answer.grant), answer.note)
                text = await self.resolve(
                    state, answer.user_id, decision, False, request_id=request_id
                )
                await self._notify(request, text, OutboundKind.NOTICE)

    async def pass_on(
        self,
        key: SessionKey,
        user_id: str | None,
        decision: Decision,
        meant: elsewhere.Meant,
    ) -> str | None:
        """Record ``decision`` from ``user_id`` for the requests waiting in the process
        that runs ``key``, when it is another one; it resolves them at its next fence check.

        Only for an answer that found no request waiting here.

        :returns: the reply for the user, or ``None`` when no request waiting
            elsewhere is named: the answer is then handled here.
        """
        waiting = await elsewhere.waiting_elsewhere(self._store, self._holder, key)
        named = [w for w in waiting if meant.names(w)]
        if not named:
            return None
        mine = [w for w in named if w.user_id in (None, user_id)]
        if not mine:
            return _NOT_YOURS
        chosen = mine if meant.everything else mine[:1]
        bound_to = _bound_to(key, user_id, decision)
        grant = decision.grant.value if decision.grant is not None else None
        answer = elsewhere.Answer(decision.approved, grant, decision.note, user_id)
        given = {w.id: answer for w in chosen}
        try:
            await elsewhere.record_answers(self._store, key, {w.id for w in waiting}, given)
        except ChatlaneError as error:
            log.warning("could not pass an approval answer on: %s", error)
            return f"Not answered: it could not be passed on ({shown_to_users(error)}); try again."
        return "\n".join(_passed_on(w.command, decision, bound_to) for w in chosen)

    async def waits_elsewhere(self, key: SessionKey) -> bool:
        """Whether a request waits for an answer in another process that runs ``key``."""
        return bool(await elsewhere.waiting_elsewhere(self._store, self._holder, key))

    def _open(
        self,
        state: SessionState,
        generation: int,
        user_id: str | None,
        command: str,
        reason: str,
    ) -> ApprovalRequest:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Decision] = loop.create_future()
        request = ApprovalRequest(
            new_request_id(), state.key, generation, user_id, command, reason, future
        )
        request.deadline = loop.time() + self.timeout
        state.turn.approval_requests[request.id] = request
        return request

    async def _wait(self, state: SessionState, request: ApprovalRequest) -> Decision:
        """The request's decision; at the timeout it is closed first, then the chat told."""
        remaining = request.deadline - asyncio.get_running_loop().time()
        try:
            return await asyncio.wait_for(asyncio.shield(request.decided), max(remaining, 0.0))
        except TimeoutError:
            if not _close(state, request, Decision(False, note="timed out")):
                return request.decided.result()  # answered just as the timer fired
            text = f"Approval for {quote_command(request.command)} timed out — denied."
            await self._notify(request, text, OutboundKind.NOTICE)
            return request.decided.result()

    async def _notify(self, request: ApprovalRequest, text: str, kind: OutboundKind) -> None:
        """Tell ``request``'s chat: the prompt (``APPROVAL``) or its timeout (``NOTICE``).

        Nothing is sent when no turn runs in the session, nor a prompt for a
        request already decided.
        """
        turn = self._slots.running_turn(request.session_key)
        if turn is None or (kind is OutboundKind.APPROVAL and request.decided.done()):
            log.info("approval prompt dropped: no turn", extra=turn_fields(request.session_key))
            return
        asking = kind is OutboundKind.APPROVAL
        ids, generation = turn.message_ids, request.generation
        key, source = request.session_key, turn.source
        # answered from another process (applied by the upkeep loop), too: the adapter sees
        # this session; sent from here, so a notice comes before what its turn says next
        with bind_session(source, session_key=key):
            await self._outlet.send(
                kind,
                key,
                source,
                text,
                ids,
                generation,
                approval_id=request.id if asking else "",
                asks=asks_of(request) if asking else None,
            )

    def has_pending(self, state: SessionState) -> bool:
        """Whether a request waits for an answer in this session."""
        return bool(_requests(state))

    def asked_by(self, state: SessionState, user_id: str | None) -> bool:
        """Whether a request of ``user_id``'s own (a known sender) waits in this session."""
        return user_id is not None and any(r.user_id == user_id for r in _requests(state).values())

    def pending(self, state: SessionState) -> list[ApprovalRequest]:
        """The requests waiting for an answer in this session, oldest first."""
        return list(_requests(state).values())

    async def resolve(
        self,
        state: SessionState,
        user_id: str | None,
        decision: Decision,
        everything: bool,
        *,
        generation: int | None = None,
        request_id: str | None = None,
    ) -> str:
        """Apply ``decision`` from ``user_id`` to the oldest (or every) pending request.

        ``request_id`` narrows the answer to that one request (what buttons
        send: a button on an old prompt never answers another request), and
        ``generation`` to the requests of that turn.

        :returns: the reply for the user.
        """

        def meant(request: ApprovalRequest) -> bool:
            return (generation is None or request.generation == generation) and (
                request_id is None or request.id == request_id
            )

        stale = [r for r in deny_stale(state, self._is_current) if meant(r)]
        waiting = [r for r in _requests(state).values() if meant(r)]
        if not waiting:
            told = [f"Denied: {quote_command(r.command)} — its turn was stopped" for r in stale]
            named = generation is not None or request_id is not None
            nothing = _NOT_PENDING if named else "No approval is pending."
            return "\n".join(told) or nothing
        mine = [r for r in waiting if r.user_id in (None, user_id)]
        if not mine:
            return _NOT_YOURS
        chosen = mine if everything else mine[:1]
        return "\n".join([await self._settle(state, r, decision, user_id) for r in chosen])

    async def _settle(
        self,
        state: SessionState,
        request: ApprovalRequest,
        decision: Decision,
        giver: str | None,
    ) -> str:
        """Close ``request`` with ``decision``, then record its grant as ``giver``'s;
        refused once it ended.

        The request is closed before the grant is written (an ``await``), so a
        timeout firing meanwhile finds it decided and cannot deny it.
        """
        if request.expired():
            _close(state, request, Decision(False, note="timed out"))
            return _TOO_LATE.format(command=quote_command(request.command))
        if not self._is_current(request.session_key, request.generation):
            decision = Decision(False, note="its turn was stopped")
        if not _close(state, request, decision):
            return _NOT_PENDING
        decision = await self._keep(state, request.command, decision, giver)
        bound_to = _bound_to(state.key, giver, decision)
        return _decided(request.command, decision, bound_to)

    async def _keep(
        self, state: SessionState, command: str, decision: Decision, giver: str | None
    ) -> Decision:
        """Record ``decision``'s ``session`` or ``always`` grant of ``command``, bound to
        ``giver`` in a shared session; the decision as it then stands: ``once``, said
        so, when the grant could not be kept (it was approved all the same)."""
        if not decision.approved or decision.grant not in (Grant.SESSION, Grant.ALWAYS):
            return decision
        bound: UserGrant | None = None
        if _shared(state.key):
            if giver is None:
                return Decision(True, Grant.ONCE, _NO_GIVER)
            bound = UserGrant(giver, command)
        if decision.grant is Grant.SESSION:
            _grant_for_conversation(state, command, bound)
            return decision
        kept = await (
            self._allow_always(state, command)
            if bound is None
            else self._allow_always_for(state, bound)
        )
        return decision if kept else Decision(True, Grant.ONCE, _NOT_KEPT)

    async def _allow_always_for(self, state: SessionState, grant: UserGrant) -> bool:
        """Keep ``grant`` on the session's allowlist of grants bound to users, in the store
        first; whether it was kept (a store that cannot take it leaves it as it was)."""
        persistent = state.persistent
        if grant in persistent.approval_allowlist_by_user:
            return True
        kept = encode_user_grants([*persistent.approval_allowlist_by_user, grant])
        try:
            await self._store.set_persistent(state.key, None, **{APPROVAL_ALLOWLIST_BY_USER: kept})
        except ChatlaneError as error:
            log.warning("could not keep an always-approval: %s", error)
            return False
        if grant not in persistent.approval_allowlist_by_user:
            persistent.approval_allowlist_by_user = (*persistent.approval_allowlist_by_user, grant)
        return True

    async def _allow_always(self, state: SessionState, command: str) -> bool:
        """Keep ``command`` on the session's allowlist bound to no one, in the store first;
        whether it was kept (a store that cannot take it leaves the allowlist as it was)."""
        allowlist = state.persistent.approval_allowlist
        if command in allowlist:
            return True
        try:
            await self._store.set_persistent(
                state.key, None, **{APPROVAL_ALLOWLIST: [*allowlist, command]}
            )
        except ChatlaneError as error:
            log.warning("could not keep an always-approval: %s", error)
            return False
        if command not in allowlist:
            allowlist.append(command)
        return True

    def end_conversation(self, state: SessionState) -> int:
        """Deny every pending request of ``state`` at once; return how many there were."""
        waiting = list(_requests(state).values())
        for request in waiting:
            if not request.decided.done():
                request.decided.set_result(Decision(False, note="the conversation ended"))
        state.turn.approval_requests.clear()
        return len(waiting)


def _shared(key: SessionKey) -> bool:
    """Whether several people write in the session ``key`` (:func:`~chatlane.identity.is_shared`).

    A key chatlane did not build (an application's own, a scheduled job's) names
    no chat it could judge: it counts as one person's, as every session did
    before grants were bound to their giver.
    """
    try:
        return is_shared(key)
    except InvalidSessionKey:
        return False


def _granted(state: SessionState, user_id: str | None, command: str) -> bool:
    """Whether an earlier grant approves ``command`` in a turn of ``user_id``'s.

    Exact commands, never patterns: ``rm -rf build/*`` is not ``rm -rf build/ ~/``.
    A grant bound to a user approves that user's turns only; one bound to no one,
    any turn of a session of one person, and none of a shared session.
    """
    if user_id is not None:
        mine = UserGrant(user_id, command)
        bound = (
            state.conversation.approval_grants_by_user,
            state.persistent.approval_allowlist_by_user,
        )
        if any(mine in grants for grants in bound):
            return True
    if _shared(state.key):
        return False
    unbound = (state.conversation.approval_grants, state.persistent.approval_allowlist)
    return any(command in grants for grants in unbound)


def _grant_for_conversation(state: SessionState, command: str, bound: UserGrant | None) -> None:
    """Allow ``command`` again until the conversation ends: to ``bound``'s user only, if given."""
    conversation = state.conversation
    if bound is None:
        conversation.approval_grants.append(command)
    elif bound not in conversation.approval_grants_by_user:
        conversation.approval_grants_by_user = (*conversation.approval_grants_by_user, bound)


def _bound_to(key: SessionKey, giver: str | None, decision: Decision) -> str | None:
    """Whose turns alone ``decision``'s grant approves: ``giver``'s, for a ``session`` or
    ``always`` grant in a shared session; ``None`` for any other decision."""
    lasting = decision.approved and decision.grant in (Grant.SESSION, Grant.ALWAYS)
    return giver if lasting and _shared(key) else None


def _grant_words(decision: Decision, bound_to: str | None) -> str:
    """How far an approval reaches, as replies say it: `` (always)``, `` (session, for
    `alice` only)``; nothing for a denial."""
    if not decision.approved or decision.grant is None:
        return ""
    whose = f", for {quote_command(bound_to)} only" if bound_to is not None else ""
    return f" ({decision.grant}{whose})"


def _decided(command: str, decision: Decision, bound_to: str | None) -> str:
    """The reply to an answer applied here: what was decided, and for whom it lasts."""
    verb = "Approved" if decision.approved else "Denied"
    note = f" — {decision.note}" if decision.note else ""
    return f"{verb}{_grant_words(decision, bound_to)}: {quote_command(command)}{note}"


def _grant_of(value: str | None) -> Grant | None:
    """The grant named ``value``; none for a name this version does not know."""
    try:
        return Grant(value) if value is not None else None
    except ValueError:
        return None


def _passed_on(command: str, decision: Decision, bound_to: str | None) -> str:
    """The reply to an answer recorded for the process that runs the turn."""
    verb = "approve" if decision.approved else "deny"
    extra = _grant_words(decision, bound_to)
    note = f" — {decision.note}" if decision.note else ""
    return (
        f"Passed on to the gateway process running this turn: {verb}{extra} "
        f"{quote_command(command)}{note}. That process tells this chat when it applies "
        "it (unless the request ended first)."
    )


def deny_stale(state: SessionState, is_current: IsCurrent) -> list[ApprovalRequest]:
    """Deny at once the requests of turns that are no longer current; return them.

    Called when a turn is superseded, so its tool call returns and its
    request can never take an answer meant for a newer one.
    """
    stale = [r for r in _requests(state).values() if not is_current(r.session_key, r.generation)]
    for request in stale:
        _close(state, request, Decision(False, note="its turn was stopped"))
    return stale


def end_turn_requests(state: SessionState, generation: int) -> None:
    """Deny at once what the turn of ``generation`` still waits for: it has ended.

    Runs after every turn; a session without requests is left as it was.
    """
    requests = _requests(state)
    if not requests:
        return
    for request in [r for r in requests.values() if r.generation == generation]:
        _close(state, request, Decision(False, note="its turn ended"))


def _requests(state: SessionState) -> dict[str, ApprovalRequest]:
    """The session's waiting requests (its running turn's)."""
    requests: dict[str, ApprovalRequest] = state.turn.approval_requests
    return requests


def _close(state: SessionState, request: ApprovalRequest, decision: Decision) -> bool:
    """End ``request`` with ``decision`` unless it already ended; whether this call ended it.

    No ``await`` between the check and the close: whoever closes first decides.
    """
    _forget(state, request)
    if request.decided.done():
        return False
    request.decided.set_result(decision)
    return True


def _forget(state: SessionState, request: ApprovalRequest) -> None:
    state.turn.approval_requests.pop(request.id, None)


__all__ = [
    "HOW_TO_ANSWER",
    "UNBREAKABLE_BACKTICK",
    "ApprovalBroker",
    "ApprovalRequest",
    "Decision",
    "Grant",
    "asks_of",
    "deny_stale",
    "end_turn_requests",
    "is_request_id",
    "markdown_prompt",
    "markdown_text",
    "new_request_id",
    "prompt_text",
    "quote_command",
]
