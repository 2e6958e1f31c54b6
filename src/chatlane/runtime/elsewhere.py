"""Busy policies for a session another process is running.

A turn that waits for a lease another process holds learns, from its first
refused acquire, that its session is busy elsewhere. What stays true:

* Only a fresh message (one that found its session idle here) gets its busy
  policy; internal events, ``/queue``\\ d messages, re-runs and adopted
  messages were accepted to run, so they wait for the lease whatever the
  policy says.
* ``reject`` refuses the message; ``rollback`` interrupts the other
  process's turn (within that process's fence check) and the message runs
  after it, behind whatever that process had queued first, as it would
  locally; ``redirect`` asks that turn to stop at its next safe point
  (below) and the message runs after it; ``queue``, ``collect`` and
  ``steer`` let it wait its turn, and under ``collect`` and ``steer`` the
  running process draws it in meanwhile (below). The interrupt depth counts
  this process's interrupts (and redirects) of the session.
* A ``redirect`` is told through the store too, without fencing: the
  redirecting process records the running generation as the session's
  ``redirect_generation`` field; the running process reads that field for
  its running turns at each fence check and redirects the turn whose
  generation it names, which then commits what it did under its own fence.
  The message waits for the lease meanwhile, and runs next.
* An interrupt is told through the store, never by a message between
  processes: the interrupting process records the generation it interrupts
  as the session's ``interrupted_generation`` field (a write fenced by that
  generation), then bumps the generation. The running process sees the bump
  (at a fence check, or as a refused commit), reads the field, and ends its
  turn as *interrupted* (its messages are done, not re-run) when the field
  names that turn's generation; any other bump is a lost lease. A waiting
  message applies its policy once, however many refusals it meets.
* Under ``steer`` and ``collect`` a message reaches the turn another
  process runs through the store: at each fence check that process reads
  the queue of each of its running turns whose session steers or collects,
  and *draws in* the messages other processes accepted for it since the
  turn started (:func:`draw_in`): it adopts them (each record changes owner
  atomically, so a message is drawn by one process, once) and steers or
  collects them as if they had arrived there. The process that accepted a
  drawn message finds it owned by another when its own turn gets the lease
  (:func:`waited_in_vain`, the check of the queue a turn makes after waiting
  for another process's lease) and watches it until the store holds its answer.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import Callable, Sequence

from chatlane.errors import ChatlaneError, StoreError
from chatlane.logs import turn_fields
from chatlane.runtime import pending
from chatlane.runtime.busy import BusyContext, BusyOutcome, BusyPolicy, decide
from chatlane.runtime.ending import TurnEnd
from chatlane.runtime.outcomes import OutcomeLedger
from chatlane.runtime.turn import Turn
from chatlane.state import SessionState
from chatlane.stores.base import PendingRecord, Store
from chatlane.stores.codec import decode_message
from chatlane.stores.fields import INTERRUPTED_GENERATION, REDIRECT_GENERATION
from chatlane.types import InboundMessage, SessionKey

log = logging.getLogger("chatlane.runtime")


def outcome_elsewhere(
    policy: BusyPolicy,
    state: SessionState,
    turn: Turn,
    message: InboundMessage,
    *,
    queue_cap: int,
    depth: int,
) -> BusyOutcome:
    """What ``policy`` makes of ``turn``'s ``message`` while another process runs the session.

    Only :attr:`BusyOutcome.REJECTED`, :attr:`BusyOutcome.INTERRUPTING` and
    :attr:`BusyOutcome.REDIRECTING` call for action; every other outcome means
    the message waits.
    """
    if message.internal or not turn.refusable:
        return BusyOutcome.QUEUED
    remote = BusyContext(
        queued=0,
        queue_cap=queue_cap,
        steers_waiting=0,
        internal=False,
        agent_accepts_steering=False,
        from_turn_author=True,
        interrupt_streak=state.conversation.interrupt_streak,
        interrupt_depth=depth,
        already_interrupted=False,
        winding_down=False,
    )
    return decide(policy, remote)


async def interrupt_elsewhere(store: Store, key: SessionKey) -> int:
    """Mark the turn running ``key`` elsewhere as interrupted and fence it; return its generation.

    The mark is a write fenced by the generation it names, so it names the
    generation that was current when it was written, never one that had
    moved on; the bump follows it. A generation that moved between the two
    (that turn committed and another took the lease, in that moment) is
    fenced as a lost lease: its messages run again, never twice at once.

    :raises StaleGeneration: the generation moved on before the mark (nothing changed).
    :raises ChatlaneError: if the store cannot be reached (nothing may have changed).
    """
    running = await store.generation(key)
    await store.set_persistent(key, running, **{INTERRUPTED_GENERATION: running})
    bumped = await store.bump_generation(key)
    if bumped != running + 1:
        log.warning("the generation moved on while interrupting", extra=turn_fields(key, bumped))
    return running


async def was_interrupted_elsewhere(store: Store, turn: Turn) -> bool:
    """Whether another process fenced ``turn`` to interrupt it (rather than taking its lease).

    :raises ChatlaneError: if the store cannot be read.
    """
    fields = await store.load_persistent(turn.session_key)
    return fields.get(INTERRUPTED_GENERATION) == turn.generation


async def redirect_elsewhere(store: Store, key: SessionKey) -> int:
    """Ask the turn running ``key`` elsewhere to stop at a safe point; return its generation.

    Nothing is fenced: that turn commits what it did before the lease is free.

    :raises ChatlaneError: if the store cannot be reached (nothing may have changed).
    """
    running = await store.generation(key)
    await store.set_persistent(key, None, **{REDIRECT_GENERATION: running})
    return running


async def redirected_elsewhere(store: Store, turns: Sequence[Turn]) -> list[Turn]:
    """Those of ``turns`` (running here) another process asked to redirect.

    :raises ChatlaneError: if the store cannot be read.
    """
    stored = await asyncio.gather(*(store.load_persistent(t.session_key) for t in turns))
    return [
        turn
        for turn, fields in zip(turns, stored, strict=True)
        if fields.get(REDIRECT_GENERATION) == turn.generation
    ]


async def draw_in(
    store: Store,
    holder: str,
    turn: Turn,
    known: set[int],
    wanted: Callable[[InboundMessage], bool],
) -> list[tuple[InboundMessage, int]]:
    """Adopt, for ``holder``, the messages other processes accepted for ``turn``'s session
    since it started and ``wanted`` would steer or collect; them and their seqs, in store order.

    ``known`` are the seqs this process already holds for the session (they
    are never drawn). A record that cannot be read stays its owner's. Each
    record is adopted only from the owner it was read with, so of two
    processes drawing (or one drawing while its owner gives it up) one gets it;
    and only while the session's generation is still ``turn``'s, so a turn
    whose lease another process took (its own renewal not yet refused) draws
    nothing.

    :raises ChatlaneError: the store could not be asked (what was adopted is returned
        only if every adoption was answered).
    """
    first = min(turn.seqs)
    candidates: dict[str, list[tuple[InboundMessage, int]]] = defaultdict(list)
    for record in await store.pending(turn.session_key):
        if record.owner == holder or record.seq <= first or record.seq in known:
            continue
        message = _readable(record)
        if message is not None and not message.internal and wanted(message):
            candidates[record.owner].append((message, record.seq))
    drawn: list[tuple[InboundMessage, int]] = []
    for owner, found in candidates.items():
        seqs = [seq for _, seq in found]
        fence = turn.generation
        adopted = set(await store.adopt(turn.session_key, seqs, owner, holder, generation=fence))
        drawn += [(message, seq) for message, seq in found if seq in adopted]
    return sorted(drawn, key=lambda pair: pair[1])


def _readable(record: PendingRecord) -> InboundMessage | None:
    try:
        return decode_message(record.payload)
    except StoreError:
        return None  # its owner sets it aside when it comes to run it


async def waited_in_vain(turn: Turn, store: Store, holder: str, outcomes: OutcomeLedger) -> bool:
    """Whether ``turn``'s messages left this process while it waited: another
    process's ``/stop`` or ``/new`` dropped them, or its running turn drew them in.

    Asked only when the turn waited for a lease another process held, the
    generation moved on elsewhere meanwhile, or the turn runs messages drawn
    in from another process (which may have dropped them since, and told
    their senders they will not run): one read of the store's queue (if it
    fails, the turn runs).
    Only a message the store still queues as this process's (or a dead
    one's, :func:`still_ours`) is still its own: every other one, the
    turn's, steered into it while it waited, or queued here behind it, is
    watched until the store says what became of it (answered there, or
    dropped).
    A turn left without its own messages, or whose messages span one a
    live process holds (drawn in there: it must run first), ends unrun as
    :data:`TurnEnd.DROPPED`; those still its own wait here again, each its
    own turn in store order (a later one then waits for the one held there).
    """
    state = turn.session_state
    known = pending.known(state).union(seq for _, seq in turn.waiting_steers())
    try:
        alive, held = await still_ours(store, holder, state.key)
    except ChatlaneError as error:
        log.warning("could not check the queue: %s", error, extra=turn_fields(state.key))
        return False
    alive = pending.or_kept(state, alive)
    if not alive.issuperset(known):
        left = pending.keep_only(state, alive, known) + turn.keep_steers(alive, known)
        outcomes.watch(message.id for message in left)
    first, last = min(turn.seqs), max(turn.seqs)
    spans = any(first < seq < last for seq in held)
    if not spans and all(seq in alive for seq in turn.seqs):
        return False
    for message, seq in zip(turn.messages, turn.seqs, strict=True):
        if seq in alive:
            pending.insert_in_order(state, [message], [seq])
        else:
            outcomes.watch([message.id])
    turn.end(TurnEnd.DROPPED)
    log.info("dropped elsewhere while waiting", extra=turn_fields(state.key))
    return True


async def drop_still_ours(
    store: Store,
    outcomes: OutcomeLedger,
    holder: str,
    key: SessionKey,
    messages: Sequence[tuple[str, int]],
) -> set[int]:
    """Drop those of ``messages`` (id and seq each) the store still holds as ``holder``'s,
    or as a process's whose heartbeat expired (one this process took a request over
    from, :func:`still_ours`), at once; their seqs. The others left while they waited —
    another process's running turn drew them in, even answered them — and are watched
    until the store says what became of them.

    A dead process's record is adopted before it is dropped, from the owner it was
    read with: of two processes dropping or adopting it, one gets it.

    :raises ChatlaneError: the store could not drop them.
    """
    seqs = [seq for _, seq in messages]
    own = set(await store.drop_own(key, seqs, holder))
    if len(own) < len(seqs):
        own |= await _drop_orphans(store, holder, key, {seq for seq in seqs if seq not in own})
    outcomes.watch(message_id for message_id, seq in messages if seq not in own)
    return own


async def _drop_orphans(store: Store, holder: str, key: SessionKey, seqs: set[int]) -> set[int]:
    """Drop those of ``seqs`` a process whose heartbeat expired still owns; their seqs.

    :raises ChatlaneError: the store could not be asked.
    """
    owners: dict[str, list[int]] = defaultdict(list)
    for record in await store.pending(key):
        if record.seq in seqs and record.owner != holder:
            owners[record.owner].append(record.seq)
    if not owners:
        return set()  # gone already: answered, or dropped, elsewhere
    live = await store.alive(sorted(owners))
    dropped: set[int] = set()
    for owner, found in owners.items():
        if not live.get(owner, False):
            adopted = await store.adopt(key, found, owner, holder)
            dropped.update(await store.drop_own(key, adopted, holder) if adopted else ())
    return dropped


async def still_ours(store: Store, holder: str, key: SessionKey) -> tuple[set[int], set[int]]:
    """The seqs of ``key``'s queued messages this process may still run — its own, and
    those of a process whose heartbeat expired (taken over, as a request sent again
    here with the same idempotency key is) — and those a live process holds: it
    drew them in, adopted them, or runs them.

    :raises ChatlaneError: the store could not be read.
    """
    records = await store.pending(key)
    others = sorted({record.owner for record in records} - {holder})
    live = await store.alive(others) if others else {}
    held = {record.seq for record in records if live.get(record.owner, False)}
    return {record.seq for record in records} - held, held
