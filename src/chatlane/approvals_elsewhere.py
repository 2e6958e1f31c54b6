"""Approvals answered in another process than the one whose turn asked them.

Several processes may share one store, and a session's messages may reach any
of them; a request waits (a future) in the process whose turn asked it. Its
answer goes through the store, as an interrupt or a redirect does:

* The asking process keeps the session's :data:`APPROVALS_WAITING` field as its
  turn's waiting requests, oldest first (id, holder, generation, asker,
  command), written fenced by the turn's generation when a request opens and
  again when it ends.
* A process that gets ``/approve``, ``/deny`` or a plain yes or no for a session
  with no request of its own, while another process holds its lease, reads that
  field: only a request of the lease holder's, at the session's current
  generation, is waiting. Its asker's answer is recorded in
  :data:`APPROVAL_ANSWERS` under the request's id — ids are unique, so an
  answer never reaches another request — and the sender is told it was passed on.
* The asking process reads :data:`APPROVAL_ANSWERS` for its turns that wait on a
  request at each fence check, and resolves each answered request exactly as a
  local answer (the same checks: only the asker, not after the deadline, not for
  a superseded turn; the same grants, ``always`` kept in the store first), then
  tells the chat what it decided.
* An answer keeps who gave it (``user_id``), and is applied as theirs: in a shared
  session its ``session`` or ``always`` grant is bound to that user there, exactly
  as if they had answered in that process.

No other message reads these fields: only an approval answer that found no
request where it arrived, and the fence check of a turn that waits on one.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from chatlane.errors import ChatlaneError, StoreError
from chatlane.state import SessionState
from chatlane.stores.base import Store
from chatlane.stores.fields import APPROVAL_ANSWERS, APPROVALS_WAITING
from chatlane.types import SessionKey

if TYPE_CHECKING:
    from chatlane.approvals import ApprovalRequest  # its module uses this one

log = logging.getLogger("chatlane.approvals")

_RECORD_TRIES = 3
"""How often an answer is written again when another answer written at once replaced it."""


class Waiting(msgspec.Struct, frozen=True):
    """A request waiting in the process ``holder``, as :data:`APPROVALS_WAITING` keeps it."""

    id: str
    holder: str
    generation: int
    user_id: str | None
    command: str


class Answer(msgspec.Struct, frozen=True):
    """An answer given in another process, as :data:`APPROVAL_ANSWERS` keeps it."""

    approved: bool
    grant: str | None
    """A :class:`~chatlane.approvals.Grant` by value."""
    note: str
    user_id: str | None
    """Who answered: the asker, or anyone for a request without one. A grant the answer
    carries is bound to this user in a shared session."""


class Meant(msgspec.Struct, frozen=True):
    """Which waiting requests an answer names: all, one turn's, or one request."""

    everything: bool
    generation: int | None = None
    request_id: str | None = None

    def names(self, request: Waiting) -> bool:
        return (self.generation is None or request.generation == self.generation) and (
            self.request_id is None or request.id == self.request_id
        )


def waiting_now(state: SessionState, holder: str, generation: int) -> list[dict[str, Any]]:
    """The turn of ``generation``'s requests still waiting here, oldest first, as stored."""
    requests: Sequence[ApprovalRequest] = list(state.turn.approval_requests.values())
    return [
        msgspec.to_builtins(Waiting(r.id, holder, r.generation, r.user_id, r.command))
        for r in requests
        if r.generation == generation and not r.decided.done()
    ]


def _waiting(fields: Mapping[str, object]) -> list[Waiting]:
    try:
        return msgspec.convert(fields.get(APPROVALS_WAITING) or [], list[Waiting])
    except msgspec.ValidationError:
        return []


def _answers(fields: Mapping[str, object]) -> dict[str, Answer]:
    try:
        return msgspec.convert(fields.get(APPROVAL_ANSWERS) or {}, dict[str, Answer])
    except msgspec.ValidationError:
        return {}


async def waiting_elsewhere(store: Store, holder: str, key: SessionKey) -> list[Waiting]:
    """The requests waiting for an answer in the process that runs ``key``, if that is
    not ``holder``: of the lease holder's, at the session's current generation.

    One read of the store (the lease) while no other process runs ``key``; two more,
    made together, while one does. One that fails counts as nothing waiting there
    (logged): the answer is then handled here.
    """
    try:
        running = await store.lease_holder(key)
        if running is None or running == holder:
            return []
        fields, generation = await asyncio.gather(store.load_persistent(key), store.generation(key))
    except ChatlaneError as error:
        log.warning("could not read the approvals waiting elsewhere: %s", error)
        return []
    return [w for w in _waiting(fields) if w.holder == running and w.generation == generation]


async def record_answers(
    store: Store, key: SessionKey, waiting: set[str], given: dict[str, Answer]
) -> None:
    """Add ``given`` to the session's answers, keeping only those of ``waiting``
    requests; written again if an answer written at once replaced it.

    :raises ChatlaneError: the store could not be reached.
    :raises StoreError: other answers kept replacing it.
    """
    for _ in range(_RECORD_TRIES):
        fields = await store.load_persistent(key)
        kept = {i: a for i, a in _answers(fields).items() if i in waiting}
        await store.set_persistent(
            key, None, **{APPROVAL_ANSWERS: msgspec.to_builtins({**kept, **given})}
        )
        stored = _answers(await store.load_persistent(key))
        if all(stored.get(i) == a for i, a in given.items()):
            return
    raise StoreError("other answers written at once kept replacing it")


def answers_for(fields: Mapping[str, object], state: SessionState) -> list[tuple[str, Answer]]:
    """The stored answers to requests waiting in ``state``, oldest request first."""
    answers = _answers(fields)
    return [(i, answers[i]) for i in state.turn.approval_requests if i in answers]


__all__ = [
    "Answer",
    "Meant",
    "Waiting",
    "answers_for",
    "record_answers",
    "waiting_elsewhere",
    "waiting_now",
]
