"""The scheduler: auto-resets on time, cron jobs, and background completions.

A :class:`Scheduler` is attached to one :class:`~chatlane.gateway.Gateway`,
which starts and stops it and shows it every message (for auto-reset); the
scheduler registers outbound filters with it that hold back what must not
reach a chat (:mod:`chatlane.scheduling.silent`) and note every reply a
person gets (activity). What stays true:

* A job's prompt reaches its target session as an internal
  :class:`~chatlane.types.InboundMessage`: it goes through that session's
  busy policy, queues behind a running turn and never interrupts it; the
  agent's reply reaches the chat through normal delivery.
* A job runs in its own task inside :func:`chatlane.context.cron_context`:
  session variables cleared, the cron delivery variables naming its target,
  so jobs running at once never see each other's target.
* A reply of exactly ``[SILENT]`` to a scheduler-made message is not
  delivered, nor are the streamed chunks of such replies, nor anything for a
  ``local`` job (its result is kept in the store's transcript only): the
  gateway's filter from :func:`~chatlane.scheduling.silent.silent_filter`.
* Each tick of a job runs at most once across every process sharing the
  store: a process runs a tick only after recording it under the job's lease
  with a fenced write (:class:`JobBook`); a tick is named by its epoch, which
  every process computes alike.
* At most ``firing_cap`` job ticks are claimed or run, and at most
  ``reset_cap`` auto-resets carried out, at once in a process: what falls due
  beyond them waits for a place, so a burst never floods the store ahead of
  the heartbeats and lease renewals of the turns running meanwhile.
* A job's next tick follows the clock as it reads now: one computed while the
  clock was ahead is computed again once the clock reads earlier (see
  :meth:`Scheduler.run_once`), so a clock put right never holds a job back
  until the wrong time comes round again.
"""

from __future__ import annotations

import asyncio
import contextvars
import datetime as dt
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from chatlane.context import cron_context
from chatlane.errors import ChatlaneError, ConfigError, StoreError
from chatlane.identity import SessionSource, build_session_key, parse_session_key
from chatlane.runtime.busy import BusyOutcome
from chatlane.runtime.limits import Count, PositiveSeconds, Seconds, check_bounds
from chatlane.scheduling.autoreset import (
    ActivityTracker,
    AutoResetPolicy,
    AutoResetSettings,
    AutoResetter,
    DueReset,
    resolve,
)
from chatlane.scheduling.chat import CRON_COMMAND, CRON_USAGE, cron_command, split_add
from chatlane.scheduling.cron import (
    LOCAL,
    ORIGIN,
    Claim,
    Job,
    JobBook,
    JobRun,
    Schedule,
    parse_schedule,
    run_source,
)
from chatlane.scheduling.silent import CRON_ID, DONE_ID, SILENT, silent_filter
from chatlane.types import InboundMessage, Outbound, SessionKey, Target

if TYPE_CHECKING:
    from chatlane.gateway import Gateway
    from chatlane.runtime.engine import TurnEngine

ID_DRAWS = 8
"""Job ids drawn at most before :meth:`Scheduler.add_job` gives up: a drawn id is taken
only by a stored job, or by a process creating one with it this moment."""

__all__ = [
    "CRON_COMMAND",
    "CRON_USAGE",
    "LOCAL",
    "ORIGIN",
    "SILENT",
    "AutoResetPolicy",
    "AutoResetSettings",
    "Job",
    "JobAction",
    "JobRun",
    "Scheduler",
    "SchedulerSettings",
    "cron_command",
    "split_add",
]

log = logging.getLogger("chatlane.scheduler")

JobAction = Callable[[JobRun], Awaitable[None]]
"""What a job does when its tick comes (called inside its cron context)."""


@dataclass(frozen=True, slots=True)
class SchedulerSettings:
    """How the scheduler behaves; every duration is in seconds.

    :param auto_reset: idle and daily reset policies (off by default).
    :param tz: the time zone of cron expressions and daily reset hours. Every
        process sharing a store must use the same one.
    :param period: time between two passes of the loop.
    :param sync_every: how often the job list is reloaded from the store (to
        see jobs other processes added or removed).
    :param track_cap: at most this many sessions are tracked for auto-reset.
    :param claim_ttl: lease TTL while a process claims a job's tick.
    :param chat_job_cap: how many jobs one chat may create with ``/cron add``.
    :param user_job_cap: how many jobs one principal (platform and user id: a
        person or an API client, whatever its session names) may create with
        ``/cron add``, over all their chats.
    :param total_job_cap: how many jobs all chats together may create with ``/cron add``.
    :param min_interval: the least time between two runs of a job made from a chat.
    :param close_grace: how long :meth:`Scheduler.aclose` lets running jobs
        and resets finish before cancelling them.
    :param firing_cap: how many job ticks this process claims and runs at once; a
        tick due beyond them waits for a place, in the order it fell due. A job's
        action holds its place until it returns (the default one: once its prompt
        is accepted, not answered).
    :param reset_cap: how many auto-resets this process carries out at once; a reset
        due beyond them waits for a place, in the order it fell due.
    """

    auto_reset: AutoResetSettings = field(default_factory=AutoResetSettings)
    tz: dt.tzinfo = dt.UTC
    period: PositiveSeconds = 1.0
    sync_every: PositiveSeconds = 10.0
    track_cap: Count = 10_000
    claim_ttl: PositiveSeconds = 30.0
    chat_job_cap: Count = 10
    close_grace: Seconds = 5.0
    user_job_cap: Count = 20
    total_job_cap: Count = 1000
    min_interval: Seconds = 60.0
    firing_cap: Count = 32
    reset_cap: Count = 32

    def __post_init__(self) -> None:
        check_bounds(self)


@dataclass(slots=True)
class _Slot:
    """One job as this process runs it: its parsed schedule and its next tick."""

    job: Job
    schedule: Schedule
    configured: bool
    due: float | None = None
    after: float = 0.0
    """The clock's reading ``due`` was computed from: its first tick after this."""
    firing: bool = False

    @classmethod
    def of(cls, job: Job, moment: float, tz: dt.tzinfo, *, configured: bool) -> _Slot:
        """``job`` with its first tick after ``moment``."""
        slot = cls(job, parse_schedule(job.schedule), configured)
        slot.advance(moment, tz)
        return slot

    def advance(self, moment: float, tz: dt.tzinfo) -> None:
        """Make the first tick after ``moment`` the next one (None, logged: it never runs again)."""
        self.after = moment
        self.due = self.schedule.next_after(moment, anchor=self.job.created_at, tz=tz)
        if self.due is None:
            log.warning(
                "job %s (%s) has no run left; it will not run", self.job.id, self.job.schedule
            )


class Scheduler:
    """Runs auto-resets and jobs for one gateway; see the module docstring.

    :param jobs: jobs from the configuration: never stored, never removable
        at run time; their id (given, or derived from their content) must be
        the same in every process.
    :param action: what a job does at its tick (default :meth:`submit_prompt`).
    :param now: the clock, epoch seconds (injectable for tests).

    A job created from a chat whose creator the gateway's check
    (:meth:`Gateway.authorized <chatlane.gateway.Gateway.authorized>`, the same
    as for a message) refuses is paused: its ticks pass without running.
    """

    def __init__(
        self,
        settings: SchedulerSettings | None = None,
        *,
        jobs: Iterable[Job] = (),
        action: JobAction | None = None,
        now: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings or SchedulerSettings()
        self.tracker = ActivityTracker(self.settings.track_cap)
        self._configured = _unique(jobs)
        self._action = action or self.submit_prompt
        self._now = now
        self._resetter = AutoResetter(
            self.settings.auto_reset, self.tracker, self.settings.tz, (CRON_ID, DONE_ID)
        )
        self._gateway: Gateway | None = None
        self._book: JobBook | None = None
        self._slots: dict[str, _Slot] = {}
        self._resetting: set[SessionKey] = set()
        self._firing_places = asyncio.Semaphore(self.settings.firing_cap)
        self._reset_places = asyncio.Semaphore(self.settings.reset_cap)
        self._adding = asyncio.Lock()
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop: asyncio.Task[None] | None = None
        self._synced_at: float | None = None

    def adding(self, key: SessionKey) -> asyncio.Lock:
        """The lock under which a chat (``key``) counts jobs and adds one (this process).

        One lock for every chat: the caps per principal and in total span chats.
        """
        return self._adding

    def is_paused(self, job: Job) -> bool:
        """Whether ``job`` was created from a chat whose creator may not use the gateway now.

        :raises RuntimeError: before :meth:`bind`.
        """
        return job.origin is not None and not self.gateway.authorized(job.origin)

    # -- wiring --------------------------------------------------------------------

    def bind(self, gateway: Gateway) -> None:
        """Attach to ``gateway`` (done by :meth:`Gateway.use_scheduler`); enables ``/cron``.

        :raises RuntimeError: if already attached to another gateway.
        """
        if self._gateway is gateway:
            return
        if self._gateway is not None:
            raise RuntimeError("this scheduler is attached to another gateway")
        self._gateway = gateway
        gateway.add_outbound_filter(silent_filter(self._local_prefix(), self._note_reply))
        engine = gateway.engine
        self._book = JobBook(engine.store, self.namespace, engine.holder, self.settings.claim_ttl)
        if gateway.router.get("cron") is CRON_COMMAND:
            gateway.router.register(cron_command(self))

    @property
    def gateway(self) -> Gateway:
        """The gateway this scheduler is attached to.

        :raises RuntimeError: before :meth:`bind`.
        """
        if self._gateway is None:
            raise RuntimeError("attach the scheduler first: Gateway(..., scheduler=s)")
        return self._gateway

    @property
    def engine(self) -> TurnEngine:
        """The gateway's turn engine."""
        return self.gateway.engine

    @property
    def namespace(self) -> str:
        """The gateway's key namespace; the scheduler's store keys start with it."""
        return self.gateway.settings.key_policy.namespace

    @property
    def book(self) -> JobBook:
        """Where jobs and their claimed ticks are stored."""
        if self._book is None:
            raise RuntimeError("attach the scheduler first: Gateway(..., scheduler=s)")
        return self._book

    async def start(self) -> None:
        """Load the jobs and start the loop (idempotent). Ticks missed while down are skipped."""
        if self._loop is not None:
            return
        await self.sync()
        self._loop = asyncio.create_task(
            self._run_forever(), name="chatlane-scheduler", context=contextvars.Context()
        )
        self._loop.add_done_callback(self._done)

    async def aclose(self) -> None:
        """Stop the loop; let running jobs and resets finish within ``close_grace``, then cancel."""
        if self._loop is not None:
            self._loop.cancel()
            await asyncio.gather(self._loop, return_exceptions=True)
        tasks = list(self._tasks)
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=self.settings.close_grace)
            for task in late:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _run_forever(self) -> None:
        while True:
            try:
                await self.run_once()
            except ChatlaneError as error:
                log.warning("scheduler pass failed: %s", error)
            except Exception:  # one bad pass must not end the loop for every later one
                log.exception("scheduler pass failed")
            await asyncio.sleep(self.settings.period)

    async def run_once(self) -> None:
        """One pass: reload jobs if due, then start every due reset and job tick in its own task
        (at most ``reset_cap`` resets and ``firing_cap`` ticks get on with it at once; the
        others wait for a place).

        A job whose next tick was computed from a later reading of the clock
        than this pass's (the wall clock was stepped back: a bad step put right)
        has it computed again from now, so it runs at its next tick by the
        clock as it reads now, not when the wrong time comes round again. A
        tick that already ran stays run: its claim is stored (:class:`JobBook`).
        The job list is reloaded at once then too.
        """
        if self._sync_due(self._now()):
            await self.sync()
        moment = self._now()  # after the sync: no slot was computed from a later reading
        for due in self._resetter.due(self.engine, moment):
            if due.key not in self._resetting:
                self._resetting.add(due.key)
                self._spawn(self._reset(due), f"chatlane-reset {due.key}")
        for slot in list(self._slots.values()):
            if slot.firing:
                continue
            if slot.after > moment:  # the clock went back since
                slot.advance(moment, self.settings.tz)
            if slot.due is not None and slot.due <= moment:
                slot.firing = True
                self._spawn(self._fire(slot, slot.due), f"chatlane-job {slot.job.id}")

    def _sync_due(self, moment: float) -> bool:
        """Whether to reload the job list: ``sync_every`` after the last load, or at once
        if the clock now reads earlier than it did then."""
        last = self._synced_at
        return last is None or not last <= moment < last + self.settings.sync_every

    async def wait_idle(self) -> None:
        """Return once no job or reset started by a pass is still running."""
        while self._tasks:
            await asyncio.wait(list(self._tasks))

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        error = None if task.cancelled() else task.exception()
        if error is not None:
            log.error("%s failed", task.get_name(), exc_info=error)

    # -- what the gateway tells the scheduler -------------------------------------------

    def touch(self, key: SessionKey, source: SessionSource) -> None:
        """A person wrote to ``key`` from ``source`` now (tracked if an auto-reset applies)."""
        if resolve(self.settings.auto_reset, source).enabled:
            self.tracker.touch(key, source, self._now())

    def _note_reply(self, outbound: Outbound) -> None:
        """A reply to a person, let through by the scheduler's filter, counts as activity."""
        self.tracker.refresh(outbound.session_key, self._now())

    def _local_prefix(self) -> str:
        return f"{self.namespace}:cron:local:"

    # -- auto-reset ---------------------------------------------------------------------------

    async def _reset(self, due: DueReset) -> None:
        """Carry out ``due`` once one of the ``reset_cap`` places is free."""
        try:
            async with self._reset_places:
                hook = self.gateway.settings.lifecycle.before_reset
                await self._resetter.reset(self.engine, due, hook)
        finally:
            self._resetting.discard(due.key)

    # -- jobs ----------------------------------------------------------------------------------

    async def sync(self) -> None:
        """Reload the job list from the store (jobs other processes added or removed)."""
        known = {i for i, slot in self._slots.items() if not slot.configured}
        stored = await self.book.load()
        moment = self._now()
        for job in self._configured:
            self._place(job, moment, configured=True)
        for job in stored.values():
            self._place(job, moment, configured=False)
        for gone in known - set(stored):
            self._slots.pop(gone, None)
        self._synced_at = moment

    def _place(self, job: Job, moment: float, *, configured: bool) -> None:
        """Schedule ``job`` from ``moment`` on, unless it already is; one that fails is skipped.

        A stored job that no longer is the one this process scheduled under its id
        (it was stored again) is scheduled anew. A job whose tick cannot be computed
        is logged and left out, so it never keeps the other jobs (or the whole sync)
        from running.
        """
        current = self._slots.get(job.id)
        if current is not None and (configured or current.configured or current.job == job):
            return
        try:
            slot = _Slot.of(job, moment, self.settings.tz, configured=configured)
        except Exception:
            log.exception("job %s (%s) cannot be scheduled; skipping it", job.id, job.schedule)
            return
        self._slots[job.id] = slot

    async def add_job(
        self,
        schedule: str,
        prompt: str,
        target: str = LOCAL,
        *,
        origin: SessionSource | None = None,
    ) -> Job:
        """Create, store and schedule a job; its first tick is the schedule's next one.

        :param target: ``"origin"`` (needs ``origin``), ``"local"``, or
            ``"platform:chat_id[:thread_id]"`` (``:`` inside an id written ``%3A``).
        :raises ConfigError: for a malformed schedule or target, or an empty prompt.
            Nothing is stored unless the job's first tick could be computed.
        :raises StoreError: no free id was found (every one drawn was taken meanwhile).

        Its id is one no stored job has (:meth:`JobBook.create`): two processes adding
        jobs at once never share one.
        """
        for _ in range(ID_DRAWS):
            job_id = secrets.token_hex(3)
            if job_id in self._slots:
                continue
            job = Job(schedule, prompt, target, origin, id=job_id, created_at=self._now())
            slot = _Slot.of(job, self._now(), self.settings.tz, configured=False)
            if await self.book.create(job):
                self._slots[job.id] = slot
                return job
        raise StoreError(f"no free job id in {ID_DRAWS} draws; try again")

    async def remove_job(self, job_id: str) -> bool:
        """Delete a stored job everywhere; False if there is no such job.

        :raises ConfigError: for a job defined in the configuration.
        """
        if job_id not in self._slots:
            await self.sync()
        slot = self._slots.get(job_id)
        if slot is None:
            return False
        if slot.configured:
            raise ConfigError(f"job {job_id} is defined in the configuration; remove it there")
        await self.book.delete(job_id)
        self._slots.pop(job_id, None)
        return True

    def list_jobs(self) -> list[Job]:
        """Every job this process knows, oldest first."""
        return sorted((s.job for s in self._slots.values()), key=lambda j: (j.created_at, j.id))

    def is_configured(self, job_id: str) -> bool:
        """Whether ``job_id`` comes from the configuration (never stored, not removable)."""
        slot = self._slots.get(job_id)
        return slot is not None and slot.configured

    def next_run(self, job_id: str) -> float | None:
        """When ``job_id`` runs next (epoch seconds), if it is known."""
        slot = self._slots.get(job_id)
        return None if slot is None else slot.due

    async def _fire(self, slot: _Slot, tick: float) -> None:
        """Once one of the ``firing_cap`` places is free: claim ``tick``; unless another
        process is deciding, move on to the next tick; run it."""
        async with self._firing_places:
            claim = await self._claim(slot, tick)
            if claim is Claim.GONE:
                self._slots.pop(slot.job.id, None)
            if claim is not Claim.BUSY:
                slot.advance(max(tick, self._now()), self.settings.tz)
            if claim is Claim.CLAIMED:
                await self._run(self._job_run(slot.job, tick))

    async def _claim(self, slot: _Slot, tick: float) -> Claim:
        try:
            stored = not slot.configured
            return await self.book.claim(slot.job.id, tick, stored=stored, now=self._now())
        except ChatlaneError as error:
            log.warning("could not claim job %s at %.0f: %s", slot.job.id, tick, error)
            return Claim.BUSY
        finally:
            slot.firing = False

    def _job_run(self, job: Job, tick: float) -> JobRun:
        source = run_source(job)
        if job.target == LOCAL:
            key = SessionKey(f"{self._local_prefix()}{job.id}")  # a shape no source has
        else:
            key = build_session_key(source, self.gateway.settings.key_policy)
        return JobRun(job, tick, key, source, f"{CRON_ID}{job.id}:{tick:.0f}")

    async def _run(self, run: JobRun) -> None:
        if self.is_paused(run.job):
            log.info(
                "job %s paused: its creator is not allowed; tick %.0f skipped", run.job.id, run.tick
            )
            return
        target = Target.of(run.source)
        with cron_context(target.platform, target.chat_id, target.thread_id):
            try:
                await self._action(run)
            except Exception:
                log.exception("job %s failed at tick %.0f", run.job.id, run.tick)

    async def submit_prompt(self, run: JobRun) -> None:
        """The default job action: the prompt goes to the run's session as an internal message."""
        message = InboundMessage(run.source, run.job.prompt, id=run.message_id, internal=True)
        await self._submit(run.session_key, message)

    async def notify_completion(
        self, key_or_source: SessionKey | SessionSource, text: str
    ) -> BusyOutcome | None:
        """Tell a session a background task finished: ``text`` arrives as an internal message.

        It queues behind a running turn and never interrupts it.

        :raises InvalidSessionKey: if a key is given that no source can be read back from.
        """
        if isinstance(key_or_source, SessionSource):
            source = key_or_source
            key = build_session_key(source, self.gateway.settings.key_policy)
        else:
            key, source = key_or_source, self._source_of(key_or_source)
        message = InboundMessage(source, text, id=f"{DONE_ID}{secrets.token_hex(8)}", internal=True)
        return await self._submit(key, message)

    def _source_of(self, key: SessionKey) -> SessionSource:
        tracked = self.tracker.get(key)
        if tracked is not None:
            return tracked.source
        parts = parse_session_key(key)
        return SessionSource(
            parts.platform,
            chat_id=parts.chat_id,
            chat_type=parts.chat_type,
            thread_id=parts.thread_id,
            user_id=parts.user_id,
        )

    async def _submit(self, key: SessionKey, message: InboundMessage) -> BusyOutcome | None:
        outcome = await self.engine.submit(key, message)
        if outcome is BusyOutcome.QUEUE_FULL:
            log.warning("%s was refused: the queue of %s is full", message.id, key)
        return outcome


def _unique(jobs: Iterable[Job]) -> tuple[Job, ...]:
    found: dict[str, Job] = {}
    for job in jobs:
        if job.id in found:
            raise ConfigError(f"two configured jobs share the id {job.id!r}")
        found[job.id] = job
    return tuple(found.values())
