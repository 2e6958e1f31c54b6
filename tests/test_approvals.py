"""Approvals: prompts in the same chat, grants, timeouts, and who may answer."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

from chatlane.approvals import HOW_TO_ANSWER, markdown_prompt, quote_command
from chatlane.context import current_session
from chatlane.delivery.ledger import draft_of, outbound_of
from chatlane.gateway import Gateway, GatewaySettings
from chatlane.identity import KeyPolicy, SessionKey, SessionSource
from chatlane.lifecycle import LifecycleOptions
from chatlane.runtime.engine import RuntimeSettings
from chatlane.runtime.leases import LeaseSettings
from chatlane.runtime.turn import Turn
from chatlane.stores import MemoryStore, open_store
from chatlane.stores.base import Conversation
from chatlane.stores.records import PENDING, Delivery, DeliveryDraft
from chatlane.testing import GatewayHarness
from chatlane.types import Asks, InboundMessage, Outbound, OutboundKind
from tests.runtime.agents import EchoAgent, approving_agent
from tests.runtime.refusing import Refusing
from tests.runtime.test_outage import write_lock

SHARED_GROUPS = KeyPolicy(group_sessions_per_user=False)
NOT_PENDING = "That approval is no longer pending (it was answered, or its turn ended)."


async def prompted(h: GatewayHarness, chat_id: str, count: int, **where: str) -> None:
    """Wait until the ``count``-th approval prompt reached the chat."""
    thread = where.get("thread_id")

    def asked(outbox: list[Outbound]) -> bool:
        prompts = [o for o in outbox if o.kind is OutboundKind.APPROVAL]
        return (
            sum(o.target.chat_id == chat_id and o.target.thread_id == thread for o in prompts)
            >= count
        )

    await h.wait_for(asked)


async def test_prompt_goes_to_the_same_chat_and_thread_then_approve() -> None:
    async with GatewayHarness(approving_agent) as h:
        await h.send("approve rm -rf /tmp/x", chat_id="g", chat_type="group", thread_id="t7")
        await prompted(h, "g", 1, thread_id="t7")
        await h.send("/approve", chat_id="g", chat_type="group", thread_id="t7")
        replies = await h.replies(chat_id="g", thread_id="t7", count=3)
        assert replies[0].startswith("Approval needed: `rm -rf /tmp/x` — the test wants it")
        assert replies[1] == "Approved (once): `rm -rf /tmp/x`"
        assert replies[2] == "approved: rm -rf /tmp/x"


async def test_deny_with_reason_and_plain_no() -> None:
    async with GatewayHarness(approving_agent) as h:
        await h.send("approve a", chat_id="c")
        await prompted(h, "c", 1)
        await h.send("/deny not today", chat_id="c")
        await h.replies(chat_id="c", count=3)
        await h.send("approve b", chat_id="c")
        await prompted(h, "c", 2)
        await h.send("no", chat_id="c")
        replies = await h.replies(chat_id="c", count=6)
        assert replies[1] == "Denied: `a` — not today"
        assert replies[2] == "denied: a"
        assert replies[4:] == ["Denied: `b`", "denied: b"]


async def test_a_prompt_carries_what_it_asks_verbatim_through_the_ledger() -> None:
    async with GatewayHarness(approving_agent) as h:
        await h.send("approve rm `x` ||y||", chat_id="c", user_id="u7")
        await prompted(h, "c", 1)
        [prompt] = [o for o in h.outbox if o.kind is OutboundKind.APPROVAL]
        assert prompt.asks == Asks("rm `x` ||y||", "the test wants it", asker="u7")
        assert outbound_of(as_delivery(draft_of(prompt))) == prompt
        await h.send("no", chat_id="c", user_id="u7")
        await h.replies(chat_id="c", count=3)
    assert all(o.asks is None for o in h.outbox if o.kind is not OutboundKind.APPROVAL)


def as_delivery(draft: DeliveryDraft) -> Delivery:
    """``draft`` as a store keeps it once recorded."""
    return Delivery(draft.id, 1, draft.lane, draft.target, draft.payload, 0.0, PENDING)


def test_a_delivery_recorded_before_prompts_carried_what_they_ask_still_reads() -> None:
    target = {"platform": "slack", "chat_id": "C1"}
    older = msgspec.msgpack.encode(
        {"kind": "approval", "session_key": "k", "target": target, "text": "t", "approval_id": "a"}
    )
    assert outbound_of(as_delivery(DeliveryDraft("d", "slack", "t", older))).asks is None
    without_asker = msgspec.msgpack.encode(
        {"kind": "approval", "session_key": "k", "target": target, "text": "t"}
        | {"approval_id": "a", "asks": {"command": "ls", "reason": ""}}
    )
    asked = outbound_of(as_delivery(DeliveryDraft("d", "slack", "t", without_asker)))
    assert asked.asks == Asks("ls", "", asker=None)


@pytest.mark.parametrize(
    ("command", "reason", "shown"),
    [
        ("ls", "", "Approval needed\n```\nls\n```\n"),
        ("a```b", "why", "Approval needed — WHY\n```\na`\u200b`\u200b`\u200bb\n```\n"),
        ("", "two\n lines", "Approval needed — TWO LINES\n```\n \n```\n"),
        ("`\n```\n# h", "", "Approval needed\n```\n`\u200b\n`\u200b`\u200b`\u200b\n# h\n```\n"),
    ],
)
def test_a_markdown_prompt_shows_the_command_in_a_block_nothing_in_it_closes(
    command: str, reason: str, shown: str
) -> None:
    assert markdown_prompt(Asks(command, reason), str.upper) == shown + HOW_TO_ANSWER


@pytest.mark.parametrize(
    ("command", "quoted"),
    [
        ("rm -rf build", "`rm -rf build`"),
        ("||x|| [a](b) **c**", "`||x|| [a](b) **c**`"),  # nothing renders inside a span
        ("a`b", "\n```\na`\u200bb\n```\n"),
        ("ls\n\n||hidden||", "\n```\nls\n\n||hidden||\n```\n"),  # a blank line ends a span
        ("x```\ny", "\n```\nx`\u200b`\u200b`\u200b\ny\n```\n"),
    ],
)
def test_a_decision_quotes_its_command_as_code_nothing_in_it_ends(
    command: str, quoted: str
) -> None:
    assert quote_command(command) == quoted


async def test_a_timeout_notice_quotes_an_odd_command_in_a_block() -> None:
    async with GatewayHarness(approving_agent, approval_timeout=0.2) as h:
        await h.send("approve a`b", chat_id="c")
        replies = await h.replies(chat_id="c", count=3)
        assert replies[1] == "Approval for \n```\na`\u200bb\n```\n timed out — denied."


async def test_plain_yes_approves() -> None:
    async with GatewayHarness(approving_agent) as h:
        await h.send("approve a", chat_id="c")
        await prompted(h, "c", 1)
        await h.send("yes", chat_id="c")
        assert (await h.replies(chat_id="c", count=3))[2] == "approved: a"


@pytest.mark.parametrize("answer", ["yes", "no"])
async def test_a_yes_or_no_two_questions_wait_for_answers_neither(answer: str) -> None:
    """An approval asked, then /new's confirmation: a bare answer could be meant for either,
    so it approves nothing, starts nothing, and leaves neither question armed for a later
    plain yes (one meant for the agent's own question, say)."""

    async def agent(turn: Turn) -> str:
        if turn.text.startswith("approve "):
            return await approving_agent(turn)
        return f"echo: {turn.text}"

    confirm = LifecycleOptions(confirm_new=True)
    async with GatewayHarness(agent, busy="queue", lifecycle=confirm) as h:
        asked = await h.send("approve rm -rf /srv/data", chat_id="c")
        await prompted(h, "c", 1)
        state = h.gateway.engine.registry.get(asked.session_key)
        conversation = state.conversation.conversation_id
        await h.send("/new", chat_id="c")
        await h.send(answer, chat_id="c")
        replies = await h.replies(chat_id="c", count=3)
        assert replies[1].startswith("Start a new conversation?")
        assert replies[2] == (
            "Not done: an approval and your last command were both waiting for a yes or no, "
            "so that answered neither. Answer the approval with /approve or /deny; "
            "send /new confirm to go ahead with the command."
        )
        await h.send("/deny", chat_id="c")
        replies = await h.replies(chat_id="c", count=5)
        assert replies[3:] == ["Denied: `rm -rf /srv/data`", "denied: rm -rf /srv/data"]
        await h.send("yes", chat_id="c")  # nothing waits for it now: a plain message
        replies = await h.replies(chat_id="c", count=6)
        assert replies[5] == "echo: yes"
        assert state.conversation.conversation_id == conversation


async def test_timeout_counts_as_deny() -> None:
    async with GatewayHarness(approving_agent, approval_timeout=0.2) as h:
        await h.send("approve a", chat_id="c")
        replies = await h.replies(chat_id="c", count=3)
        assert replies[1:] == ["Approval for `a` timed out — denied.", "denied: a"]


async def test_session_grant_lasts_until_the_conversation_ends() -> None:
    async with GatewayHarness(approving_agent, lifecycle=LifecycleOptions(confirm_new=False)) as h:
        await h.send("approve ls", chat_id="c")
        await prompted(h, "c", 1)
        await h.send("/approve session", chat_id="c")
        await h.replies(chat_id="c", count=3)
        await h.send("approve ls", chat_id="c")
        assert (await h.replies(chat_id="c", count=4))[3] == "approved: ls"
        await h.send("/new", chat_id="c")
        await h.send("approve ls", chat_id="c")
        await prompted(h, "c", 2)


async def test_always_grant_is_kept_in_the_store(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'a.db'}"
    async with GatewayHarness(approving_agent, store=url) as h:
        await h.send("approve deploy", chat_id="c")
        await prompted(h, "c", 1)
        await h.send("/approve always", chat_id="c")
        await h.replies(chat_id="c", count=3)
    async with GatewayHarness(approving_agent, store=url) as h:
        await h.send("approve deploy", chat_id="c")
        assert await h.replies(chat_id="c", count=1) == ["approved: deploy"]


async def test_an_always_grant_the_store_cannot_keep_is_approved_once_and_said_so() -> None:
    """The command runs (the request was approved); the reply says so, and that "always"
    was not kept, instead of "could not finish" beside the command's own answer."""
    store = Refusing(lambda name: name == "set_persistent")
    async with GatewayHarness(approving_agent, store=store) as h:
        await h.send("approve deploy", chat_id="c")
        await prompted(h, "c", 1)
        await h.send("/approve always", chat_id="c")
        replies = await h.replies(chat_id="c", count=3)
        key = h.session_key(chat_id="c")
        assert h.session(key).persistent.approval_allowlist == []
    assert replies[1] == (
        "Approved (once): `deploy` — it could not be kept for always (the store is "
        "unavailable); ask again later"
    )
    assert replies[2] == "approved: deploy"


async def test_a_boundary_denies_a_blocked_request_at_once() -> None:
    options = LifecycleOptions(confirm_new=False)
    async with GatewayHarness(approving_agent, lifecycle=options, approval_timeout=30) as h:
        key = h.session_key(chat_id="c")
        await h.send("approve a", chat_id="c")
        await prompted(h, "c", 1)
        turn = h.gateway.engine.running_turn(key)
        assert turn is not None
        assert turn.task is not None
        await h.send("/new", chat_id="c")
        done, _ = await asyncio.wait([turn.task], timeout=1)
        assert done, "the blocked tool call did not return when the conversation ended"
        assert "approved: a" not in [o.text for o in h.outbox]


async def test_another_user_in_a_shared_group_cannot_approve() -> None:
    async with GatewayHarness(approving_agent, key_policy=SHARED_GROUPS) as h:
        await h.send("approve a", chat_id="g", chat_type="group", user_id="owner")
        await prompted(h, "g", 1)
        await h.send("/approve", chat_id="g", chat_type="group", user_id="intruder")
        await h.send("yes", chat_id="g", chat_type="group", user_id="intruder")
        replies = await h.replies(chat_id="g", count=3)
        assert (
            replies[1:]
            == ["Only the person whose message started this turn can answer its approval."] * 2
        )
        await h.send("/approve", chat_id="g", chat_type="group", user_id="owner")
        assert (await h.replies(chat_id="g", count=5))[4] == "approved: a"


async def test_another_chat_cannot_see_the_request() -> None:
    async with GatewayHarness(approving_agent) as h:
        await h.send("approve a", chat_id="c1")
        await prompted(h, "c1", 1)
        await h.send("/approve", chat_id="c2")
        assert await h.replies(chat_id="c2", count=1) == ["No approval is pending."]


async def test_a_superseded_turn_is_never_granted() -> None:
    async with GatewayHarness(approving_agent, approval_timeout=30) as h:
        key = h.session_key(chat_id="c")
        await h.send("approve a", chat_id="c")
        await prompted(h, "c", 1)
        state = h.session(key)
        state.persistent.bump_generation()  # another /stop or takeover fenced the turn
        await h.send("/approve", chat_id="c")
        replies = await h.replies(chat_id="c", count=2)
        assert replies[1] == "Denied: `a` — its turn was stopped"


async def test_request_from_a_worker_thread() -> None:
    async with GatewayHarness(approving_agent) as h:
        await h.send("thread cat /etc/hosts", chat_id="c")
        await prompted(h, "c", 1)
        await h.send("/approve", chat_id="c")
        assert (await h.replies(chat_id="c", count=3))[2] == "approved: cat /etc/hosts"


async def test_approve_without_a_request_and_malformed() -> None:
    async with GatewayHarness(approving_agent) as h:
        await h.send("/approve", chat_id="c")
        await h.send("/approve forever", chat_id="c")
        replies = await h.replies(chat_id="c", count=2)
        assert replies[0] == "No approval is pending."
        assert replies[1].endswith("Usage: /approve [all] [#request] [once|session|always]")


async def test_an_answer_naming_a_turn_answers_only_that_turns_request() -> None:
    async with GatewayHarness(approving_agent, approval_timeout=30) as h:
        await h.send("approve a", chat_id="c")
        await prompted(h, "c", 1)
        generation = h.session(h.session_key(chat_id="c")).persistent.run_generation
        await h.send(f"/approve #{generation + 1}", chat_id="c")
        await h.send(f"/deny #{generation - 1} not that one", chat_id="c")
        await h.send(f"/approve #{generation} session", chat_id="c")
        replies = await h.replies(chat_id="c", count=5)
        assert replies[1:3] == [NOT_PENDING, NOT_PENDING]
        assert replies[3:] == ["Approved (session): `a`", "approved: a"]


async def test_a_malformed_turn_name_gets_the_usage() -> None:
    async with GatewayHarness(approving_agent, approval_timeout=30) as h:
        await h.send("approve a", chat_id="c")
        await prompted(h, "c", 1)
        for text in ("/approve #x", "/approve #1 #2", "/deny #-1", "/approve #"):
            await h.send(text, chat_id="c")
        replies = await h.replies(chat_id="c", count=5)
        assert all("\nUsage: /" in r for r in replies[1:]), replies
        await h.send("/approve", chat_id="c")
        replies = await h.replies(chat_id="c", count=7)
        assert replies[5:] == ["Approved (once): `a`", "approved: a"]


class LeftBehind:
    """An agent whose ``start`` turn leaves behind a task that asks for approval.

    The task asks once ``ask`` is set; the turn answers once ``finish`` is set.
    """

    def __init__(self) -> None:
        self.ask = asyncio.Event()
        self.finish = asyncio.Event()
        self.decisions: list[bool] = []
        self.tasks: list[asyncio.Task[None]] = []

    async def __call__(self, turn: Turn) -> str:
        if turn.text.startswith("start"):
            self.tasks.append(asyncio.create_task(self._ask(turn)))
            await self.finish.wait()
            return "started in the background"
        return f"echo: {turn.text}"

    async def _ask(self, turn: Turn) -> None:
        await self.ask.wait()
        self.decisions.append(await turn.request_approval("rm -rf /important"))


async def test_a_request_from_a_turn_that_ended_is_denied_and_never_asked() -> None:
    agent = LeftBehind()
    agent.finish.set()
    async with GatewayHarness(agent, approval_timeout=30) as h:
        await h.send("start", chat_id="c")
        await h.replies(chat_id="c", count=1)
        await h.settle()  # the turn has ended
        agent.ask.set()
        await asyncio.wait_for(asyncio.gather(*agent.tasks), 5)
        await h.send("yes", chat_id="c")
        assert await h.replies(chat_id="c", count=2) == ["started in the background", "echo: yes"]
    assert agent.decisions == [False]


async def test_a_request_still_waiting_when_its_turn_ends_is_denied_then() -> None:
    agent = LeftBehind()
    agent.ask.set()
    async with GatewayHarness(agent, approval_timeout=30) as h:
        await h.send("start", chat_id="c")
        await prompted(h, "c", 1)
        agent.finish.set()
        await asyncio.wait_for(asyncio.gather(*agent.tasks), 5)  # ends with its turn
        await h.send("yes", chat_id="c")
        replies = await h.replies(chat_id="c", count=3)
    assert agent.decisions == [False]
    assert replies[0].startswith("Approval needed: `rm -rf /important`")
    assert replies[1:] == ["started in the background", "echo: yes"]


async def test_the_threadsafe_request_refuses_to_block_the_event_loop() -> None:
    async def agent(turn: Turn) -> str:
        return str(turn.request_approval_threadsafe("rm x"))

    async with GatewayHarness(agent) as h:
        await h.send("go", chat_id="c")
        await h.send("still alive?", chat_id="other")
        [failed] = await h.replies(chat_id="c", count=1)
        assert failed == "Sorry — the agent failed on this message (RuntimeError)."
        assert len(await h.replies(chat_id="other", count=1)) == 1


async def test_a_prompt_asked_from_a_thread_is_delivered_with_its_session_bound() -> None:
    """A tool in a thread of its own (no context of the turn's) asks: its prompt reaches the
    adapter's filters and ``deliver`` with the turn's session bound, as one asked from the
    turn's task does."""
    seen: list[tuple[OutboundKind, str | None]] = []

    def bound(outbound: Outbound) -> bool:
        session = current_session()
        seen.append((outbound.kind, None if session is None else session.session_key))
        return True

    async def agent(turn: Turn) -> str:
        answers: list[bool] = []
        thread = threading.Thread(
            target=lambda: answers.append(turn.request_approval_threadsafe("rm x"))
        )
        thread.start()
        await asyncio.to_thread(thread.join)
        return f"approved={answers[0]}"

    async with GatewayHarness(agent) as h:
        h.gateway.add_outbound_filter(bound)
        sent = await h.send("go", chat_id="c")
        await h.wait_for(lambda outbox: bool(approvals_sent(outbox)))
        await h.send("yes", chat_id="c")
        replies = await h.replies(chat_id="c", count=3)
    assert replies[1:] == ["Approved (once): `rm x`", "approved=True"]
    # the prompt, the answer's reply (sent from this test's dispatch: unbound), the turn's reply
    assert [key for _, key in seen] == [sent.session_key, None, sent.session_key]
    assert seen[0][0] is OutboundKind.APPROVAL


async def two_requests(turn: Turn) -> str:
    first = await turn.request_approval("ls build/")
    second = await turn.request_approval("rm -rf ~/")
    return f"first={first} second={second}"


def approvals_sent(outbox: list[Outbound]) -> list[Outbound]:
    return [o for o in outbox if o.kind is OutboundKind.APPROVAL]


async def test_a_button_names_its_request_not_just_its_turn() -> None:
    async with GatewayHarness(two_requests, approval_timeout=0.3) as h:
        await h.send("go", chat_id="c")
        await h.wait_for(lambda outbox: len(approvals_sent(outbox)) == 2)
        first, second = approvals_sent(h.outbox)
        assert first.generation == second.generation
        assert first.approval_id != second.approval_id
        await h.send(f"/approve #{first.approval_id}", chat_id="c")  # the timed-out prompt
        replies = await h.replies(chat_id="c", count=4)
        assert replies[3] == NOT_PENDING
        await h.send(f"/approve #{second.approval_id}", chat_id="c")
        replies = await h.replies(chat_id="c", count=6)
        assert replies[4:] == ["Approved (once): `rm -rf ~/`", "first=False second=True"]


async def test_a_deny_reason_may_mention_a_number() -> None:
    async with GatewayHarness(approving_agent, approval_timeout=30) as h:
        await h.send("approve rm x", chat_id="c")
        await prompted(h, "c", 1)
        await h.send("/deny see issue #12", chat_id="c")
        replies = await h.replies(chat_id="c", count=3)
        assert replies[1:] == ["Denied: `rm x` — see issue #12", "denied: rm x"]


@pytest.mark.parametrize(
    ("reason", "why"),
    [
        ("\x1b[2Jwiped", "a reason may hold no control characters or bidirectional overrides."),
        ("\u202eedoc", "a reason may hold no control characters or bidirectional overrides."),
        ("x" * 501, "a reason is at most 500 characters."),
    ],
)
async def test_a_deny_reason_that_could_disguise_the_chat_is_refused(reason: str, why: str) -> None:
    """It is repeated in the chat (and kept with an answer passed on): the request still
    waits, for an answer that can be shown."""
    async with GatewayHarness(approving_agent, approval_timeout=30) as h:
        await h.send("approve rm x", chat_id="c")
        await prompted(h, "c", 1)
        await h.send(f"/deny {reason}", chat_id="c")
        refused = (await h.replies(chat_id="c", count=2))[1]
        assert refused.split("\n")[0] == why
        await h.send("/deny not now", chat_id="c")
        replies = await h.replies(chat_id="c", count=4)
        assert replies[2:] == ["Denied: `rm x` — not now", "denied: rm x"]


async def test_a_turn_without_requests_leaves_its_session_evictable() -> None:
    async with GatewayHarness(EchoAgent()) as h:
        result = await h.send("hello there", chat_id="c")
        await h.replies(chat_id="c", count=1)
        await h.settle()
        state = h.session(result.session_key)
        assert state.turn.approval_requests == {}
        assert not state.holds_unsaved_data()


async def test_a_session_whose_requests_all_ended_is_evictable_again() -> None:
    async with GatewayHarness(approving_agent, approval_timeout=30) as h:
        await h.send("approve a", chat_id="c")
        await prompted(h, "c", 1)
        await h.send("/stop", chat_id="c")  # denies the request of the stopped turn
        await h.settle()
        state = h.session(h.session_key(chat_id="c"))
        assert state.turn.approval_requests == {}
        assert not state.holds_unsaved_data()


class SlowTimeoutNotice:
    """An adapter whose delivery of the timeout notice hangs until ``release`` is set."""

    def __init__(self) -> None:
        self.outbox: list[Outbound] = []
        self.sending_notice = asyncio.Event()
        self.release = asyncio.Event()

    async def __call__(self, outbound: Outbound) -> None:
        self.outbox.append(outbound)
        if outbound.kind is OutboundKind.NOTICE and "timed out" in outbound.text:
            self.sending_notice.set()
            await self.release.wait()


async def test_an_answer_after_the_deadline_is_refused_while_the_notice_is_sent() -> None:
    adapter = SlowTimeoutNotice()
    settings = GatewaySettings(runtime=RuntimeSettings(approval_timeout=0.05))
    gateway = Gateway(approving_agent, adapter, settings=settings)
    source = SessionSource("web", chat_id="c", user_id="u")
    try:
        await gateway.dispatch(InboundMessage(source, "approve rm -rf /"))
        await adapter.sending_notice.wait()
        await gateway.dispatch(InboundMessage(source, "/approve always"))
        adapter.release.set()
        await asyncio.wait_for(gateway.engine.wait_idle(), 5)
        texts = [o.text for o in adapter.outbox]
        assert not any(text.startswith("Approved") for text in texts), texts
        assert texts[-1] == "denied: rm -rf /"
        state = await gateway.engine.session(gateway.session_key(InboundMessage(source, "")))
        assert state.persistent.approval_allowlist == []
        stored = await gateway.engine.store.load_persistent(state.key)
        assert not stored.get("approval_allowlist")
    finally:
        adapter.release.set()
        await gateway.aclose()


class AsksWhileWindingDown:
    """Its first turn waits to be told to stop, then asks for approval anyway."""

    def __init__(self) -> None:
        self.running = asyncio.Event()
        self.asked = asyncio.Event()
        self.decisions: list[bool] = []

    async def __call__(self, turn: Turn) -> str:
        if self.running.is_set():
            return f"echo: {turn.text}"
        self.running.set()
        await turn.interrupted.wait()
        self.decisions.append(await turn.request_approval("rm -rf /"))
        self.asked.set()
        return "done"


async def test_a_turn_in_its_grace_period_cannot_open_a_request(tmp_path: Path) -> None:
    path = tmp_path / "chatlane.db"
    store = await open_store(f"sqlite:///{path}?busy_timeout=50")
    agent = AsksWhileWindingDown()
    leases = LeaseSettings(ttl=0.3, fence_check=0)
    try:
        settings: dict[str, Any] = {"leases": leases, "approval_timeout": 0.5}
        async with GatewayHarness(agent, store=store, interrupt_grace=30, **settings) as h:
            await h.send("first", chat_id="c")
            await agent.running.wait()
            with write_lock(path):  # renewals fail until the lease expires: the turn is let go
                await asyncio.wait_for(agent.asked.wait(), 10)
            assert agent.decisions == [False]
            assert approvals_sent(h.outbox) == []
    finally:
        await store.close()


async def test_a_turn_whose_lease_ran_out_here_is_denied_without_a_prompt() -> None:
    decisions: list[bool] = []

    async def agent(turn: Turn) -> str:
        if decisions:
            return "ran again"  # the stale run's messages run again, under a new lease
        assert turn.lease is not None
        expired = msgspec.structs.replace(turn.lease, expires_at=time.time() - 1)
        turn.renewed(expired)  # as a process paused past its lease finds it
        decisions.append(await turn.request_approval("rm -rf /important"))
        return "asked"

    async with GatewayHarness(agent, approval_timeout=2) as h:
        await h.send("go", chat_id="c")
        assert await h.replies(chat_id="c", count=1) == ["ran again"]
    assert decisions == [False]
    assert not any(o.kind is OutboundKind.APPROVAL for o in h.outbox)


class GatedConversations(MemoryStore):
    """Holds a boundary between its stop and its new conversation until ``gate`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.held = asyncio.Event()

    async def new_conversation(self, key: SessionKey, title: str = "") -> Conversation:
        self.held.set()
        await self.gate.wait()
        return await super().new_conversation(key, title)


async def test_a_message_arriving_during_a_boundary_asks_in_the_new_conversation() -> None:
    """No turn runs while a boundary does, so none can open a request the boundary
    would have to deny: the message waits, and asks once the new conversation began."""
    store = GatedConversations()
    options = LifecycleOptions(confirm_new=False)
    async with GatewayHarness(
        approving_agent, store=store, lifecycle=options, approval_timeout=30
    ) as h:
        boundary = asyncio.create_task(h.send("/new", chat_id="c"))
        await store.held.wait()  # stopped; the new conversation is not there yet
        await h.send("approve a", chat_id="c")
        assert not any(o.kind is OutboundKind.APPROVAL for o in h.outbox)
        store.gate.set()
        await boundary
        await prompted(h, "c", 1)
        await h.send("/approve", chat_id="c")
        await h.wait_for(lambda out: any(o.text == "approved: a" for o in out))
    texts = [o.text for o in h.outbox]
    assert texts.index("Started a new conversation.") < texts.index("approved: a")
