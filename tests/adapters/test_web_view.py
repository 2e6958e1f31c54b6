"""Each message shows once in a tab, with its answer, however its turn and the tab's connect
interleave (:mod:`chatlane.adapters.web_view`), and whichever process accepted it.

The interleavings are forced: the store holds one call of the tab's greeting (or of a
reply's delivery) until the test lets it go, and the agent holds its turn likewise.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from chatlane.adapters.web_page import IDENTITY_COOKIE
from chatlane.adapters.web_view import View
from chatlane.hub import Hub
from chatlane.identity import ChatType, SessionSource
from chatlane.stores import MemoryStore
from chatlane.stores.base import Conversation
from chatlane.stores.codec import encode_message
from chatlane.types import InboundMessage, SessionKey
from tests.adapters.test_web import (
    WAIT,
    Event,
    HeldEnqueues,
    browser_id,
    chat_socket,
    greeted,
    say,
    say_as,
    until,
    until_running,
    web_hub,
)
from tests.runtime.test_durable import Holding


@dataclass
class Hold:
    """One store call held: :attr:`reached` once it is made, and it goes on at :attr:`go_on`."""

    reached: asyncio.Event = field(default_factory=asyncio.Event)
    go_on: asyncio.Event = field(default_factory=asyncio.Event)

    async def until_reached(self) -> None:
        async with asyncio.timeout(WAIT):
            await self.reached.wait()


class Gated(MemoryStore):
    """A memory store whose next call of a method named to :meth:`hold` waits to be let go."""

    def __init__(self) -> None:
        super().__init__()
        self._holds: dict[str, Hold] = {}

    def hold(self, name: str) -> Hold:
        """Hold the next call of ``conversation`` or ``conversations``."""
        hold = self._holds[name] = Hold()
        return hold

    async def _through(self, name: str) -> None:
        hold = self._holds.pop(name, None)
        if hold is not None:
            hold.reached.set()
            await hold.go_on.wait()

    async def conversation(self, key: SessionKey) -> Conversation:
        await self._through("conversation")
        return await super().conversation(key)

    async def conversations(self, key: SessionKey, limit: int = 20) -> list[Conversation]:
        await self._through("conversations")
        return await super().conversations(key, limit)


def page(events: list[Event]) -> list[tuple[str, str]]:
    """What the page shows of ``events``, as ``app.js`` draws them: a history replaces
    everything, a message from another tab and a reply are added."""
    shown: list[tuple[str, str]] = []
    for event in events:
        if event["type"] == "history":
            shown = [(m["role"], m["text"]) for m in event["messages"]]
        elif event["type"] == "user":
            shown.append(("user", event["text"]))
        elif event["type"] == "reply":
            shown.append(("assistant", event["text"]))
    return shown


async def test_a_reply_committed_while_a_tab_reads_its_history_follows_it() -> None:
    """The reply is delivered while the new tab's greeting reads the conversation list,
    after its transcript: it must not come before the history, which would wipe it."""
    store, agent = Gated(), Holding()
    async with web_hub(agent=agent, opened=store) as (host, _):
        bid = await browser_id(host)
        async with greeted(host, bid) as (first, _):
            await say(first, "hold")
            await until_running(first)
            listing = store.hold("conversations")  # after the new tab's transcript
            async with chat_socket(host, f"{IDENTITY_COOKIE}={bid}") as second:
                await listing.until_reached()
                agent.released.set()
                await until(first, "reply", "held")  # committed and delivered
                listing.go_on.set()
                await say(second, "after")
                events = await until(second, "reply", "echo: after")
    assert page(events) == [("user", "hold"), ("assistant", "held"), ("assistant", "echo: after")]


async def test_a_reply_delivered_after_the_history_that_shows_it_is_not_sent_again() -> None:
    """The reply is committed before the new tab reads its transcript, and delivered after."""
    store, agent = Gated(), Holding()
    async with web_hub(agent=agent, opened=store) as (host, _):
        bid = await browser_id(host)
        async with greeted(host, bid) as (first, _):
            await say(first, "hold")
            await until_running(first)
            delivery = store.hold("conversation")  # the reply's, once committed
            agent.released.set()
            await delivery.until_reached()
            async with greeted(host, bid) as (second, greeting):
                delivery.go_on.set()
                await until(first, "reply", "held")
                await say(second, "after")
                events = await until(second, "reply", "echo: after")
    shown = page([greeting["history"], *events])
    assert shown == [("user", "hold"), ("assistant", "held"), ("assistant", "echo: after")]


async def test_a_message_being_handed_on_when_a_tab_connects_shows_there() -> None:
    store = HeldEnqueues()
    async with web_hub(opened=store) as (host, _):
        bid = await browser_id(host)
        async with greeted(host, bid) as (first, _):
            said = await say_as(first, "on its way", "r1")  # read: it is being handed on
            async with greeted(host, bid) as (second, _):
                store.go_on.set()
                events = await until(second, "reply", "echo: on its way")
    assert page(events) == [("user", "on its way"), ("assistant", "echo: on its way")]
    assert [e["id"] for e in events if e["type"] == "user"] == [said]


GONE = "a-process-that-stopped"
TOLD = ("user", "state")


async def left_behind(hub: Hub, bid: str, text: str) -> InboundMessage:
    """A message of browser ``bid`` that the process :data:`GONE` took and left in the
    store's queue; that process still counts as alive, so it is not taken over yet."""
    issued = bid.partition(".")[0]
    source = SessionSource("web", chat_id=issued, user_id=issued, chat_type=ChatType.DM)
    message = InboundMessage(source, text)
    await hub.store.heartbeat(GONE, 3600)
    key = hub.gateway.session_key(message)
    await hub.store.enqueue(key, message.id, GONE, encode_message(message))
    return message


async def test_a_message_another_process_left_shows_on_connect_and_when_taken_over() -> None:
    """The tab that connects after it was queued shows it at once, and its state when it
    is taken over; the tab that connected before shows it then, once, with that state."""
    async with web_hub() as (host, hub):
        bid = await browser_id(host)
        async with greeted(host, bid) as (before, earlier):
            message = await left_behind(hub, bid, "left behind")
            async with greeted(host, bid) as (after, greeting):
                await hub.store.heartbeat(GONE, 0)  # it stopped
                await hub.gateway.engine.upkeep.adopt_once()
                late = await until(after, "reply")
                early = await until(before, "reply")
    for shown, events in ((greeting, late), (earlier, early)):
        assert page([shown["history"], *events]) == [
            ("user", "left behind"),
            ("assistant", "echo: left behind"),
        ]
        told = [(e["type"], e["id"], e.get("state")) for e in events if e["type"] in TOLD]
        assert told == [("user", message.id, None), ("state", message.id, "running")]
    assert late[0] == {"type": "user", "text": "left behind", "id": message.id}  # on connect


def test_a_view_shows_each_message_once_until_a_history_replaces_it() -> None:
    view = View()
    said = {"type": "user", "text": "hi", "id": "m1"}
    asked = {"type": "approval", "text": "?", "id": "m1", "approval_id": "a1"}
    assert [view.admits(e) for e in (said, asked, said, asked)] == [True, True, False, False]
    assert view.admits({"type": "outcome", "id": "m1", "outcome": "answered"})
    assert (view.users, view.approvals) == (set(), {})  # forgotten once ended
    history = {"type": "history", "conversation": "c", "messages": [{"id": "m1"}, {"id": ""}]}
    assert view.admits(history)
    reply = {"type": "reply", "text": "hello", "id": "m1"}
    assert not view.admits(reply)  # the history shows it
    assert view.admits({**reply, "id": ""})  # a reply to no message of the history
