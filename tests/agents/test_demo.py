"""The demo agent: every mechanism visible, offline and deterministic."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from chatlane.agents.demo import DemoAgent, token_chunks
from chatlane.runtime.output import CUT_SHORT
from chatlane.stores import MemoryStore
from chatlane.testing import GatewayHarness
from chatlane.types import Attachment, AttachmentKind


async def test_whoami_reads_its_own_session_from_a_worker_thread() -> None:
    async with GatewayHarness(DemoAgent()) as h:
        await asyncio.gather(
            *(h.send("whoami", chat_id=f"c{i}", user_id=f"u{i}", platform="web") for i in range(20))
        )
        for i in range(20):
            [line] = await h.replies(chat_id=f"c{i}", count=1)
            assert line == f"platform=web chat=c{i} thread= user=u{i} key=main:web:dm:c{i} gen=1"


async def test_whoami_in_a_thread() -> None:
    async with GatewayHarness(DemoAgent()) as h:
        await h.send(
            "whoami",
            chat_id="g",
            chat_type="group",
            thread_id="t9",
            user_id="u5",
            platform="telegram",
        )
        [line] = await h.replies(chat_id="g", thread_id="t9", count=1)
        assert line.startswith(
            "platform=telegram chat=g thread=t9 user=u5 key=main:telegram:group:g:t9"
        )


async def test_echo_streams_in_chunks() -> None:
    async with GatewayHarness(DemoAgent()) as h:
        await h.send("hello there", chat_id="c")
        assert await h.replies(chat_id="c", count=1) == ["echo: hello there"]
        assert sum(o.kind.value == "chunk" for o in h.delivered(chat_id="c")) >= 3


async def test_sleep_and_its_limits() -> None:
    async with GatewayHarness(DemoAgent()) as h:
        for text in ("sleep 0.1", "sleep soon", "sleep nan", "sleep -1"):
            await h.send(text, chat_id="c")
        replies = await h.replies(chat_id="c", count=5)
        assert replies[1] == "slept 0.1"
        assert replies[2:] == ["usage: sleep <seconds> (at most 60)"] * 3


async def test_settings_and_approve() -> None:
    async with GatewayHarness(DemoAgent(), approval_timeout=0.2) as h:
        await h.send("/reasoning high", chat_id="c")
        await h.send("settings", chat_id="c")
        await h.replies(chat_id="c", count=2)
        await h.send("approve ls", chat_id="c")
        replies = await h.replies(chat_id="c", count=5)
        assert replies[1] == "model=default reasoning=high tier=default"
        assert replies[4] == "denied: ls"


async def test_sleep_waits_on_the_interrupted_event_instead_of_polling() -> None:
    async with GatewayHarness(DemoAgent(), interrupt_grace=30.0) as h:
        await h.send("sleep 30", chat_id="c")
        key = h.session_key(chat_id="c")
        await until(lambda: h.gateway.engine.running_turn(key) is not None)
        turn = h.gateway.engine.running_turn(key)
        assert turn is not None
        # the sleeping agent is parked on the event itself (asyncio keeps its waiters)
        await until(lambda: bool(turn.interrupted._waiters))
        await h.send("/stop", chat_id="c")
        replies = await h.replies(chat_id="c", count=1, timeout=10)
        assert replies == ["Stopped the running turn. Dropped 0 queued messages."]


async def until(predicate: Callable[[], bool]) -> None:
    """Yield to the loop until ``predicate`` holds (at most 10 s)."""
    async with asyncio.timeout(10):
        while True:
            if predicate():
                return
            await asyncio.sleep(0)


async def test_stream_sends_numbered_chunks_and_stops_when_interrupted() -> None:
    async with GatewayHarness(DemoAgent()) as h:
        await h.send("stream 3", chat_id="c")
        assert await h.replies(chat_id="c", count=1) == ["1\n2\n3\n"]
        chunks = [o.text for o in h.delivered(chat_id="c") if o.kind.value == "chunk"]
        assert chunks == ["1\n", "2\n", "3\n"]
        wrong = ("stream 0", "stream 51", "stream x", "stream", "stream " + "9" * 5000)
        for n, text in enumerate(wrong):
            await h.send(text, chat_id=f"u{n}")
            assert await h.replies(chat_id=f"u{n}", count=1) == ["usage: stream <n> (1 to 50)"]
        await h.send("stream 50", chat_id="g")
        await h.until_running(chat_id="g")
        await h.send("/stop", chat_id="g")
        await h.settle()
    streamed = [o.text for o in h.delivered(chat_id="g") if o.kind.value == "chunk"]
    assert len(streamed) < 50


async def test_tokens_sends_each_number_as_a_chunk_and_stops_when_interrupted() -> None:
    async with GatewayHarness(DemoAgent()) as h:
        await h.send("tokens 5", chat_id="c")
        assert await h.replies(chat_id="c", count=1) == ["1 2 3 4 5"]
        chunks = [o.text for o in h.delivered(chat_id="c") if o.kind.value == "chunk"]
        assert chunks == ["1", " 2", " 3", " 4", " 5"] == token_chunks(5)
        await h.send("tokens 0002", chat_id="z")
        assert await h.replies(chat_id="z", count=1) == ["1 2"]
        wrong = (
            "tokens 0",
            "tokens 2001",
            "tokens x",
            "tokens",
            "tokens \uff15",  # a fullwidth 5
            "tokens " + "9" * 5000,
        )
        for n, text in enumerate(wrong):
            await h.send(text, chat_id=f"u{n}")
            assert await h.replies(chat_id=f"u{n}", count=1) == ["usage: tokens <n> (1 to 2000)"]
        await h.send("tokens 2000", chat_id="g")
        await h.wait_for(lambda _: len(h.delivered(chat_id="g")) >= 2)
        await h.send("/stop", chat_id="g")
        await h.settle()
    streamed = [o.text for o in h.delivered(chat_id="g") if o.kind.value == "chunk"]
    assert 2 <= len(streamed) < 2000
    assert streamed == token_chunks(len(streamed))


async def test_context_lists_the_history_a_redirect_kept() -> None:
    store, agent = MemoryStore(), DemoAgent()
    agent.bind(store)
    async with GatewayHarness(agent, store=store, busy="redirect") as h:
        await h.send("context", chat_id="c")
        assert await h.replies(chat_id="c", count=1) == [
            "context: no history yet in this conversation"
        ]
        await h.send("stream 50", chat_id="c")
        await h.until_running(chat_id="c", text="stream 50")
        await h.wait_for(lambda out: any(o.text == "1\n" for o in out))  # one chunk shown
        await h.send("context", chat_id="c")
        await h.settle()
        listing = (await h.replies(chat_id="c", count=4))[-1]  # the ack is one too
    assert listing.startswith("context (4 entries):\nuser: context\nassistant: context: no")
    assert listing.endswith(f"user: stream 50\nassistant: 1 {CUT_SHORT}")


async def test_context_without_a_store_says_so() -> None:
    async with GatewayHarness(DemoAgent()) as h:
        await h.send("context", chat_id="c")
        assert await h.replies(chat_id="c", count=1) == ["context: no store to read history from"]


PHOTO = Attachment(AttachmentKind.IMAGE, "AgACAgI", "image/jpeg", 12_345, "photo.jpg")
VOICE = Attachment(AttachmentKind.VOICE, "AwACAgI", "audio/ogg", 2048)


async def test_echo_names_the_attachments() -> None:
    async with GatewayHarness(DemoAgent()) as h:
        await h.send("look", chat_id="c", attachments=(PHOTO,))
        await h.replies(chat_id="c", count=1)
        await h.send("", chat_id="c", attachments=(PHOTO, VOICE))
        assert await h.replies(chat_id="c", count=2) == [
            "echo: look (1 attachment: photo.jpg image/jpeg 12 KB)",
            "echo: (2 attachments: photo.jpg image/jpeg 12 KB; voice audio/ogg 2 KB)",
        ]


async def test_context_lists_the_attachments_the_transcript_kept() -> None:
    store = MemoryStore()
    agent = DemoAgent()
    agent.bind(store)
    async with GatewayHarness(agent, store=store) as h:
        await h.send("", chat_id="c", attachments=(VOICE,))
        await h.replies(chat_id="c", count=1)
        await h.send("context", chat_id="c")
        listing = (await h.replies(chat_id="c", count=2))[1]
    assert listing.splitlines()[1] == "user: (1 attachment: voice audio/ogg 2 KB)"
