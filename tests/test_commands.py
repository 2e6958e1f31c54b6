"""Slash commands: parsing, busy behaviour as data, and the built-in set."""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable, Sequence

import pytest

from chatlane.commands import (
    GREETING,
    CommandBusy,
    CommandCall,
    CommandSpec,
    ParsedCommand,
    parse_command,
)
from chatlane.errors import STORE_UNAVAILABLE, StoreError
from chatlane.runtime.aftermath import MAX_RERUNS
from chatlane.runtime.outcomes import Outcome
from chatlane.stores import MemoryStore
from chatlane.testing import GatewayHarness
from chatlane.types import OutboundKind, SessionKey
from tests.runtime.agents import EchoAgent, Recorder
from tests.runtime.refusing import LosingAnswers, Refusing, every, first_of


class TestParse:
    @pytest.mark.parametrize(
        ("text", "parsed"),
        [
            ("/stop", ParsedCommand("stop", "")),
            ("  /STOP  ", ParsedCommand("stop", "")),
            ("/queue hello world", ParsedCommand("queue", "hello world")),
            ("/queue line one\nline two", ParsedCommand("queue", "line one\nline two")),
            ("/busy@my_bot collect", ParsedCommand("busy", "collect", "my_bot")),
        ],
    )
    def test_commands(self, text: str, parsed: ParsedCommand) -> None:
        assert parse_command(text) == parsed

    @pytest.mark.parametrize(
        "text",
        [
            "hello",
            "/",
            "/ stop",
            "/usr/bin is a folder",
            "//x",
            "/1abc",
            "/" + "a" * 40,
            "/stöp",
            "x /stop",
        ],
    )
    def test_not_commands(self, text: str) -> None:
        assert parse_command(text) is None


async def test_stop_interrupts_and_drops_the_queue() -> None:
    recorder = Recorder()
    async with GatewayHarness(EchoAgent(recorder)) as h:
        result = await h.send("sleep 5", chat_id="c")
        await h.until_running(chat_id="c")
        await h.send("a", chat_id="c")
        await h.send("b", chat_id="c")
        await h.send("/stop", chat_id="c")
        replies = await h.replies(chat_id="c", count=2)
        assert replies[1] == "Stopped the running turn. Dropped 2 queued messages."
        await h.settle()
        state = h.session(result.session_key)
        assert state.persistent.run_generation == 2
        assert not state.turn.is_running
        assert len(recorder.turns[result.session_key]) == 1
        await h.send("again", chat_id="c")
        assert (await h.replies(chat_id="c", count=3))[2] == "echo: again"


class DropFailsOnceIdle(MemoryStore):
    """Refuses the first ``drop_pending``, once ``idle()`` returned: the stopped turn
    ended while the store was asked (its own drop, the next call, goes through)."""

    def __init__(self) -> None:
        super().__init__()
        self.failures = 1
        self.idle: Callable[[], Awaitable[None]] | None = None

    async def drop_pending(self, key: SessionKey, seqs: Sequence[int]) -> None:
        if self.failures:
            self.failures -= 1
            assert self.idle is not None
            await self.idle()
            raise StoreError("the store is out of reach")
        await super().drop_pending(key, seqs)


@pytest.mark.parametrize("failing", ["refused", "turn ends first", "answer lost"])
async def test_stop_keeps_the_queue_the_store_could_not_drop_and_runs_it(failing: str) -> None:
    """A /stop the store could not follow stops the running turn here, and the
    messages it could not drop wait again in their places: they run, none is lost
    (also when the stopped turn ended while the store was asked, and when the
    store dropped them but its answer was lost: they were told they still wait)."""
    store: MemoryStore = DropFailsOnceIdle()
    if failing != "turn ends first":
        kind = Refusing if failing == "refused" else LosingAnswers
        store = kind(first_of("drop_pending"))
    async with GatewayHarness(EchoAgent(), store=store) as h:
        if isinstance(store, DropFailsOnceIdle):
            store.idle = h.gateway.engine.wait_idle
        await h.send("sleep 30", chat_id="c")
        await h.until_running(chat_id="c")
        queued = [await h.send(text, chat_id="c") for text in ("a", "b")]
        await h.send("/stop", chat_id="c")
        replies = await h.replies(chat_id="c", count=4)
        assert replies[1:] == [
            f"Stopped the running turn. Could not drop 2 queued messages: {STORE_UNAVAILABLE}."
            " They still wait.",
            "echo: a",
            "echo: b",
        ]
        await h.settle()
        ends = {o.message_id: o.outcome for o in h.outcomes}
        assert [ends[r.message_id] for r in queued] == [Outcome.ANSWERED, Outcome.ANSWERED]
        assert len(h.outcomes) == 3  # one each: the stopped turn's, and a's and b's


@pytest.mark.parametrize("failing", ["refused", "answer lost"])
async def test_stops_whose_generation_bump_failed_leave_the_next_message_its_lease(
    failing: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A /stop whose generation bump the store refused (or whose answer was lost) says
    so, and this process's generation stays no further than the store's: the next
    message takes the lease the store gives it and runs, once, however many such
    /stops came before. (Each /stop moved it one further, and the store's next leases
    were refused as having come too late: after MAX_RERUNS of them the message was
    set aside as failed, with nothing wrong.)"""
    store = (Refusing if failing == "refused" else LosingAnswers)(every("bump_generation"))
    recorder = Recorder()
    async with GatewayHarness(EchoAgent(recorder), store=store) as h:
        first = await h.send("a", chat_id="c")
        await h.settle()
        key = first.session_key
        for _ in range(MAX_RERUNS + 1):
            await h.send("/stop", chat_id="c")
        assert store.refused["bump_generation"] == MAX_RERUNS + 1
        then = await h.send("b", chat_id="c")
        await h.settle()
        said = "could not be confirmed" if failing == "answer lost" else "could not finish"
        replies = await h.replies(chat_id="c", count=MAX_RERUNS + 3)
        assert replies[0] == "echo: a"
        assert all(said in reply for reply in replies[1:-1])
        assert replies[-1] == "echo: b"
        ends = [(o.message_id, o.outcome) for o in h.outcomes]
        assert ends == [(first.message_id, Outcome.ANSWERED), (then.message_id, Outcome.ANSWERED)]
        assert len(recorder.turns[key]) == 2  # b ran once: the first lease it was given
        assert h.session(key).persistent.run_generation <= await store.generation(key)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


@pytest.mark.parametrize(
    ("command", "shown"),
    [
        ("/model big", "Model: the default"),
        ("/reasoning high", "Reasoning effort: the default"),
        ("/fast on", "Fast mode: default"),
        ("/busy reject", "Busy policy: queue"),
    ],
)
async def test_a_choice_the_store_could_not_keep_changes_nothing(
    command: str, shown: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with GatewayHarness(EchoAgent(), store=Refusing(every("set_persistent"))) as h:
        await h.send(command, chat_id="c")
        name = command.split()[0]
        assert last_text(h) == f"{name} could not finish: {STORE_UNAVAILABLE}."
        await h.send(name, chat_id="c")
        assert last_text(h) == shown  # not taken up here either
        assert not [
            r for r in caplog.records if r.levelno >= logging.ERROR
        ]  # an outage: no traceback


async def test_a_choice_whose_answer_was_lost_is_not_said_to_have_failed() -> None:
    """The store may have kept it: the reply says so, and a later turn takes it up."""
    store = LosingAnswers(first_of("set_persistent"))
    # every turn reads the stored choices again, as with messages seconds apart
    async with GatewayHarness(EchoAgent(), store=store, reread_stored=0.0) as h:
        await h.send("/busy reject", chat_id="c")
        assert last_text(h) == f"/busy could not be confirmed: {STORE_UNAVAILABLE}."
        await h.send("hello", chat_id="c")
        await h.settle()
        await h.send("/busy", chat_id="c")
        assert last_text(h) == "Busy policy: reject"  # it had been kept


async def test_stop_when_idle_still_bumps_generation() -> None:
    async with GatewayHarness(EchoAgent()) as h:
        result = await h.send("/stop", chat_id="c")
        assert await h.replies(chat_id="c", count=1) == [
            "Nothing was running here. Dropped 0 queued messages."
        ]
        assert h.session(result.session_key).persistent.run_generation == 1


async def test_queue_runs_at_once_when_idle_and_queues_when_busy() -> None:
    async with GatewayHarness(EchoAgent(), busy="reject") as h:
        await h.send("/queue first", chat_id="c")
        assert await h.replies(chat_id="c", count=2) == [
            "Nothing was running here, so it goes in now.",
            "echo: first",
        ]
        await h.send("sleep 0.05", chat_id="c")
        await h.send("/queue second", chat_id="c")
        replies = await h.replies(chat_id="c", count=5)
        assert replies[2:] == ["Queued for the next turn (1 queued)", "slept 0.05", "echo: second"]


async def test_queue_without_text_shows_usage() -> None:
    async with GatewayHarness(EchoAgent()) as h:
        await h.send("/queue", chat_id="c")
        [reply] = await h.replies(chat_id="c", count=1)
        assert reply.endswith("Usage: /queue <text>")


async def test_queue_tells_its_sender_when_the_store_could_not_take_the_message() -> None:
    async with GatewayHarness(EchoAgent(), store=Refusing(first_of("enqueue"))) as h:
        result = await h.send("/queue first", chat_id="c")
        assert last_text(h) == f"Could not queue it: {STORE_UNAVAILABLE}."
        [ended] = h.outcomes  # not queued: it ends here, and says why without the store's words
        assert (ended.message_id, ended.outcome) == (result.message_id, Outcome.FAILED)
        assert ended.reason == STORE_UNAVAILABLE
        await h.send("/queue second", chat_id="c")
        assert await h.replies(chat_id="c", count=3) == [
            f"Could not queue it: {STORE_UNAVAILABLE}.",
            "Nothing was running here, so it goes in now.",
            "echo: second",
        ]


async def test_queue_ends_its_message_when_the_session_could_not_be_read() -> None:
    async with GatewayHarness(EchoAgent(), store=Refusing(first_of("load_persistent"))) as h:
        result = await h.send("/queue first", chat_id="c")
        assert last_text(h) == f"Could not queue it: {STORE_UNAVAILABLE}."
        assert [(o.message_id, o.outcome) for o in h.outcomes] == [
            (result.message_id, Outcome.FAILED)
        ]


async def test_queue_command_respects_the_cap() -> None:
    async with GatewayHarness(EchoAgent(), queue_cap=1) as h:
        await h.send("sleep 0.05", chat_id="c")
        await h.send("/queue a", chat_id="c")
        await h.send("/queue b", chat_id="c")
        replies = await h.replies(chat_id="c", count=2)
        assert replies[1].startswith("Queue full")
        [refusal] = [o for o in h.delivered(chat_id="c") if o.text.startswith("Queue full")]
        assert (refusal.kind, refusal.refusal) == (OutboundKind.NOTICE, "queue_full")


async def test_status_idle_and_running() -> None:
    async with GatewayHarness(EchoAgent()) as h:
        await h.send("/status", chat_id="c")
        [idle] = await h.replies(chat_id="c", count=1)
        assert idle.startswith("Status: idle")
        assert "busy policy: queue (default)" in idle
        await h.send("sleep 5", chat_id="c")
        await h.until_running(chat_id="c")
        await h.send("x", chat_id="c")
        await h.send("/status", chat_id="c")
        running = (await h.replies(chat_id="c", count=3))[2]
        assert "Status: running for" in running
        assert "generation: 1" in running
        assert "queued: 1" in running


async def test_busy_sets_session_policy() -> None:
    async with GatewayHarness(EchoAgent()) as h:
        result = await h.send("/busy reject", chat_id="c")
        await h.send("/busy", chat_id="c")
        await h.send("/busy sideways", chat_id="c")
        await h.send("/busy default", chat_id="c")
        replies = await h.replies(chat_id="c", count=4)
        assert replies[0] == "Busy policy for this session: reject"
        assert replies[1] == "Busy policy: reject"
        assert "'sideways' is not one of" in replies[2]
        assert replies[2].endswith(
            "Usage: /busy [queue|collect|rollback|redirect|steer|reject|default]"
        )
        assert replies[3] == "Busy policy reset to the default (queue)."
        assert h.session(result.session_key).persistent.busy_policy is None


async def test_session_policy_applies_to_that_session_only() -> None:
    async with GatewayHarness(EchoAgent()) as h:
        await h.send("/busy reject", chat_id="a")
        for chat in ("a", "b"):
            await h.send("sleep 0.05", chat_id=chat)
            await h.send("x", chat_id=chat)
        assert (await h.replies(chat_id="a", count=2))[1] == "Busy — your message was not run"
        assert (await h.replies(chat_id="b", count=1))[0].startswith("Queued")


async def test_unknown_command_lists_commands() -> None:
    async with GatewayHarness(EchoAgent()) as h:
        await h.send("/frobnicate now", chat_id="c")
        [reply] = await h.replies(chat_id="c", count=1)
        assert reply.startswith("Unknown command /frobnicate.")
        assert "/stop" in reply
        assert "/help" in reply


async def test_help_lists_every_command() -> None:
    async with GatewayHarness(EchoAgent()) as h:
        await h.send("/help", chat_id="c")
        [reply] = await h.replies(chat_id="c", count=1)
        for name in ("busy", "help", "queue", "status", "stop"):
            assert f"/{name}" in reply


@pytest.mark.parametrize("text", ["/start", "/start deep-link-payload", "/start@chatlane_bot"])
async def test_start_is_greeted_with_what_help_says(text: str) -> None:
    async with GatewayHarness(EchoAgent()) as h:
        await h.send(text, chat_id="c")
        await h.send("/help", chat_id="c")
        greeting, help_ = await h.replies(chat_id="c", count=2)
    assert greeting == f"{GREETING}\n\n{help_}"
    assert "/start" not in help_  # Telegram's, not one to list


async def test_not_a_command_goes_to_the_agent() -> None:
    async with GatewayHarness(EchoAgent()) as h:
        await h.send("/usr/bin is a folder", chat_id="c")
        assert await h.replies(chat_id="c", count=1) == ["echo: /usr/bin is a folder"]


class TestBusyBehaviourIsData:
    @staticmethod
    def spec(busy: CommandBusy, seen: list[bool]) -> CommandSpec:
        async def handler(call: CommandCall) -> str:
            turn = call.engine.running_turn(call.session_key)
            seen.append(turn is not None and turn.is_current())
            return "done"

        return CommandSpec("probe", "test", "/probe", busy, handler)

    async def run_while_busy(self, busy: CommandBusy) -> tuple[list[str], list[bool]]:
        seen: list[bool] = []
        async with GatewayHarness(EchoAgent()) as h:
            h.gateway.router.register(self.spec(busy, seen))
            await h.send("sleep 0.2", chat_id="c")
            await h.until_running(chat_id="c")
            await h.send("/probe", chat_id="c")
            await h.settle()
            return [o.text for o in h.delivered(chat_id="c")], seen

    async def test_dispatch_runs_while_busy(self) -> None:
        replies, seen = await self.run_while_busy(CommandBusy.DISPATCH)
        assert replies == ["done", "slept 0.2"]
        assert seen == [True]

    async def test_interrupt_then_dispatch_fences_the_turn_first(self) -> None:
        replies, seen = await self.run_while_busy(CommandBusy.INTERRUPT_THEN_DISPATCH)
        assert replies == ["done"]
        assert seen == [False]

    async def test_reject_refuses_while_busy(self) -> None:
        replies, seen = await self.run_while_busy(CommandBusy.REJECT)
        assert replies[0].startswith("/probe can't run while a turn is running")
        assert replies[1:] == ["slept 0.2"]
        assert seen == []

    async def test_handler_crash_becomes_a_reply(self) -> None:
        async def broken(call: CommandCall) -> str:
            raise RuntimeError("bug")

        async with GatewayHarness(EchoAgent()) as h:
            h.gateway.router.register(CommandSpec("bad", "x", "/bad", CommandBusy.DISPATCH, broken))
            await h.send("/bad", chat_id="c")
            assert await h.replies(chat_id="c", count=1) == [
                "/bad failed unexpectedly; the error was logged."
            ]


QUEUED_LINE = re.compile(r"  #(\d+) \d+s ann: “(.*)”")


def last_text(h: GatewayHarness) -> str:
    """The last thing delivered to chat c (a command's reply is sent before dispatch returns)."""
    return h.delivered(chat_id="c")[-1].text


async def queued_ids(h: GatewayHarness) -> dict[str, int]:
    """What ``/status`` lists as queued: each message's preview and its short id."""
    await h.send("/status", chat_id="c")
    return {text: int(seq) for seq, text in QUEUED_LINE.findall(last_text(h))}


async def test_status_lists_the_queue_and_unqueue_takes_one_message_out() -> None:
    async with GatewayHarness(EchoAgent()) as h:
        await h.send("sleep 30", chat_id="c", user_name="ann")
        await h.until_running(chat_id="c")
        first = await h.send("first in line", chat_id="c", user_name="ann")
        await h.send("second\nin   line " + "x" * 60, chat_id="c", user_name="ann")
        listed = await queued_ids(h)
        long_preview = "second in line " + "x" * 24 + "…"
        assert list(listed) == ["first in line", long_preview]
        assert listed["first in line"] < listed[long_preview]

        await h.send(f"/unqueue #{listed['first in line']}", chat_id="c", user_name="ann")
        notice, answer = h.delivered(chat_id="c")[-2:]
        assert notice.kind is OutboundKind.NOTICE
        assert notice.text == "Taken out of the queue, will not run: “first in line”"
        assert notice.in_reply_to == (first.message_id,)
        assert answer.text.startswith(f"Took #{listed['first in line']} out of the queue")
        assert list(await queued_ids(h)) == [long_preview]
        await h.send("/stop", chat_id="c")
        await h.settle()
        key = h.session_key(chat_id="c")
        assert await h.gateway.engine.store.pending(key) == []
    [dropped] = [o for o in h.outcomes if o.message_id == first.message_id]
    assert dropped.outcome is Outcome.DROPPED
    assert not any(o.text.startswith("echo: first") for o in h.delivered(chat_id="c"))


@pytest.mark.parametrize(
    ("args", "answer"),
    [
        ("", "Usage: /unqueue #<id>"),
        ("first", "Usage: /unqueue #<id>"),
        ("#12 #13", "Usage: /unqueue #<id>"),
        ("#999999", "No message #999999 waits here (/status lists the queue)."),
        ("7", "No message #7 waits here (/status lists the queue)."),
    ],
)
async def test_unqueue_explains_what_it_cannot_do(args: str, answer: str) -> None:
    async with GatewayHarness(EchoAgent()) as h:
        await h.send(f"/unqueue {args}", chat_id="c")
        assert answer in last_text(h)


async def test_a_message_the_store_could_not_drop_waits_in_its_place() -> None:
    async with GatewayHarness(EchoAgent(), store=Refusing(first_of("drop_pending"))) as h:
        await h.send("sleep 30", chat_id="c", user_name="ann")
        await h.until_running(chat_id="c")
        for text in ("one", "two", "three"):
            await h.send(text, chat_id="c", user_name="ann")
        listed = await queued_ids(h)
        await h.send(f"/unqueue #{listed['two']}", chat_id="c")
        shown = f"out of the queue ({STORE_UNAVAILABLE}); it still waits."
        assert last_text(h) == f"Could not take #{listed['two']} {shown}"  # not the store's words
        assert await queued_ids(h) == listed  # back in its place
        await h.send(f"/unqueue #{listed['two']}", chat_id="c")
        assert list(await queued_ids(h)) == ["one", "three"]
        await h.send("/stop", chat_id="c")
