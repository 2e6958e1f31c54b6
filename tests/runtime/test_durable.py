"""The engine on a store: durable queue, idempotent replies, leases, adoption, session cap."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from chatlane.errors import SessionBusy, StoreError
from chatlane.identity import SessionSource
from chatlane.lifecycle import LifecycleOptions
from chatlane.runtime.busy import BUSY_ELSEWHERE, STEERED_ELSEWHERE, BusyOutcome, BusyPolicy
from chatlane.runtime.ending import TurnEnd
from chatlane.runtime.leases import LeaseSettings
from chatlane.runtime.outcomes import Outcome
from chatlane.runtime.turn import Turn
from chatlane.stores import MemoryStore, Store, WriteBatch, open_store
from chatlane.stores.base import PendingRecord, Taken
from chatlane.stores.codec import encode_message
from chatlane.testing import GatewayHarness
from chatlane.types import InboundMessage, SessionKey
from tests.keys import chat_key
from tests.runtime.agents import EchoAgent, Recorder, UntakenSteers


async def test_answered_messages_leave_the_queue_and_join_the_transcript() -> None:
    store = MemoryStore()
    async with GatewayHarness(EchoAgent(), store=store) as h:
        result = await h.send("hello", chat_id="c")
        await h.replies(chat_id="c", count=1)
        await h.settle()
        assert await store.pending(result.session_key) == []
        transcript = await store.transcript(result.session_key)
        assert [(e.role, e.content) for e in transcript] == [
            ("user", "hello"),
            ("assistant", "echo: hello"),
        ]
        assert await store.is_answered(result.message_id)


async def test_a_rerun_of_an_answered_message_is_not_delivered_twice() -> None:
    store = MemoryStore()
    source = SessionSource("test", chat_id="c", user_id="u1")
    message = InboundMessage(source, "hello", id="m-once")
    key = chat_key("c")
    await store.commit(key, None, WriteBatch(answered=["m-once"]))
    await store.enqueue(key, "m-once", "h-dead", encode_message(message))
    async with GatewayHarness(EchoAgent(), store=store) as h:
        await h.settle()
        assert await store.pending(key) == []  # adopted and run
        await h.send("later", chat_id="c")  # its reply comes after anything the rerun sent
        assert await h.replies(chat_id="c", count=1) == ["echo: later"]
        assert [o.text for o in h.outbox] == ["echo: later"]


async def test_messages_of_a_dead_process_are_adopted_and_run(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'c.db'}"
    store = await open_store(url)
    source = SessionSource("test", chat_id="c", user_id="u1")
    key = chat_key("c")
    for n in range(3):
        message = InboundMessage(source, f"left behind {n}", id=f"m-{n}")
        await store.enqueue(key, message.id, "h-gone", encode_message(message))
    recorder = Recorder()
    try:
        async with GatewayHarness(EchoAgent(recorder), store=store) as h:
            replies = await h.replies(chat_id="c", count=3)
            assert replies == [f"echo: left behind {n}" for n in range(3)]
            assert await store.pending(key) == []
    finally:
        await store.close()


class CountsRefusals(MemoryStore):
    """A memory store that counts the leases it refused: each is one more look a turn
    waiting for its session took, and what that look decides has happened by the next."""

    def __init__(self) -> None:
        super().__init__()
        self.refusals = 0
        self._refused = asyncio.Event()

    async def acquire_and_read(
        self,
        key: SessionKey,
        holder: str,
        ttl: float,
        *,
        head_seq: int | None = None,
        max_active: int = 0,
        token: str = "",
    ) -> Taken:
        try:
            return await super().acquire_and_read(
                key, holder, ttl, head_seq=head_seq, max_active=max_active, token=token
            )
        except SessionBusy:
            self.refusals += 1
            self._refused.set()
            raise

    async def refused_again(self, times: int = 2) -> None:
        """Return once the store refused ``times`` more leases (within 5 s)."""
        goal = self.refusals + times
        async with asyncio.timeout(5):
            while True:
                self._refused.clear()
                if self.refusals >= goal:
                    return
                await self._refused.wait()


async def test_session_running_elsewhere_waits_for_the_lease() -> None:
    store = CountsRefusals()
    key = chat_key("c")
    foreign = await store.acquire(key, "h-other", 30)
    async with GatewayHarness(EchoAgent(), store=store) as h:
        await h.send("hello", chat_id="c")
        assert await h.replies(chat_id="c", count=1) == [BUSY_ELSEWHERE]
        await h.send("and this", chat_id="c")  # waits behind "hello"; its ack is debounced
        await store.refused_again()  # the waiting turn looked again since: still nothing new
        assert len(h.delivered(chat_id="c")) == 1
        await store.release(foreign)
        replies = await h.replies(chat_id="c", count=3)
        assert replies == [BUSY_ELSEWHERE, "echo: hello", "echo: and this"]
        assert h.session(key).persistent.run_generation == 3


async def test_reject_refuses_a_message_for_a_session_running_elsewhere() -> None:
    store = MemoryStore()
    recorder = Recorder()
    fast = LeaseSettings(ttl=0.3, poll=0.02)
    async with (
        GatewayHarness(EchoAgent(), store=store, busy="reject", leases=fast) as runner,
        GatewayHarness(EchoAgent(recorder), store=store, busy="reject", leases=fast) as other,
    ):
        started = await runner.send("sleep 0.5", chat_id="c")
        await runner.until_running(chat_id="c")
        await other.send("hello", chat_id="c")
        await other.send("and this", chat_id="c")  # waits behind the first: refused too
        replies = await other.replies(chat_id="c", count=2)
        assert replies == ["Busy — your message was not run"] * 2
        assert {o.refusal for o in other.delivered(chat_id="c")} == {"rejected"}
        assert await runner.replies(chat_id="c", count=1) == ["slept 0.5"]
        await other.settle()
        await other.send("later", chat_id="c")  # runs after anything still waiting over there
        assert (await other.replies(chat_id="c", count=3))[2] == "echo: later"
        assert [t.text for t in recorder.turns[started.session_key]] == ["later"]
        assert await store.pending(started.session_key) == []
        assert len(other.delivered(chat_id="c")) == 3


async def test_a_policy_changed_elsewhere_decides_while_the_session_runs_elsewhere() -> None:
    store = MemoryStore()
    fast = LeaseSettings(ttl=0.3, poll=0.02)
    async with (
        GatewayHarness(EchoAgent(), store=store, leases=fast) as runner,
        GatewayHarness(EchoAgent(), store=store, leases=fast, reread_stored=0) as other,
    ):
        await other.send("/busy reject", chat_id="c")
        await other.send("hello", chat_id="c")
        await other.replies(chat_id="c", count=2)
        await runner.send("/busy queue", chat_id="c")  # other rereads it at its next message
        await runner.replies(chat_id="c", count=1)
        await runner.send("sleep 0.5", chat_id="c")
        await runner.until_running(chat_id="c")
        await other.send("after the nap", chat_id="c")
        replies = await other.replies(chat_id="c", count=4)
        assert replies[2:] == [BUSY_ELSEWHERE, "echo: after the nap"]


@asynccontextmanager
async def recorded_runner_and_other() -> AsyncIterator[
    tuple[GatewayHarness, GatewayHarness, Recorder, MemoryStore]
]:
    """Two gateways on one memory store; the runner's agent records its turns."""
    store = MemoryStore()
    recorder = Recorder()
    async with (
        GatewayHarness(EchoAgent(recorder), store=store) as runner,
        GatewayHarness(EchoAgent(), store=store) as other,
    ):
        yield runner, other, recorder, store


async def test_stop_sent_to_another_process_interrupts_the_turn_at_once() -> None:
    async with recorded_runner_and_other() as (runner, other, recorder, store):
        started = await runner.send("sleep 20", chat_id="c")
        await runner.until_running(chat_id="c")
        await other.send("/stop", chat_id="c")
        assert await other.replies(chat_id="c", count=1) == [
            "Nothing was running here. Dropped 0 queued messages, "
            "and 1 message other gateway processes had taken."
        ]
        (turn,) = recorder.turns[started.session_key]
        await asyncio.wait_for(turn.interrupted.wait(), 2)  # renewal would take 10 s
        await runner.settle()
        assert runner.delivered(chat_id="c") == []
        assert await store.pending(started.session_key) == []
        await runner.send("hello", chat_id="c")
        assert await runner.replies(chat_id="c", count=1) == ["echo: hello"]


async def test_interrupt_reaches_a_turn_another_process_runs() -> None:
    store = MemoryStore()
    recorder = Recorder()
    async with (
        GatewayHarness(EchoAgent(recorder), store=store, busy="interrupt") as runner,
        GatewayHarness(EchoAgent(), store=store, busy="interrupt") as other,
    ):
        started = await runner.send("sleep 20", chat_id="c")
        await runner.until_running(chat_id="c")
        await other.send("hello", chat_id="c")
        replies = await other.replies(chat_id="c", count=2, timeout=3)
        assert replies == ["Interrupting the current task", "echo: hello"]
        await runner.settle()
        (turn,) = recorder.turns[started.session_key]  # interrupted, never run again
        assert turn.ended_by is TurnEnd.INTERRUPTED
        assert runner.delivered(chat_id="c") == []
        assert await store.pending(started.session_key) == []
        assert runner.gateway.engine.metrics.lease_failures == 0
        outcomes = [(o.message_id, o.outcome) for o in runner.outcomes]
        assert outcomes == [(started.message_id, Outcome.INTERRUPTED)]  # told to API waiters


async def test_a_stop_elsewhere_drops_what_waits_here_for_the_lease() -> None:
    store = MemoryStore()
    recorder = Recorder()
    fast = LeaseSettings(ttl=0.5, poll=0.02)
    async with (
        GatewayHarness(EchoAgent(), store=store, leases=fast) as runner,
        GatewayHarness(EchoAgent(recorder), store=store, leases=fast) as other,
    ):
        await runner.send("sleep 20", chat_id="c")
        await runner.until_running(chat_id="c")
        waiting = await other.send("queued over here", chat_id="c")  # waits for the lease
        await other.replies(chat_id="c", count=1)  # "Queued … (this conversation is busy)"
        await runner.send("/stop", chat_id="c")
        (stopped,) = await runner.replies(chat_id="c", count=1)
        assert stopped.startswith("Stopped the running turn.")
        await runner.settle()
        await other.settle()
        assert recorder.turns.get(waiting.session_key, []) == []  # never ran over there
        assert await store.pending(waiting.session_key) == []
        await other.send("after the stop", chat_id="c")
        replies = await other.replies(chat_id="c", count=2)
        assert replies[1] == "echo: after the stop"


async def test_a_renewal_that_raced_a_finished_turn_is_no_lease_failure() -> None:
    recorder = Recorder()
    async with GatewayHarness(EchoAgent(recorder)) as h:
        result = await h.send("hi", chat_id="c")
        await h.replies(chat_id="c", count=1)
        await h.settle()
        (turn,) = recorder.turns[result.session_key]
        engine = h.gateway.engine
        await engine.upkeep.lease_lost(turn, "renewal refused", fenced=True)  # a late renewal
        assert engine.metrics.lease_failures == 0
        assert turn.ended_by is None


async def test_interrupt_elsewhere_lets_what_that_process_queued_run_first() -> None:
    store = MemoryStore()
    async with (
        GatewayHarness(EchoAgent(), store=store, busy="interrupt") as runner,
        GatewayHarness(EchoAgent(), store=store, busy="interrupt") as other,
    ):
        await runner.send("sleep 20", chat_id="c")
        await runner.until_running(chat_id="c")
        await runner.send("/queue queued there", chat_id="c")
        await runner.until_queued(chat_id="c", count=1)
        await other.send("hello", chat_id="c")
        assert await other.replies(chat_id="c", count=2, timeout=3) == [
            "Interrupting the current task",
            "echo: hello",
        ]
        ran_there = [o.text for o in runner.delivered(chat_id="c")]
        assert ran_there == ["Queued for the next turn (1 queued)", "echo: queued there"]


class Holding:
    """Holds a turn for ``hold`` until :attr:`released` is set; echoes anything else."""

    def __init__(self) -> None:
        self.released = asyncio.Event()

    async def __call__(self, turn: Turn) -> str:
        if turn.text == "hold":
            await self.released.wait()
            return "held"
        return f"echo: {turn.text}"


class ModelSpy:
    """Replies with the model the turn runs with; records approval grants it saw."""

    def __init__(self) -> None:
        self.grants: list[list[str]] = []

    async def __call__(self, turn: Turn) -> str:
        self.grants.append(list(turn.session_state.conversation.approval_grants))
        model = turn.overrides.model
        return f"model={model.name if model else '-'}"


@asynccontextmanager
async def runner_and_other(
    runner_agent: ModelSpy, reread_stored: float
) -> AsyncIterator[tuple[GatewayHarness, GatewayHarness]]:
    """Two gateways on one store: ``runner`` rereads stored choices every ``reread_stored``."""
    store = MemoryStore()
    async with (
        GatewayHarness(runner_agent, store=store, reread_stored=reread_stored) as runner,
        GatewayHarness(ModelSpy(), store=store) as other,
    ):
        yield runner, other


async def test_choices_made_through_another_process_apply_to_the_next_turn() -> None:
    async with runner_and_other(ModelSpy(), reread_stored=0) as (runner, other):
        await runner.send("one", chat_id="c")
        await runner.send("/model gpt-y --once", chat_id="c")
        await runner.replies(chat_id="c", count=2)
        await other.send("/model gpt-x", chat_id="c")
        await other.send("/busy reject", chat_id="c")
        await other.replies(chat_id="c", count=2)
        for count, text in enumerate(("two", "three"), start=3):
            await runner.send(text, chat_id="c")
            await runner.replies(chat_id="c", count=count)
        ran = [o.text for o in runner.delivered(chat_id="c") if o.text.startswith("model=")]
        assert ran == ["model=-", "model=gpt-y", "model=gpt-x"]  # a --once here goes first
        key = runner.session_key(chat_id="c")
        assert runner.session(key).persistent.busy_policy is BusyPolicy.REJECT


async def test_choices_shown_here_are_those_another_process_made() -> None:
    """/model, /reasoning, /fast and /busy read the store again as a turn would, so a
    choice made through another process shows before any turn runs here."""
    async with runner_and_other(ModelSpy(), reread_stored=0) as (runner, other):
        await runner.send("one", chat_id="c")
        await runner.replies(chat_id="c", count=1)
        for choice in ("/model gpt-x", "/reasoning high", "/fast on", "/busy reject"):
            await other.send(choice, chat_id="c")
        await other.replies(chat_id="c", count=4)
        for shown in ("/model", "/reasoning", "/fast", "/busy"):
            await runner.send(shown, chat_id="c")
        assert (await runner.replies(chat_id="c", count=5))[1:] == [
            "Model: gpt-x",
            "Reasoning effort: high",
            "Fast mode: on",
            "Busy policy: reject",
        ]


async def test_a_once_model_is_not_used_up_by_a_message_refused_for_running_elsewhere() -> None:
    """Under ``reject`` a message refused because another process runs the session never ran
    its agent: the ``/model --once`` sent before it is for the next turn that does run."""
    store = MemoryStore()
    holding = Holding()
    async with (
        GatewayHarness(holding, store=store, busy="reject") as runner,
        GatewayHarness(ModelSpy(), store=store, busy="reject") as other,
    ):
        await runner.send("hold", chat_id="c")
        await runner.until_running(chat_id="c")
        await other.send("/model gpt-once --once", chat_id="c")
        await other.send("refused", chat_id="c")
        replies = await other.replies(chat_id="c", count=2)
        assert replies[1] == "Busy — your message was not run"
        holding.released.set()
        assert await runner.replies(chat_id="c", count=1) == ["held"]
        await runner.settle()
        for count, text in enumerate(("once", "after"), start=3):
            await other.send(text, chat_id="c")
            await other.replies(chat_id="c", count=count)
        assert (await other.replies(chat_id="c", count=4))[2:] == ["model=gpt-once", "model=-"]


async def test_a_once_model_is_not_used_up_by_a_retry_answered_from_the_store() -> None:
    """A retry whose answer the store holds is replayed, its agent never called: the
    ``/model --once`` sent before it is for the next turn that does run."""
    store = MemoryStore()
    async with GatewayHarness(ModelSpy(), store=store) as h:
        source = SessionSource("test", chat_id="c", user_id="u1")
        retry = InboundMessage(source, "hi", id="r-1", idempotent=True)
        key = h.gateway.session_key(retry)
        await store.commit(key, None, WriteBatch(answered=[retry.id], answer="answered before"))
        await h.send("/model gpt-once --once", chat_id="c")
        await h.gateway.dispatch(retry)
        replies = await h.replies(chat_id="c", count=2)
        assert replies == ["Next turn only: gpt-once", "answered before"]
        for count, text in enumerate(("once", "after"), start=3):
            await h.send(text, chat_id="c")
            await h.replies(chat_id="c", count=count)
        assert (await h.replies(chat_id="c", count=4))[2:] == ["model=gpt-once", "model=-"]


async def test_a_confirmation_lapses_once_another_process_ran_a_turn() -> None:
    """/new asked here, the person's next messages answered through another process: a
    later plain yes reaching this process is a message like any other, not the confirmation
    those messages would have cancelled here."""
    store = MemoryStore()
    confirm = LifecycleOptions(confirm_new=True)
    async with (
        GatewayHarness(EchoAgent(), store=store, lifecycle=confirm) as asked,
        GatewayHarness(EchoAgent(), store=store, lifecycle=confirm) as other,
    ):
        first = await asked.send("hello", chat_id="c")
        await asked.replies(chat_id="c", count=1)
        await asked.send("/new", chat_id="c")
        replies = await asked.replies(chat_id="c", count=2)
        assert replies[1].startswith("Start a new conversation?")
        before = (await store.conversation(first.session_key)).id
        await other.send("and then", chat_id="c")
        assert await other.replies(chat_id="c", count=1) == ["echo: and then"]
        await asked.send("yes", chat_id="c")  # meant for the agent's own question
        assert (await asked.replies(chat_id="c", count=3))[2] == "echo: yes"
        assert (await store.conversation(first.session_key)).id == before


async def test_a_confirmation_stands_over_turns_this_process_ran() -> None:
    store = MemoryStore()
    confirm = LifecycleOptions(confirm_new=True)
    holding = Holding()
    async with GatewayHarness(holding, store=store, lifecycle=confirm) as h:
        first = await h.send("hold", chat_id="c")
        await h.until_running(chat_id="c")
        await h.send("/queue queued before", chat_id="c")
        await h.send("/new", chat_id="c")
        await h.replies(chat_id="c", count=2)  # queued, the question
        holding.released.set()
        await h.replies(chat_id="c", count=4)  # held, the queued one
        before = (await store.conversation(first.session_key)).id
        await h.send("yes", chat_id="c")
        assert (await h.replies(chat_id="c", count=5))[4].startswith("Started a new conversation")
        assert (await store.conversation(first.session_key)).id != before


async def test_status_says_a_message_here_waits_for_the_session_another_process_runs() -> None:
    store = MemoryStore()
    holding = Holding()
    async with (
        GatewayHarness(holding, store=store) as runner,
        GatewayHarness(EchoAgent(), store=store) as other,
    ):
        await runner.send("hold", chat_id="c")
        await runner.until_running(chat_id="c")
        await other.send("after it", chat_id="c")
        await other.replies(chat_id="c", count=1)  # told it waits: the session is busy
        await other.send("/status", chat_id="c")
        status = (await other.replies(chat_id="c", count=2))[1]
        holding.released.set()
        assert (await other.replies(chat_id="c", count=3))[2] == "echo: after it"
    assert status.startswith("Status: waiting for the session (another gateway process runs it)")


async def test_a_new_conversation_started_elsewhere_clears_this_process_conversation() -> None:
    spy = ModelSpy()
    async with runner_and_other(spy, reread_stored=0) as (runner, other):
        await runner.send("/model gpt-x", chat_id="c")
        key = runner.session_key(chat_id="c")
        runner.session(key).conversation.approval_grants.append("rm -rf /tmp/x")
        await runner.send("one", chat_id="c")
        await runner.send("/model gpt-y --once", chat_id="c")
        await runner.replies(chat_id="c", count=3)
        await other.send("/new confirm", chat_id="c")
        await other.replies(chat_id="c", count=1)
        for text in ("two", "three"):
            await runner.send(text, chat_id="c")
            await runner.replies(chat_id="c", count=4 if text == "two" else 5)
        ran = [o.text for o in runner.delivered(chat_id="c") if o.text.startswith("model=")]
        assert ran == ["model=gpt-x", "model=-", "model=-"]  # as after a /new here: --once too
        assert spy.grants == [["rm -rf /tmp/x"], [], []]


async def test_stored_choices_are_trusted_for_reread_stored_seconds() -> None:
    async with runner_and_other(ModelSpy(), reread_stored=60) as (runner, other):
        await runner.send("one", chat_id="c")
        await runner.replies(chat_id="c", count=1)
        await other.send("/model gpt-x", chat_id="c")
        await other.replies(chat_id="c", count=1)
        await runner.send("two", chat_id="c")
        assert await runner.replies(chat_id="c", count=2) == ["model=-", "model=-"]


async def test_choices_that_come_with_a_lease_waited_for_are_taken_up_whatever_their_age() -> None:
    """A turn that waited for another process's lease takes up the choices the store read
    with it, though ``reread_stored`` would still trust those read before: the session
    moved on meanwhile (a turn ran there), so they may have changed, and cost no read."""
    store, finish = MemoryStore(), asyncio.Event()

    async def slow(turn: Turn) -> str:
        await finish.wait()
        return "done there"

    async with (
        GatewayHarness(ModelSpy(), store=store, reread_stored=60) as runner,
        GatewayHarness(slow, store=store) as other,
    ):
        await runner.send("one", chat_id="c")
        await runner.replies(chat_id="c", count=1)
        await other.send("long", chat_id="c")
        await other.until_running(chat_id="c")
        await other.send("/model gpt-x", chat_id="c")
        await other.replies(chat_id="c", count=1)
        await runner.send("two", chat_id="c")
        await runner.replies(chat_id="c", count=2)  # it waits for the lease
        finish.set()
        replies = await runner.replies(chat_id="c", count=3)
    assert replies == ["model=-", BUSY_ELSEWHERE, "model=gpt-x"]


async def test_reject_never_refuses_what_was_queued_explicitly() -> None:
    store = MemoryStore()
    fast = LeaseSettings(ttl=0.3, poll=0.02)
    async with (
        GatewayHarness(EchoAgent(), store=store, busy="reject", leases=fast) as runner,
        GatewayHarness(EchoAgent(), store=store, busy="reject", leases=fast) as other,
    ):
        await runner.send("sleep 0.5", chat_id="c")
        await runner.until_running(chat_id="c")
        await other.send("/queue hello", chat_id="c")
        replies = await other.replies(chat_id="c", count=3, timeout=5)
        assert replies == [
            "Nothing was running here, so it goes in now.",
            BUSY_ELSEWHERE,
            "echo: hello",
        ]


async def test_an_internal_event_for_a_session_running_elsewhere_just_waits() -> None:
    store = CountsRefusals()
    key = chat_key("c")
    foreign = await store.acquire(key, "h-other", 30)
    async with GatewayHarness(EchoAgent(), store=store, busy="reject") as h:
        await h.send("cron result", chat_id="c", internal=True)
        await store.refused_again()  # its turn was refused the lease, and looked again
        assert h.delivered(chat_id="c") == []
        await store.release(foreign)
        assert await h.replies(chat_id="c", count=1) == ["echo: cron result"]


async def test_active_session_cap_queues_with_a_notice() -> None:
    store = MemoryStore()
    async with GatewayHarness(
        EchoAgent(), store=store, leases=LeaseSettings(max_active_sessions=1)
    ) as h:
        await h.send("sleep 0.2", chat_id="a")
        await h.until_running(chat_id="a")
        await h.send("hi", chat_id="b")
        replies = await h.replies(chat_id="b", count=2)
        assert replies == ["at the active session limit (1/1), queued", "echo: hi"]


async def test_lost_lease_fences_the_turn_and_reruns_its_message() -> None:
    store = MemoryStore()
    runs: list[int] = []

    async def agent(turn: Turn) -> str:
        runs.append(turn.generation)
        if len(runs) == 1:
            await store.bump_generation(turn.session_key)  # another process /stops it
            await asyncio.sleep(0.3)
        return f"run {len(runs)}"

    async with GatewayHarness(agent, store=store, leases=LeaseSettings(ttl=0.3)) as h:
        await h.send("go", chat_id="c")
        replies = await h.replies(chat_id="c", count=1, timeout=5)
        assert replies == ["run 2"]
        assert runs[1] > runs[0]


async def test_busy_policy_survives_in_the_store(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'c.db'}"
    async with GatewayHarness(EchoAgent(), store=url) as h:
        await h.send("/busy reject", chat_id="c")
        await h.replies(chat_id="c", count=1)
    async with GatewayHarness(EchoAgent(), store=url) as h:
        await h.send("/busy", chat_id="c")
        assert await h.replies(chat_id="c", count=1) == ["Busy policy: reject"]


async def test_harness_accepts_any_store(tmp_path: Path) -> None:
    store: Store = await open_store(f"sqlite:///{tmp_path / 'x.db'}")
    try:
        async with GatewayHarness(EchoAgent(), store=store) as h:
            await h.send("x", chat_id="c")
            assert await h.replies(chat_id="c", count=1) == ["echo: x"]
    finally:
        await store.close()


async def test_a_stop_from_another_process_fences_the_turn_and_it_is_not_rerun() -> None:
    store = MemoryStore()
    recorder = Recorder()
    fast = LeaseSettings(ttl=0.3)
    async with (
        GatewayHarness(EchoAgent(recorder), store=store, leases=fast) as runner,
        GatewayHarness(EchoAgent(), store=store, leases=fast) as other,
    ):
        result = await runner.send("sleep 1", chat_id="c")
        await runner.until_running(chat_id="c")
        await other.send("/stop", chat_id="c")
        (stopped,) = await other.replies(chat_id="c", count=1)
        assert stopped.endswith("and 1 message other gateway processes had taken.")
        await runner.settle()  # the fenced turn ended (a rerun would run before "later")
        await runner.send("later", chat_id="c")
        assert await runner.replies(chat_id="c", count=1) == ["echo: later"]
        assert [t.text for t in recorder.turns[result.session_key]] == ["sleep 1", "later"]
        assert [o.text for o in runner.delivered(chat_id="c")] == ["echo: later"]
        assert await store.pending(result.session_key) == []


class Steerable:
    """Takes steers for a while; records what each of its turns saw."""

    accepts_steering = True

    def __init__(self) -> None:
        self.ran: list[list[str]] = []

    async def __call__(self, turn: Turn) -> str:
        seen = [turn.text]
        for _ in range(20):
            await asyncio.sleep(0.01)
            seen += turn.take_steers()
        self.ran.append(seen)
        return " + ".join(seen)


class Stubborn:
    """Ignores being interrupted: its lease stays held until the test sets :attr:`release`."""

    def __init__(self) -> None:
        self.release = asyncio.Event()

    async def __call__(self, turn: Turn) -> str:
        await self.release.wait()
        return f"done: {turn.text}"


async def test_a_message_steered_after_a_stop_elsewhere_still_runs() -> None:
    store = MemoryStore()
    fast = LeaseSettings(ttl=2, poll=0.02)
    steerable, nap = Steerable(), Stubborn()
    async with (
        GatewayHarness(nap, store=store, leases=fast, interrupt_grace=5) as runner,
        GatewayHarness(steerable, busy="steer", store=store, leases=fast) as other,
    ):
        await runner.send("nap", chat_id="c")  # holds the lease through the stop's grace
        await runner.until_running(chat_id="c")
        await other.send("first", chat_id="c")
        # its turn was refused the lease: it waits for it over there
        assert await other.replies(chat_id="c", count=1) == [STEERED_ELSEWHERE]
        await runner.send("/stop", chat_id="c")  # drops "first" from the store
        (stopped,) = await runner.replies(chat_id="c", count=1)
        assert stopped.endswith("and 1 message other gateway processes had taken.")
        steered = await other.send("sent after the stop", chat_id="c")
        assert steered.outcome is BusyOutcome.STEERED  # into the turn waiting for the lease
        nap.release.set()  # the lease is free at last
        await runner.settle()
        await other.settle()
        assert steerable.ran == [["sent after the stop"]]
        assert "sent after the stop" in [o.text for o in other.delivered(chat_id="c")]


class FlakyQueueRead(MemoryStore):
    """A memory store whose next ``pending`` read fails once, when told to."""

    fail_next = False

    async def pending(self, key: SessionKey) -> list[PendingRecord]:
        if self.fail_next:
            self.fail_next = False
            raise StoreError("store blip")
        return await super().pending(key)


async def test_a_failed_queue_check_runs_the_turn_and_frees_the_lease() -> None:
    store = FlakyQueueRead()
    async with GatewayHarness(EchoAgent(), store=store, leases=LeaseSettings(ttl=3)) as h:
        result = await h.send("one", chat_id="c")
        await h.replies(chat_id="c", count=1)
        await h.settle()
        await store.bump_generation(result.session_key)  # another process ran meanwhile
        store.fail_next = True
        await h.send("two", chat_id="c")
        await h.send("three", chat_id="c")
        replies = await h.replies(chat_id="c", count=4, timeout=1.5)  # well inside the TTL
        echoed = [reply for reply in replies if reply.startswith("echo")]
        assert echoed == ["echo: one", "echo: two", "echo: three"]


async def test_a_stop_elsewhere_drops_what_waits_in_the_running_process_queue() -> None:
    async with recorded_runner_and_other() as (runner, other, recorder, store):
        started = await runner.send("sleep 20", chat_id="c")
        await runner.send("w1", chat_id="c")
        await runner.send("/queue w2", chat_id="c")
        await runner.until_running(chat_id="c")
        await other.send("/stop", chat_id="c")
        (stopped,) = await other.replies(chat_id="c", count=1)
        assert stopped.endswith("and 3 messages other gateway processes had taken.")
        await asyncio.wait_for(runner.settle(), 5)
        assert [t.text for t in recorder.turns[started.session_key]] == ["sleep 20"]
        assert not any(o.text.startswith("echo: w") for o in runner.outbox)
        assert await store.pending(started.session_key) == []
        await runner.send("after", chat_id="c")
        assert "echo: after" in await runner.replies(chat_id="c", count=3)


async def test_a_stop_elsewhere_drops_what_was_steered_but_never_taken() -> None:
    store = MemoryStore()
    async with (
        GatewayHarness(
            UntakenSteers(hold=20), store=store, busy="steer", interrupt_grace=0.1
        ) as runner,
        GatewayHarness(EchoAgent(), store=store) as other,
    ):
        started = await runner.send("long", chat_id="c")
        await runner.until_running(chat_id="c")
        steered = await runner.send("w1", chat_id="c")
        assert steered.outcome is BusyOutcome.STEERED
        await other.send("/stop", chat_id="c")
        await other.replies(chat_id="c", count=1)
        await asyncio.wait_for(runner.settle(), 5)
        assert not any(o.text.startswith("ran ") for o in runner.outbox)
        assert await store.pending(started.session_key) == []


async def test_each_dropped_message_is_counted_by_one_stop() -> None:
    store = MemoryStore()
    fast = LeaseSettings(ttl=2, poll=0.02)
    nap = Stubborn()
    async with (
        GatewayHarness(nap, store=store, leases=fast, interrupt_grace=5) as runner,
        GatewayHarness(EchoAgent(), store=store, leases=fast) as other,
    ):
        await runner.send("nap", chat_id="c")  # holds its slot through the stop's grace
        await runner.send("queued here", chat_id="c")
        await runner.until_running(chat_id="c")
        await other.send("waiting over there", chat_id="c")  # waits for the lease
        await other.send("/stop", chat_id="c")
        await other.send("/stop", chat_id="c")
        await runner.send("/stop", chat_id="c")
        first, second = await other.replies(chat_id="c", count=2)
        assert first == (
            "Nothing was running here. Dropped 1 queued message, "
            "and 2 messages other gateway processes had taken."
        )
        assert second == "Nothing was running here. Dropped 0 queued messages."
        (third,) = [r for r in await runner.replies(chat_id="c", count=2) if "Dropped" in r]
        assert "other gateway processes" not in third  # what waited over there: counted once
        nap.release.set()


class ReadBeforeWrites(MemoryStore):
    """A memory store whose armed ``pending`` read answers with what it saw before
    ``go_on`` is set: the writes made meanwhile are not in its answer, as with a
    read on another thread whose snapshot predates a commit made on the loop."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False
        self.reading = asyncio.Event()
        self.go_on = asyncio.Event()

    async def pending(self, key: SessionKey) -> list[PendingRecord]:
        records = await super().pending(key)
        if self.armed:
            self.armed = False
            self.reading.set()
            await self.go_on.wait()
        return records


async def test_a_message_accepted_while_a_lost_turn_reads_the_queue_still_runs() -> None:
    store = ReadBeforeWrites()
    ran: list[str] = []

    async def agent(turn: Turn) -> str:
        ran.append(turn.text)
        if ran == ["go"]:
            await store.bump_generation(turn.session_key)  # the lease is lost
            await turn.interrupted.wait()
            store.armed = True  # the next read: the one deciding what runs again
        return f"done: {turn.text}"

    async with GatewayHarness(agent, store=store, leases=LeaseSettings(ttl=0.3)) as h:
        await h.send("go", chat_id="c")
        await store.reading.wait()
        later = await h.send("later", chat_id="c")  # queued here during the read
        store.go_on.set()
        replies = await h.replies(chat_id="c", count=3, timeout=10)
        assert replies == ["Queued for the next turn (1 queued)", "done: go", "done: later"]
        assert ran == ["go", "go", "later"]
        await h.settle()
        assert await store.pending(later.session_key) == []


NOTHING_RAN = "Nothing was running here."

LASTING = LeaseSettings(ttl=3600)
"""Nothing expires, and no adoption runs again, while a test runs."""


class Holds:
    """Holds ``first`` until released; records the texts it ran (it takes no steers)."""

    accepts_steering = True

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.ran: list[str] = []

    async def __call__(self, turn: Turn) -> str:
        self.ran.append(turn.text)
        if turn.text == "first":
            await self.release.wait()
        return f"ran {turn.text}"


def taken_over(chat_id: str) -> InboundMessage:
    """A message sent again here, whose record a dead process (``h-gone``) still owns."""
    return InboundMessage(SessionSource("test", chat_id=chat_id, user_id="u1"), "hi", id="m-1")


async def test_a_stop_drops_a_message_taken_over_from_a_dead_process(
    two_stores: tuple[Store, Store],
) -> None:
    """Such a message is this process's to drop: ``/stop`` adopts it and drops it, so it
    never runs later (while another process runs the session, it drops only its own).
    It ends dropped, or stopped, as the stopped waiting turn's own drop may get there
    first."""
    store, message, agent = two_stores[0], taken_over("c"), Holds()
    adopted = adoptions_noted(store)
    async with GatewayHarness(agent, store=store, leases=LASTING) as h:
        await adopted.wait()
        key = h.session_key(chat_id="c")
        await store.heartbeat("h-running", 3600)  # alive: its lease is never taken over
        elsewhere = await store.acquire(key, "h-running", 3600)
        await store.enqueue(key, message.id, "h-gone", encode_message(message))
        await h.gateway.dispatch(message)  # the same record, waiting here for the lease
        await h.send("/stop", chat_id="c")  # its reply may follow the message's "Queued"
        await h.wait_for(lambda out: any(o.text.startswith(NOTHING_RAN) for o in out))
        await h.settle()
        assert await store.pending(key) == []
        await store.release(elsewhere)
        await h.settle()
    [outcome] = [o.outcome for o in h.outcomes if o.message_id == "m-1"]
    assert outcome in (Outcome.DROPPED, Outcome.STOPPED)
    assert agent.ran == []


def adoptions_noted(store: Store) -> asyncio.Event:
    """An event set once ``store`` was asked twice for dead processes' messages: by a
    gateway's start and by its upkeep's first pass (the next is an hour away, with
    :data:`LASTING`), so that nothing but the test adopts a record it stores after."""
    adopted, calls = asyncio.Event(), [0]
    adopt_orphans = store.adopt_orphans

    async def noted(*args: Any, **kwargs: Any) -> Any:
        try:
            return await adopt_orphans(*args, **kwargs)
        finally:
            calls[0] += 1
            if calls[0] >= 2:
                adopted.set()

    store.adopt_orphans = noted  # type: ignore[method-assign]
    return adopted


async def test_an_unqueued_message_taken_over_from_a_dead_process_never_runs(
    two_stores: tuple[Store, Store],
) -> None:
    """Under ``steer`` what ``/unqueue`` takes back leaves the store only while it is this
    process's (or a dead one's: adopted, then dropped)."""
    store, message, agent = two_stores[0], taken_over("c"), Holds()
    adopted = adoptions_noted(store)
    async with GatewayHarness(agent, store=store, leases=LASTING, busy="steer") as h:
        await adopted.wait()
        key = h.session_key(chat_id="c")
        await h.send("first", chat_id="c")
        await h.until_running(chat_id="c")
        await store.enqueue(key, message.id, "h-gone", encode_message(message))
        await h.gateway.dispatch(message)  # the same record, steered into the turn here
        [(seq, _)] = h.gateway.engine.steered(key)
        await h.send(f"/unqueue #{seq}", chat_id="c")
        assert [r.message_id for r in await store.pending(key)] != [message.id]
        agent.release.set()
        await h.settle()
        assert await store.pending(key) == []
    assert agent.ran == ["first"]
    assert ("m-1", Outcome.DROPPED) in [(o.message_id, o.outcome) for o in h.outcomes]
