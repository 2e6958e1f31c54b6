"""Grants in a shared session: an answer given in advance is bound as an answer is.

In a session several people write in (a Slack thread here), ``/approve session``
and ``/approve always`` approve their giver's later turns only: another user's
turn is asked, whoever allowed the command before. A session of one person (a
DM, a group split by user) is as it was, and so is what its store keeps. Grants
kept in a store outlive the process, still bound to their giver.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from chatlane.identity import SessionKey
from chatlane.lifecycle import LifecycleOptions
from chatlane.stores import MemoryStore, Store
from chatlane.stores.fields import APPROVAL_ALLOWLIST
from chatlane.testing import GatewayHarness
from chatlane.types import Outbound, OutboundKind
from tests.runtime.agents import approving_agent
from tests.stores.conftest import forget_store, own_schema

CHAT, THREAD = "C1", "1700000000.000100"
"""A Slack thread: one session for everyone who writes in it (the default key policy)."""

BY_USER = "approval_allowlist_by_user"
"""The stored field of grants bound to users, by name: renaming it is a data migration."""

COMMAND = "deploy --prod"
ASKED = "Approval needed: `deploy --prod` — the test wants it"


async def says(h: GatewayHarness, user_id: str, text: str) -> None:
    """``user_id`` writes ``text`` in the shared thread."""
    await h.send(
        text, platform="slack", chat_id=CHAT, chat_type="group", thread_id=THREAD, user_id=user_id
    )


def thread_key(h: GatewayHarness) -> SessionKey:
    return h.session_key(platform="slack", chat_id=CHAT, chat_type="group", thread_id=THREAD)


def prompts(outbox: list[Outbound]) -> list[Outbound]:
    return [o for o in outbox if o.kind is OutboundKind.APPROVAL and o.target.chat_id == CHAT]


async def asked(h: GatewayHarness, count: int) -> None:
    """Wait until the thread got its ``count``-th approval prompt."""
    await h.wait_for(lambda outbox: len(prompts(outbox)) >= count)


async def thread_says(h: GatewayHarness, count: int) -> list[str]:
    """The thread's first ``count`` replies, once its turns are all over."""
    replies = await h.replies(chat_id=CHAT, thread_id=THREAD, count=count)
    await h.settle()
    return replies


async def alice_grants(h: GatewayHarness, grant: str) -> list[str]:
    """Alice asks for the command and allows it with ``grant``; the thread's replies."""
    await says(h, "alice", f"approve {COMMAND}")
    await asked(h, 1)
    await says(h, "alice", f"/approve {grant}")
    return await thread_says(h, 3)


async def mallory_is_asked(h: GatewayHarness, prompt: int, seen: int) -> list[str]:
    """Mallory asks for the command, is prompted (the ``prompt``-th one), and denies it."""
    await says(h, "mallory", f"approve {COMMAND}")
    await asked(h, prompt)
    await says(h, "mallory", "/deny")
    return (await thread_says(h, seen + 3))[seen:]


@pytest.mark.parametrize("grant", ["session", "always"])
async def test_a_grant_in_a_shared_thread_approves_its_givers_turns_only(grant: str) -> None:
    async with GatewayHarness(approving_agent) as h:
        given = await alice_grants(h, grant)
        mallory = await mallory_is_asked(h, prompt=2, seen=3)
        await says(h, "alice", f"approve {COMMAND}")
        again = (await thread_says(h, 7))[6:]
        state = h.session(thread_key(h))
    assert given[1:] == [
        f"Approved ({grant}, for `alice` only): `deploy --prod`",
        "approved: deploy --prod",
    ]
    assert mallory[0].startswith(ASKED)
    assert mallory[1:] == ["Denied: `deploy --prod`", "denied: deploy --prod"]
    assert again == ["approved: deploy --prod"]  # no prompt: her own grant
    assert len(prompts(h.outbox)) == 2
    bound = (("alice", COMMAND),)
    kept = state.conversation.approval_grants_by_user, state.persistent.approval_allowlist_by_user
    assert kept == ((bound, ()) if grant == "session" else ((), bound))
    assert state.conversation.approval_grants == state.persistent.approval_allowlist == []


async def test_a_session_grant_in_a_shared_thread_ends_with_the_conversation() -> None:
    async with GatewayHarness(approving_agent, lifecycle=LifecycleOptions(confirm_new=False)) as h:
        await alice_grants(h, "session")
        await says(h, "alice", "/new")
        await thread_says(h, 4)
        await says(h, "alice", f"approve {COMMAND}")
        await asked(h, 2)
        await says(h, "alice", "/approve")
        replies = await thread_says(h, 7)
    assert replies[4].startswith(ASKED)
    assert replies[5:] == ["Approved (once): `deploy --prod`", "approved: deploy --prod"]


@pytest.mark.parametrize(
    ("chat_type", "thread"),
    [("dm", None), ("group", None)],  # a DM; a group's session of one member (the default)
    ids=["dm", "group-per-user"],
)
@pytest.mark.parametrize("grant", ["session", "always"])
async def test_a_grant_in_a_session_of_one_person_is_as_before(
    chat_type: str, thread: str | None, grant: str
) -> None:
    async with GatewayHarness(approving_agent) as h:

        async def alice(text: str) -> None:
            await h.send(text, chat_id="c", user_id="alice", chat_type=chat_type, thread_id=thread)

        await alice(f"approve {COMMAND}")
        await h.wait_for(lambda outbox: len(approvals_in(outbox, "c")) == 1)
        await alice(f"/approve {grant}")
        await h.replies(chat_id="c", count=3)
        await h.settle()
        await alice(f"approve {COMMAND}")
        replies = await h.replies(chat_id="c", count=4)
        await h.settle()
        key = h.session_key(chat_id="c", user_id="alice", chat_type=chat_type, thread_id=thread)
        stored = await h.gateway.engine.store.load_persistent(key)
    assert replies[1:] == [
        f"Approved ({grant}): `deploy --prod`",
        "approved: deploy --prod",
        "approved: deploy --prod",
    ]
    assert len(approvals_in(h.outbox, "c")) == 1
    assert BY_USER not in stored
    assert stored.get(APPROVAL_ALLOWLIST) == ([COMMAND] if grant == "always" else None)


def approvals_in(outbox: list[Outbound], chat_id: str) -> list[Outbound]:
    return [o for o in outbox if o.kind is OutboundKind.APPROVAL and o.target.chat_id == chat_id]


@pytest.fixture(params=["memory", "sqlite", "redis", "postgres"])
async def lasting(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Store | str]:
    """A store that outlives a gateway: a memory store both use, or a URL each opens."""
    if request.param == "memory":
        yield MemoryStore()
        return
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'grants.db'}"
    elif request.param == "redis":
        server: str = request.getfixturevalue("redis_url")
        url = f"{server}{'&' if '?' in server else '?'}prefix=grants-{secrets.token_hex(6)}"
    else:
        url = own_schema(request.getfixturevalue("postgres_url"), "grants")
    yield url
    await forget_store(url)


async def test_an_always_grant_stays_its_givers_across_a_restart(lasting: Store | str) -> None:
    async with GatewayHarness(approving_agent, store=lasting) as h:
        await alice_grants(h, "always")
        stored = await h.gateway.engine.store.load_persistent(thread_key(h))
    async with GatewayHarness(approving_agent, store=lasting) as h:
        mallory = await mallory_is_asked(h, prompt=1, seen=0)
        await says(h, "alice", f"approve {COMMAND}")
        again = (await thread_says(h, 4))[3:]
        kept = h.session(thread_key(h)).persistent.approval_allowlist_by_user
    assert mallory[0].startswith(ASKED)
    assert again == ["approved: deploy --prod"]
    assert kept == (("alice", COMMAND),)
    assert stored[BY_USER] == {"alice": [COMMAND]}
    assert APPROVAL_ALLOWLIST not in stored  # a process of an earlier version applies nothing


async def test_an_allowlist_kept_before_grants_were_bound_approves_no_one_in_a_shared_thread(
    tmp_path: Path,
) -> None:
    """An entry without its giver may have been anyone's: in a shared session it approves
    no one, and whoever allows the command again has it bound to them."""
    url = f"sqlite:///{tmp_path / 'older.db'}"
    async with GatewayHarness(approving_agent, store=url) as h:
        key = thread_key(h)
        await h.gateway.engine.store.set_persistent(key, None, **{APPROVAL_ALLOWLIST: [COMMAND]})
        mallory = await mallory_is_asked(h, prompt=1, seen=0)
        await says(h, "alice", f"approve {COMMAND}")
        await asked(h, 2)
        await says(h, "alice", "/approve always")
        alice = (await thread_says(h, 6))[3:]
        stored = await h.gateway.engine.store.load_persistent(key)
    assert mallory[0].startswith(ASKED)
    assert alice[0].startswith(ASKED)
    assert alice[1:] == [
        "Approved (always, for `alice` only): `deploy --prod`",
        "approved: " + COMMAND,
    ]
    assert stored[APPROVAL_ALLOWLIST] == [COMMAND]  # left as it was, for an earlier version
    assert stored[BY_USER] == {"alice": [COMMAND]}


async def test_an_allowlist_kept_before_grants_were_bound_still_approves_in_a_dm(
    tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path / 'older.db'}"
    async with GatewayHarness(approving_agent, store=url) as h:
        key = h.session_key(chat_id="c", user_id="alice")
        await h.gateway.engine.store.set_persistent(key, None, **{APPROVAL_ALLOWLIST: [COMMAND]})
        await h.send(f"approve {COMMAND}", chat_id="c", user_id="alice")
        assert await h.replies(chat_id="c", count=1) == ["approved: deploy --prod"]


async def test_a_lasting_grant_from_no_known_user_in_a_shared_thread_is_kept_for_this_request() -> (
    None
):
    """A post without a sender (a channel's own) may be answered by anyone; an answer
    without a sender either can bind a grant to no one: it approves this request only."""
    async with GatewayHarness(approving_agent) as h:
        await says(h, "", f"approve {COMMAND}")
        await asked(h, 1)
        await says(h, "", "/approve always")
        replies = await thread_says(h, 3)
        state = h.session(thread_key(h))
    assert replies[1] == (
        "Approved (once): `deploy --prod` — it is not kept for later: in a shared session a "
        "grant is its giver's, and this answer came from no known user"
    )
    assert replies[2] == "approved: deploy --prod"
    assert state.persistent.approval_allowlist_by_user == ()
    assert state.persistent.approval_allowlist == []
