"""Leases for turns: taking a session's lease, keeping it alive, and giving it back.

The :class:`LeaseKeeper` is the engine's only path to the store's leases.
What stays true:

* A turn runs only under a lease; the lease's generation becomes the turn's
  generation, so the store refuses the writes of any turn it has fenced off.
* Every lease a process holds is renewed in one store call
  (:meth:`~chatlane.stores.base.Store.renew_many`) every
  :attr:`LeaseSettings.renew_every` seconds (``ttl / 10``), beside the
  process's heartbeat and never behind other store work. A renewal the store
  refuses marks the turn lost at once. A renewal the store cannot answer
  (an outage) changes nothing until the lease's expiry passes on this host's
  clock; from then the turn is stale (a process paused past its TTL fences
  itself before it can deliver anything).
* Each lease is released exactly once, through ``TurnState.lease_tokens``
  keyed by generation: a displaced turn's unwind frees only its own lease.
  A release the store could not answer leaves the token (and the lease)
  held here, so that trying again releases it.
  A turn that answers releases its lease in the commit that records the
  answer (:meth:`LeaseKeeper.commit_and_release`), and its entry is settled
  there; every other ending releases it afterwards, as before.
* A turn waiting for a lease another process holds asks again after its poll
  delay (doubling up to ``max_poll``), or as soon as the store wakes it
  (:class:`~chatlane.stores.protocols.Wakeups`, where the store has them):
  a wake-up only shortens the wait, so a lost one delays, never strands, a turn.
* A message to a session idle here takes the session's lease in the store
  call that queues it (:meth:`LeaseKeeper.admit`), and a turn that waits for
  it reads the session's stored choices with it: a turn costs two store
  calls, from the message's arrival to its answer.
* Every acquisition asks with a token of its own, the same for each of its
  tries: a try whose answer was lost (Redis, PostgreSQL) never holds the
  session against the next one, and what it may have taken is given back
  when the acquisition ends without it (:mod:`~chatlane.runtime.withdrawals`).
* A process waits for its own release of a session's lease to be answered
  before it asks for that lease again (:meth:`LeaseKeeper.acquire`): on a
  store with several connections the request could otherwise overtake the
  release, and a turn here would be refused its session by a lease of its own
  process, and taken for one running elsewhere (its busy policy applied, its
  sender told "busy").
* While this process draws another process's messages into a session's
  running turn (:meth:`LeaseKeeper.drawing`), that session's lease is not
  released here: the drawn messages change owner while the lease is held,
  so the process that gave them up cannot take the lease and run them first.
* A conversation boundary that finds its session's lease free takes it for
  its whole length (:meth:`LeaseKeeper.hold_for_boundary`; another boundary
  here for the same session joins it), so that no process starts a turn for
  the session meanwhile; it is renewed with the turns' leases until a renewal
  is refused (another process's ``/stop`` or interrupt fenced it: from then
  it no longer counts as held, :meth:`LeaseKeeper.holding`), and released
  once, when the last of its boundaries ends or the engine closes
  (:meth:`LeaseKeeper.let_go_of_boundary`).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from asyncio import Future
from collections.abc import Awaitable, Callable, Iterable, Iterator
from contextlib import closing, contextmanager, suppress
from dataclasses import dataclass

from chatlane.errors import (
    ActiveSessionLimit,
    ChatlaneError,
    LeaseError,
    LeaseLost,
    SessionBusy,
    StoreError,
)
from chatlane.logs import turn_fields
from chatlane.runtime.backoff import MAX_DELAY, retry_store, retryable
from chatlane.runtime.settings import LeaseSettings
from chatlane.runtime.withdrawals import Withdrawals
from chatlane.state import SessionState
from chatlane.stores.base import Admission, Lease, Store, Taken, WriteBatch
from chatlane.stores.ids import new_token
from chatlane.stores.protocols import Wakeups, Watch
from chatlane.types import SessionKey

log = logging.getLogger("chatlane.runtime")


def new_holder_id() -> str:
    """A process's identity in the store: unique per process start."""
    return f"h-{secrets.token_hex(6)}"


class AcquireWait:
    """Why a turn is still waiting for its lease, reported once per reason."""

    def __init__(self) -> None:
        self.reported: set[type[ChatlaneError]] = set()
        self.elsewhere = False
        """Whether the turn was told its session runs in another process: its busy
        policy applies once however many kinds of refusal follow."""
        self.unsure: StoreError | None = None
        """The last failure of a try that may have applied all the same (see
        :attr:`StoreError.maybe_applied <chatlane.errors.StoreError.maybe_applied>`)."""

    def first(self, error: ChatlaneError) -> bool:
        """Whether this is the first time ``error``'s kind of wait happened."""
        kind = type(error)
        if kind in self.reported:
            return False
        self.reported.add(kind)
        return True


class BeatGaps:
    """The gaps between this process's successful heartbeats: the last and the largest."""

    def __init__(self) -> None:
        self.last_at: float | None = None
        self.longest = 0.0
        self.count = 0

    def record(self, moment: float) -> None:
        """A heartbeat reached the store at ``moment`` (``time.monotonic()``)."""
        if self.last_at is not None:
            self.longest = max(self.longest, moment - self.last_at)
        self.last_at = moment
        self.count += 1


@dataclass(eq=False)
class BoundaryHold:
    """A session's lease, held here by one or more conversation boundaries."""

    state: SessionState
    lease: Lease
    """As last renewed."""
    boundaries: int = 1
    """How many boundaries under way here hold it: the last to end gives it back."""
    refused: bool = False
    """A renewal was refused: another process fenced it (it is renewed no more)."""
    foreign: frozenset[int] | None = None
    """The seqs of other processes' messages queued when it was taken: the ones its
    boundaries drop (``None``: not read; every other process's message they find)."""


class LeaseKeeper:
    """Acquires, renews and releases the leases of one process's turns."""

    def __init__(self, store: Store, holder: str, settings: LeaseSettings) -> None:
        self.store = store
        self.holder = holder
        self.settings = settings
        self.beats = BeatGaps()
        self.withdrawals = Withdrawals(store, holder)
        """What failed calls may have left in the store, taken back (:mod:`~.withdrawals`)."""
        self._drawing: dict[SessionKey, asyncio.Future[None]] = {}
        """Sessions whose lease is kept until the messages being drawn in have changed owner."""
        self._waits: dict[SessionKey, Watch] = {}
        """The watch of each session whose lease a turn here waits for."""
        self._releasing: dict[SessionKey, asyncio.Future[None]] = {}
        """Sessions whose lease this process is giving back: done once the store answered."""
        self._giving_back: set[Future[None]] = set()
        """Leases given back in the background, their releaser cancelled (:meth:`settled`)."""
        self._boundaries: dict[SessionKey, BoundaryHold] = {}
        """The leases conversation boundaries hold here, one per session."""

    def admit(
        self, state: SessionState, message_id: str, payload: bytes, *, choices: bool, token: str
    ) -> Awaitable[Admission]:
        """Queue a message for ``state``'s session and take the session's lease with it.

        One store call: the message is durable whatever becomes of the lease.
        The lease, if given, is not yet recorded here: the turn that runs the
        message takes it with :meth:`hold` (or gives it back with :meth:`let_go`).

        :param choices: also read the session's stored choices.
        :param token: the lease's token (a fresh one: see :meth:`Leases.acquire
            <chatlane.stores.protocols.Leases.acquire>`), so that what a failed call
            may have taken can be given back.
        :raises ChatlaneError: the store could not be asked; nothing was queued, or,
            on a store whose answers may be lost, the call may have applied.
        """
        settings = self.settings
        return self.store.enqueue_and_acquire(
            state.key,
            message_id,
            self.holder,
            payload,
            settings.ttl,
            max_active=settings.max_active_sessions,
            with_persistent=choices,
            token=token,
        )

    def hold(self, state: SessionState, lease: Lease) -> None:
        """Record ``lease`` (taken with its message) as the one its generation must release."""
        state.turn.store_lease_token(lease.generation, lease)

    def holds(self, state: SessionState, generation: int) -> bool:
        """Whether the lease taken for ``generation`` is still to be released here."""
        return generation in state.turn.lease_tokens

    async def let_go(self, state: SessionState, lease: Lease) -> None:
        """Give back a lease taken with a message that no turn runs now (once).

        Through an outage it is tried again until the store answers or the
        lease was released otherwise (the engine's close), so the session's
        next turn does not wait out the lease's TTL; other errors are logged.
        """
        self.hold(state, lease)
        generation = lease.generation
        try:
            await retry_store(
                lambda: self.release(state, generation),
                wanted=lambda: self.holds(state, generation),
                what="giving back a lease",
                fields=turn_fields(state.key, generation),
            )
        except ChatlaneError as error:  # it expires within the TTL; the session waits till then
            log.warning("could not give back a lease: %s", error, extra=turn_fields(state.key))

    async def acquire(
        self,
        state: SessionState,
        head_seq: int | None,
        still_wanted: Callable[[], bool],
        on_wait: Callable[[ChatlaneError, AcquireWait], object],
        *,
        refused: SessionBusy | None = None,
    ) -> Taken | None:
        """Wait for ``state``'s lease; ``None`` if ``still_wanted()`` turns false first.

        The lease comes with the session's stored choices, read in the same
        store call. A store that cannot be reached is waited out
        (:mod:`chatlane.runtime.backoff`). ``on_wait`` is told each time the
        session is busy elsewhere or at the active-session limit; it decides
        what to say (and may stop wanting). Between two tries the turn waits
        its poll delay, or less: a store with wake-ups
        (:class:`~chatlane.stores.protocols.Wakeups`) ends the wait as soon as
        the session may be free.

        Every try asks with the wait's one token, so a try whose answer was lost
        is found by the next (:meth:`Leases.acquire
        <chatlane.stores.protocols.Leases.acquire>`); a wait that ends without
        the lease after such a try owes the store that lease's withdrawal
        (:mod:`~chatlane.runtime.withdrawals`).

        :param refused: the store already refused the lease (when the message
            was queued): the wait starts from that answer instead of asking again,
            unless this process was giving the lease back meanwhile.
        """
        releasing = self._releasing.get(state.key)
        if releasing is not None:  # its answer first: the refusal may have been our own lease
            await asyncio.shield(releasing)
            refused = None
        wait, token = AcquireWait(), new_token()  # one token a wait: each try finds the last's
        delay, longest = self.settings.poll, self.settings.max_poll
        try:
            with self._watch(state) as wakeup:
                while still_wanted():
                    if refused is not None:
                        on_wait(refused, wait)
                        refused = None
                        if wakeup.listening:
                            continue  # a release before the watch was taken went unheard
                    else:
                        try:
                            return await self._try(state, head_seq, token)
                        except (ActiveSessionLimit, SessionBusy) as error:
                            on_wait(error, wait)
                        except StoreError as error:
                            if error.maybe_applied:
                                wait.unsure = error
                            if not retryable(error):
                                raise
                            self._outage(state, error, wait)
                            longest = MAX_DELAY  # an outage: back off further than a busy one
                    await wakeup.wait(delay)
                    delay = min(delay * 2, longest)
        except BaseException:
            self._give_back_unsure(state, wait, token)
            raise
        self._give_back_unsure(state, wait, token)
        return None

    @contextmanager
    def _watch(self, state: SessionState) -> Iterator[Watch]:
        """A watch on ``state``'s session for one wait (:meth:`nudge` wakes it too)."""
        with _watch(self.store, state) as watch:
            self._waits[state.key] = watch
            try:
                yield watch
            finally:
                if self._waits.get(state.key) is watch:
                    del self._waits[state.key]

    def nudge(self, key: SessionKey) -> None:
        """Wake the wait for ``key``'s lease here, if one waits, to ask at once whether it
        is still wanted: a message accepted before its own came to this process behind it
        (its turn then gives way; two processes never wait on each other's earlier
        messages for longer than it takes to look)."""
        watch = self._waits.get(key)
        if watch is not None:
            watch.wake()

    def _give_back_unsure(self, state: SessionState, wait: AcquireWait, token: str) -> None:
        """A wait ended without the lease: a try whose answer was lost may hold it."""
        if wait.unsure is not None:
            self.withdrawals.failed(state.key, token=token, error=wait.unsure)

    def _outage(self, state: SessionState, error: StoreError, wait: AcquireWait) -> None:
        if wait.first(error):
            fields = turn_fields(state.key)
            log.warning("taking the lease failed, retrying: %s", error, extra=fields)

    async def _try(self, state: SessionState, head_seq: int | None, token: str) -> Taken:
        settings = self.settings
        taken = await self.store.acquire_and_read(
            state.key,
            self.holder,
            settings.ttl,
            head_seq=head_seq,
            max_active=settings.max_active_sessions,
            token=token,
        )
        self.hold(state, taken.lease)
        return taken

    async def commit_and_release(
        self, state: SessionState, generation: int, batch: WriteBatch
    ) -> None:
        """Commit a turn's last batch under ``generation``; release its lease in the same write.

        The lease is released only if this generation still holds it here
        (once: an eviction may have released it already), and only if the
        commit applies; the entry in ``lease_tokens`` is settled once the store
        says it released the lease.

        :raises StaleGeneration: the generation moved on: nothing was written or released.
        :raises AlreadyAnswered: nothing was written or released.
        :raises StoreError: the store could not be asked.
        """
        if self._drawing:
            await self._drawn(state.key)
        lease = state.turn.lease_tokens.get(generation)
        if lease is None:
            await self.store.commit(state.key, generation, batch)
        elif await self.store.commit_and_release(lease, batch):
            state.turn.release_lease_token(generation)

    async def release(self, state: SessionState, generation: int) -> None:
        """Release the lease taken for ``generation``, if it is still held (once only).

        A call cancelled before the store answered (a closing engine or an
        eviction cancels a turn giving its lease back) leaves the lease to be
        given back in the background (:meth:`settled` waits for that).

        :raises StoreError: the store could not be reached; the lease is still
            held here (and renewed), so that calling again releases it.
        """
        if self._drawing:
            await self._drawn(state.key)
        lease = state.turn.release_lease_token(generation)
        if lease is None:
            return
        key = state.key
        answered = asyncio.get_running_loop().create_future()
        self._releasing[key] = answered
        try:
            await self.store.release(lease)
        except LeaseError as error:
            log.info("lease already gone: %s", error, extra=turn_fields(key, generation))
        except StoreError:
            self.hold(state, lease)
            raise
        except asyncio.CancelledError:
            self.hold(state, lease)
            self._give_back_later(state, generation)
            raise
        finally:
            if self._releasing.get(key) is answered:
                del self._releasing[key]
            answered.set_result(None)

    def _give_back_later(self, state: SessionState, generation: int) -> None:
        """Release ``generation``'s lease in a task of its own (its caller was cancelled)."""
        task = asyncio.ensure_future(self._give_back(state, generation))
        self._giving_back.add(task)
        task.add_done_callback(self._giving_back.discard)

    async def _give_back(self, state: SessionState, generation: int) -> None:
        try:
            await self.release(state, generation)
        except ChatlaneError as error:  # it expires within the TTL; the session waits till then
            log.warning("could not give back a lease: %s", error, extra=turn_fields(state.key))

    async def settled(self) -> None:
        """Wait until every lease given back in the background has its store's answer."""
        if self._giving_back:
            await asyncio.wait(list(self._giving_back))

    async def hold_for_boundary(self, state: SessionState) -> BoundaryHold | None:
        """Hold ``state``'s lease for a conversation boundary; ``None`` if it is not free.

        A boundary already holding it here is joined (the lease is given back
        when the last of them ends). Otherwise one try, with no wait: a session a
        turn holds (here or in another process), an earlier message's turn about
        to take, or a store that cannot be asked, is left as it is. What a try
        whose answer was lost may have taken is given back
        (:mod:`~chatlane.runtime.withdrawals`). The active-session limit never
        refuses it (a boundary is short and runs no agent), though while held it
        counts as an active session for other sessions' turns.
        """
        key = state.key
        held = self._boundaries.get(key)
        if held is not None:
            held.boundaries += 1
            return held
        releasing = self._releasing.get(key)
        if releasing is not None:  # our own lease, being given back: its answer first
            await asyncio.shield(releasing)
        token = new_token()
        try:
            lease = await self.store.acquire(key, self.holder, self.settings.ttl, token=token)
        except SessionBusy:
            return None
        except ChatlaneError as error:
            if isinstance(error, StoreError) and error.maybe_applied:
                self.withdrawals.failed(key, token=token, error=error)
            log.info("a boundary goes on without its lease: %s", error, extra=turn_fields(key))
            return None
        except BaseException:  # cancelled: what the call may have taken goes back
            self.withdrawals.failed(key, token=token)
            raise
        self.hold(state, lease)
        hold = self._boundaries[key] = BoundaryHold(state, lease)
        return hold

    def holding(self, hold: BoundaryHold) -> bool:
        """Whether ``hold`` still keeps its session from every other process: no renewal
        was refused (another process's ``/stop`` or interrupt fenced it) and it has not
        expired on this host's clock."""
        return not hold.refused and not locally_expired(hold.lease)

    def holds_boundary(self, key: SessionKey) -> bool:
        """Whether a boundary under way here holds ``key``'s lease."""
        return key in self._boundaries

    async def let_go_of_boundary(self, hold: BoundaryHold, wanted: Callable[[], bool]) -> None:
        """One boundary holding ``hold`` ended; once the last has, the lease is given back
        (once; never raises but for cancellation), so the session's next turn, here or
        elsewhere, may take it.

        Through an outage it is tried again while ``wanted()`` holds (the engine is
        not closing): a lease left behind would hold the session until it expires.
        """
        hold.boundaries -= 1
        if hold.boundaries > 0:
            return
        state, generation = hold.state, hold.lease.generation
        if self._boundaries.get(state.key) is hold:
            del self._boundaries[state.key]
        try:
            await retry_store(
                lambda: self.release(state, generation),
                wanted=lambda: wanted() and self.holds(state, generation),
                what="giving back a boundary's lease",
                fields=turn_fields(state.key, generation),
            )
        except ChatlaneError as error:  # it expires within the TTL; the session waits till then
            log.warning(
                "could not give back a boundary's lease: %s", error, extra=turn_fields(state.key)
            )

    async def let_go_of_boundaries(self) -> None:
        """Give back every lease boundaries hold here, each tried once (the engine closes)."""
        holds, self._boundaries = list(self._boundaries.values()), {}
        for hold in holds:
            hold.boundaries = 1
            await self.let_go_of_boundary(hold, lambda: False)

    def boundary_leases(self) -> list[Lease]:
        """The leases boundaries hold now and renew, beside the turns' (:meth:`renewed`)."""
        return [hold.lease for hold in self._boundaries.values() if not hold.refused]

    def renewed(self, held: Lease, lease: Lease | None) -> None:
        """A boundary's lease ``held`` was renewed as ``lease``, or refused (``None``): then
        it is renewed no more (:meth:`holding` says so), and stays to be released."""
        hold = self._boundaries.get(held.key)
        if hold is None or hold.lease is not held:
            return  # let go of meanwhile
        if lease is None:
            hold.refused = True
        else:
            hold.lease = lease

    def is_drawing(self, key: SessionKey) -> bool:
        """Whether messages are being drawn into ``key``'s running turn (:meth:`drawing`)."""
        return key in self._drawing

    @contextmanager
    def drawing(self, key: SessionKey) -> Iterator[None]:
        """Keep ``key``'s lease here until the block ends (see the module docstring).

        One draw per session at a time: the caller checks :meth:`is_drawing` first.
        """
        done = asyncio.get_running_loop().create_future()
        self._drawing[key] = done
        try:
            yield
        finally:
            del self._drawing[key]
            done.set_result(None)

    async def _drawn(self, key: SessionKey) -> None:
        drawing = self._drawing.get(key)
        if drawing is not None:
            await asyncio.shield(drawing)

    async def renew_all(self, leases: Iterable[Lease]) -> list[Lease | None]:
        """Renew ``leases`` in one store call, in order: the renewed lease, or ``None`` if lost.

        :raises ChatlaneError: the store could not be asked (an outage): the
            leases hold until they expire on this host's clock.
        """
        held = list(leases)
        return await self.store.renew_many(held, self.settings.ttl) if held else []

    async def moved_on(self, leases: Iterable[Lease]) -> list[bool]:
        """For each lease, in order, whether the store's generation moved past it.

        :raises ChatlaneError: if the store cannot be read.
        """
        held = list(leases)
        stored = await self.store.generations([lease.key for lease in held])
        return [current > lease.generation for lease, current in zip(held, stored, strict=True)]

    async def heartbeat(self) -> None:
        """Tell the store this process is alive for the next ``ttl``; note the gap since the last.

        :raises ChatlaneError: the store could not be reached.
        """
        await self.store.heartbeat(self.holder, self.settings.ttl)
        self.beats.record(time.monotonic())

    async def sign_off(self) -> None:
        """Tell the store this process is gone, so its messages can be adopted at once."""
        try:
            await self.store.heartbeat(self.holder, 0.0)
        except ChatlaneError as error:
            log.warning("could not sign off from the store: %s", error)


class _Polling:
    """The watch of a store without wake-ups: every wait is the whole poll delay, unless
    this process wakes it (:meth:`LeaseKeeper.nudge`)."""

    listening = False

    def __init__(self) -> None:
        self._woken = asyncio.Event()

    async def wait(self, seconds: float) -> bool:
        with suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._woken.wait()
        woken = self._woken.is_set()
        self._woken.clear()
        return woken

    def wake(self) -> None:
        self._woken.set()

    def close(self) -> None:
        return None


def _watch(store: Store, state: SessionState) -> closing[Watch]:
    """A watch on ``state``'s session: the store's wake-ups, or plain polling without them."""
    found: Watch = store.watch_wakeups(state.key) if isinstance(store, Wakeups) else _Polling()
    return closing(found)


def locally_expired(lease: Lease | None) -> bool:
    """Whether this host's clock says ``lease`` has expired (a paused process finds out here)."""
    return lease is not None and lease.expires_at <= time.time()


__all__ = [
    "AcquireWait",
    "BeatGaps",
    "BoundaryHold",
    "LeaseKeeper",
    "LeaseLost",
    "LeaseSettings",
    "locally_expired",
]
