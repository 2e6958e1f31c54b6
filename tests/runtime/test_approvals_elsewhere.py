"""Approvals in a deployment of several processes on one store: an answer that reaches
another process than the one whose turn asked goes there through the store, and is
resolved there as a local answer, at that process's next fence check (made by hand here).
A plain yes or no is then an answer, never queued for the agent; with no request waiting
elsewhere everything is handled as before."""

from __future__ import annotations

import asyncio
from contextvars import Context

import pytest

from chatlane.approvals import HOW_TO_ANSWER
from chatlane.context import current_session
from chatlane.errors import StoreError
from chatlane.identity import KeyPolicy
from chatlane.runtime.turn import Turn
from chatlane.stores import MemoryStore, Store
from chatlane.stores.fields import APPROVAL_ALLOWLIST, APPROVALS_WAITING
from chatlane.testing import GatewayHarness
from chatlane.types import Outbound, OutboundKind, SessionKey
from tests.runtime.agents import approving_agent
from tests.runtime.processes import two_processes

ASKED = f"Approval needed: `rm -rf /tmp/x` — the test wants it\n{HOW_TO_ANSWER}"
PASSED_ON = "Passed on to the gateway process running this turn: {} `rm -rf /tmp/x`{}. "
TOLD_LATER = "That process tells this chat when it applies it (unless the request ended first)."


async def asks_or_echoes(turn: Turn) -> str:
    """``approve <command>`` asks for approval; anything else is echoed."""
    if turn.text.startswith("approve "):
        return await approving_agent(turn)
    return f"echo: {turn.text}"


def prompts(out: list[Outbound], chat_id: str) -> list[Outbound]:
    return [o for o in out if o.kind is OutboundKind.APPROVAL and o.target.chat_id == chat_id]


async def asked(h: GatewayHarness, chat_id: str, count: int = 1) -> str:
    """Wait for the ``count``-th approval prompt in ``chat_id``; the id of its request."""
    out = await h.wait_for(lambda out: len(prompts(out, chat_id)) >= count)
    return prompts(out, chat_id)[count - 1].approval_id


async def users_said(store: Store, key: SessionKey) -> list[str]:
    return [e.content for e in await store.transcript(key) if e.role == "user"]


@pytest.mark.parametrize(
    ("answer", "passed", "applied"),
    [
        ("/approve", ("approve (once)", ""), ["Approved (once): `rm -rf /tmp/x`"]),
        ("/approve all", ("approve (once)", ""), ["Approved (once): `rm -rf /tmp/x`"]),
        ("yes", ("approve (once)", ""), ["Approved (once): `rm -rf /tmp/x`"]),
        ("/approve session", ("approve (session)", ""), ["Approved (session): `rm -rf /tmp/x`"]),
        ("/deny all not now", ("deny", " — not now"), ["Denied: `rm -rf /tmp/x` — not now"]),
        ("no", ("deny", ""), ["Denied: `rm -rf /tmp/x`"]),
        ("button", ("approve (once)", ""), ["Approved (once): `rm -rf /tmp/x`"]),
    ],
)
async def test_an_answer_sent_to_another_process_is_applied_where_the_request_waits(
    two_stores: tuple[Store, Store], answer: str, passed: tuple[str, str], applied: list[str]
) -> None:
    here, there = two_stores
    agents = (asks_or_echoes, asks_or_echoes)
    async with two_processes(two_stores, agents, "queue") as (runner, other):
        first = await runner.send("approve rm -rf /tmp/x", chat_id="c")
        request_id = await asked(runner, "c")
        text = f"/approve #{request_id}" if answer == "button" else answer
        sent = await other.send(text, chat_id="c")
        assert sent.command in {"approve", "deny"}
        assert not sent.started
        assert await other.replies(chat_id="c", count=1) == [PASSED_ON.format(*passed) + TOLD_LATER]
        key = first.session_key
        assert runner.gateway.engine.approvals.has_pending(runner.session(key))
        await runner.gateway.engine.upkeep.check_fences()
        replies = await runner.replies(chat_id="c", count=3)
        await runner.settle()
        await other.settle()
        await asyncio.gather(*runner.gateway.engine.slots.spawned())  # the record's removal
        assert (await there.load_persistent(key))[APPROVALS_WAITING] == []
    outcome = "approved" if applied[0].startswith("Approved") else "denied"
    assert replies == [ASKED, *applied, f"{outcome}: rm -rf /tmp/x"]
    assert await users_said(here, key) == ["approve rm -rf /tmp/x"]  # no turn for a yes or no


async def test_always_from_another_process_is_kept_in_the_store_and_then_needs_no_prompt(
    two_stores: tuple[Store, Store],
) -> None:
    here, there = two_stores
    agents = (asks_or_echoes, asks_or_echoes)
    async with two_processes(two_stores, agents, "queue") as (runner, other):
        first = await runner.send("approve rm -rf /tmp/x", chat_id="c")
        await asked(runner, "c")
        await other.send("/approve always", chat_id="c")
        await runner.gateway.engine.upkeep.check_fences()
        replies = await runner.replies(chat_id="c", count=3)
        await runner.settle()
        key = first.session_key
        assert (await there.load_persistent(key))[APPROVAL_ALLOWLIST] == ["rm -rf /tmp/x"]
        await runner.send("approve rm -rf /tmp/x", chat_id="c")
        again = await runner.replies(chat_id="c", count=4)
        await runner.settle()
    assert replies[1:] == ["Approved (always): `rm -rf /tmp/x`", "approved: rm -rf /tmp/x"]
    assert again[3] == "approved: rm -rf /tmp/x"
    assert len(prompts(runner.outbox, "c")) == 1
    assert await users_said(here, key) == ["approve rm -rf /tmp/x"] * 2


async def test_only_the_asker_can_answer_from_another_process(
    two_stores: tuple[Store, Store],
) -> None:
    shared = KeyPolicy(group_sessions_per_user=False)
    agents = (asks_or_echoes, asks_or_echoes)
    async with two_processes(two_stores, agents, "queue", key_policy=shared) as (runner, other):
        first = await runner.send(
            "approve rm -rf /tmp/x", user_id="alice", chat_id="g", chat_type="group"
        )
        await asked(runner, "g")
        await other.send("/approve", user_id="mallory", chat_id="g", chat_type="group")
        sent = await other.send("yes", user_id="mallory", chat_id="g", chat_type="group")
        assert sent.command == "approve"
        refused = "Only the person whose message started this turn can answer its approval."
        assert await other.replies(chat_id="g", count=2) == [refused, refused]
        await runner.gateway.engine.upkeep.check_fences()
        assert runner.gateway.engine.approvals.has_pending(runner.session(first.session_key))
        await other.send("/approve", user_id="alice", chat_id="g", chat_type="group")
        await runner.gateway.engine.upkeep.check_fences()
        replies = await runner.replies(chat_id="g", count=3)
        await runner.settle()
    assert replies[1:] == ["Approved (once): `rm -rf /tmp/x`", "approved: rm -rf /tmp/x"]


@pytest.mark.parametrize("grant", ["session", "always"])
async def test_a_grant_passed_on_in_a_shared_session_is_its_givers_where_it_applies(
    two_stores: tuple[Store, Store], grant: str
) -> None:
    """The answer keeps who gave it: the process running the turn binds its grant to
    Alice, so Mallory's next turn there is asked, and Alice's is not."""
    _, there = two_stores
    shared = KeyPolicy(group_sessions_per_user=False)
    agents = (asks_or_echoes, asks_or_echoes)
    async with two_processes(two_stores, agents, "queue", key_policy=shared) as (runner, other):

        async def says(h: GatewayHarness, user_id: str, text: str) -> None:
            await h.send(text, user_id=user_id, chat_id="g", chat_type="group")

        await says(runner, "alice", "approve rm -rf /tmp/x")
        await asked(runner, "g")
        await says(other, "alice", f"/approve {grant}")
        passed = await other.replies(chat_id="g", count=1)
        await runner.gateway.engine.upkeep.check_fences()
        applied = await runner.replies(chat_id="g", count=3)
        await runner.settle()
        await says(runner, "mallory", "approve rm -rf /tmp/x")
        await asked(runner, "g", count=2)
        await says(runner, "mallory", "/deny")
        await runner.replies(chat_id="g", count=6)
        await runner.settle()
        await says(runner, "alice", "approve rm -rf /tmp/x")
        again = await runner.replies(chat_id="g", count=7)
        await runner.settle()
        stored = await there.load_persistent(runner.session_key(chat_id="g", chat_type="group"))
    whose = f"({grant}, for `alice` only)"
    assert passed == [PASSED_ON.format(f"approve {whose}", "") + TOLD_LATER]
    assert applied[1:] == [f"Approved {whose}: `rm -rf /tmp/x`", "approved: rm -rf /tmp/x"]
    assert again[3:] == [ASKED, "Denied: `rm -rf /tmp/x`", "denied: rm -rf /tmp/x", applied[2]]
    assert len(prompts(runner.outbox, "g")) == 2
    kept = {"alice": ["rm -rf /tmp/x"]} if grant == "always" else None
    assert stored.get("approval_allowlist_by_user") == kept
    assert APPROVAL_ALLOWLIST not in stored


async def test_an_answer_to_a_request_that_ended_never_reaches_the_next_one(
    two_stores: tuple[Store, Store],
) -> None:
    agents = (asks_or_echoes, asks_or_echoes)
    async with two_processes(two_stores, agents, "queue") as (runner, other):
        first = await runner.send("approve one", chat_id="c")
        old = await asked(runner, "c")
        await runner.send("/deny", chat_id="c")
        await runner.settle()
        await runner.send("approve two", chat_id="c")
        new = await asked(runner, "c", count=2)
        await other.send(f"/approve #{old}", chat_id="c")
        not_pending = "That approval is no longer pending (it was answered, or its turn ended)."
        assert await other.replies(chat_id="c", count=1) == [not_pending]
        await runner.gateway.engine.upkeep.check_fences()
        key = first.session_key
        [waiting] = runner.gateway.engine.approvals.pending(runner.session(key))
        assert waiting.id == new
        await other.send(f"/deny #{new}", chat_id="c")
        await runner.gateway.engine.upkeep.check_fences()
        await runner.settle()
    texts = [o.text for o in runner.delivered(chat_id="c") if o.kind is not OutboundKind.APPROVAL]
    assert texts[-2:] == ["Denied: `two`", "denied: two"]


async def test_with_no_request_waiting_elsewhere_answers_and_words_are_handled_as_before(
    two_stores: tuple[Store, Store],
) -> None:
    here, _ = two_stores
    released = asyncio.Event()

    async def busy_until_released(turn: Turn) -> str:
        if turn.text == "busy":
            await released.wait()
        return f"echo: {turn.text}"

    agents = (busy_until_released, busy_until_released)
    async with two_processes(two_stores, agents, "queue") as (runner, other):
        first = await runner.send("busy", chat_id="c")
        await runner.until_running(chat_id="c")
        await other.send("/approve", chat_id="c")
        assert await other.replies(chat_id="c", count=1) == ["No approval is pending."]
        sent = await other.send("yes", chat_id="c")
        assert sent.command is None  # a message for the agent, waiting its turn
        released.set()
        await runner.settle()
        replies = await other.replies(chat_id="c", count=3)
        await other.settle()
    assert replies == [
        "No approval is pending.",
        "Queued for the next turn (this conversation is busy)",
        "echo: yes",
    ]
    assert await users_said(here, first.session_key) == ["busy", "yes"]


class CountsLeaseReads(MemoryStore):
    """Counts the reads of who holds a session's lease."""

    reads = 0

    async def lease_holder(self, key: SessionKey) -> str | None:
        self.reads += 1
        return await super().lease_holder(key)


async def test_only_an_approval_answer_with_no_request_here_reads_the_store_for_one() -> None:
    store = CountsLeaseReads()
    async with GatewayHarness(asks_or_echoes, store=store) as h:
        await h.send("hello", chat_id="c")
        await h.settle()
        await h.send("approve rm -rf /tmp/x", chat_id="c")
        await asked(h, "c")
        await h.send("yes", chat_id="c")
        await h.replies(chat_id="c", count=4)
        await h.settle()
        assert store.reads == 0
        await h.send("/deny", chat_id="c")
        assert store.reads == 1
        await h.send("no", chat_id="c")
        assert store.reads == 2
        replies = await h.replies(chat_id="c", count=6)
        await h.settle()
    assert replies[4] == "No approval is pending."
    assert replies[5] == "echo: no"


class LeaseUnreadable(MemoryStore):
    async def lease_holder(self, key: SessionKey) -> str | None:
        raise StoreError("the store is down")


async def test_a_store_that_cannot_say_who_runs_the_session_leaves_answers_as_before() -> None:
    async with GatewayHarness(asks_or_echoes, store=LeaseUnreadable()) as h:
        await h.send("/approve", chat_id="c")
        sent = await h.send("yes", chat_id="c")
        assert sent.started
        replies = await h.replies(chat_id="c", count=2)
        await h.settle()
    assert replies == ["No approval is pending.", "echo: yes"]


async def test_an_answer_passed_on_that_arrives_after_the_deadline_grants_nothing(
    two_stores: tuple[Store, Store],
) -> None:
    agents = (asks_or_echoes, asks_or_echoes)
    async with two_processes(two_stores, agents, "queue", approval_timeout=0.5) as (
        runner,
        other,
    ):
        await runner.send("approve rm -rf /tmp/x", chat_id="c")
        await asked(runner, "c")
        await other.send("/approve always", chat_id="c")  # recorded; not yet taken up there
        await runner.wait_for(lambda out: any("timed out" in o.text for o in out))
        await runner.gateway.engine.upkeep.check_fences()
        await runner.settle()
    texts = [o.text for o in runner.delivered(chat_id="c")]
    assert texts[1:] == [
        "Approval for `rm -rf /tmp/x` timed out — denied.",
        "denied: rm -rf /tmp/x",
    ]


async def test_a_notice_of_an_answer_given_elsewhere_is_delivered_with_its_session_bound(
    two_stores: tuple[Store, Store],
) -> None:
    """The process whose turn waits resolves the answer at a fence check of its upkeep loop,
    where no session is bound: the notice still reaches the adapter (and its filters) with
    that turn's session bound, as its prompt did."""
    seen: list[tuple[OutboundKind, str | None]] = []

    def bound(outbound: Outbound) -> bool:
        session = current_session()
        seen.append((outbound.kind, None if session is None else session.session_key))
        return True

    async with two_processes(two_stores, (asks_or_echoes, asks_or_echoes), "queue") as pair:
        runner, other = pair
        runner.gateway.add_outbound_filter(bound)
        first = await runner.send("approve rm -rf /tmp/x", chat_id="c")
        await asked(runner, "c")
        await other.send("/approve", chat_id="c")
        await other.replies(chat_id="c", count=1)
        await asyncio.create_task(runner.gateway.engine.upkeep.check_fences(), context=Context())
        await runner.replies(chat_id="c", count=3)
        await runner.settle()
    assert seen[:2] == [
        (OutboundKind.APPROVAL, first.session_key),
        (OutboundKind.NOTICE, first.session_key),
    ]
