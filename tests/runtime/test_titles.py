"""Conversation titles at run time: from the first message, or set by the agent with its answer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from chatlane.lifecycle import LifecycleOptions
from chatlane.runtime.turn import Turn
from chatlane.stores import Lease, Store, WriteBatch, open_store
from chatlane.testing import GatewayHarness
from chatlane.titles import TITLE_LIMIT

NO_CONFIRM = LifecycleOptions(confirm_new=False)


async def naming_agent(turn: Turn) -> str:
    """``name: A | B …`` sets each title in turn; ``fail`` raises after naming; else echoes."""
    text = turn.text
    if text.startswith("name:"):
        for title in text.removeprefix("name:").split("|"):
            try:
                turn.set_title(title)
            except ValueError as refused:
                return f"refused: {refused}"
        return f"named {turn.chosen_title!r}"
    if text == "fail":
        turn.set_title("Named before failing")
        raise RuntimeError("the agent broke")
    return f"echo: {text}"


@pytest.fixture(params=["memory", "sqlite"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return "memory" if request.param == "memory" else f"sqlite:///{tmp_path / 't.db'}"


async def say(h: GatewayHarness, *texts: str) -> list[str]:
    """Send each of ``texts`` once the one before was answered; their answers."""
    answers = []
    for text in texts:
        count = len(h.delivered(chat_id="c")) + 1
        await h.send(text, chat_id="c")
        answers.append((await h.replies(chat_id="c", count=count))[-1])
    return answers


async def titles(h: GatewayHarness, chat_id: str = "c") -> list[str]:
    """The titles of the chat's conversations, newest first."""
    store = h.gateway.engine.store
    return [c.title for c in await store.conversations(h.session_key(chat_id=chat_id))]


class TestFromTheFirstMessage:
    async def test_the_first_message_titles_the_conversation(self, store_url: str) -> None:
        async with GatewayHarness(naming_agent, store=store_url, lifecycle=NO_CONFIRM) as h:
            await say(h, "  Plan the   trip\nto Lisbon, with details", "a later message")
            assert await titles(h) == ["Plan the trip"]
            await say(h, "/new", "x" * 500)
            assert await titles(h) == ["x" * (TITLE_LIMIT - 1) + "…", "Plan the trip"]

    async def test_a_message_with_nothing_to_show_leaves_it_for_the_next(self) -> None:
        async with GatewayHarness(naming_agent) as h:
            await h.send("\u200b", chat_id="c")
            await h.replies(chat_id="c", count=1)
            assert await titles(h) == [""]
            await h.send("Something to show", chat_id="c")
            await h.replies(chat_id="c", count=2)
            assert await titles(h) == ["Something to show"]

    async def test_a_failed_turn_titles_it_too(self) -> None:
        async with GatewayHarness(naming_agent) as h:
            await h.send("fail", chat_id="c")
            [notice] = await h.replies(chat_id="c", count=1)
            assert "RuntimeError" in notice
            assert await titles(h) == ["Named before failing"]

    async def test_a_restarted_process_keeps_the_first_title(self, tmp_path: Path) -> None:
        url = f"sqlite:///{tmp_path / 'r.db'}"
        async with GatewayHarness(naming_agent, store=url) as h:
            await h.send("First words", chat_id="c")
            await h.replies(chat_id="c", count=1)
        async with GatewayHarness(naming_agent, store=url) as h:
            await h.send("Words after the restart", chat_id="c")
            await h.replies(chat_id="c", count=1)
            assert await titles(h) == ["First words"]


class TestSetByTheAgent:
    async def test_the_agents_title_wins_and_the_last_counts(self, store_url: str) -> None:
        async with GatewayHarness(naming_agent, store=store_url) as h:
            await h.send("name: Draft | Trip to Lisbon", chat_id="c")
            [reply] = await h.replies(chat_id="c", count=1)
            assert reply == "named 'Trip to Lisbon'"
            assert await titles(h) == ["Trip to Lisbon"]
            await say(h, "more talk", "name: Lisbon, then Porto")
            assert await titles(h) == ["Lisbon, then Porto"]

    async def test_bad_titles_are_cleaned_or_refused(self) -> None:
        async with GatewayHarness(naming_agent) as h:
            replies = await say(h, "name: \x1bred\u202e  \u200bnews\x00\n", "name:   ")
            assert replies[0] == "named 'red news'"
            assert replies[1] == "refused: a title needs some visible text"
            assert await titles(h) == ["red news"]

    async def test_a_huge_title_is_shortened(self) -> None:
        async with GatewayHarness(naming_agent) as h:
            await h.send("name: " + "long " * 10_000, chat_id="c")
            await h.replies(chat_id="c", count=1)
            [title] = await titles(h)
            assert len(title) <= TITLE_LIMIT
            assert title.endswith("long…")

    async def test_a_title_that_is_not_text_is_refused(self) -> None:
        seen: list[BaseException] = []

        async def agent(turn: Turn) -> str:
            try:
                turn.set_title(b"bytes")  # type: ignore[arg-type]
            except TypeError as error:
                seen.append(error)
            return "ok"

        async with GatewayHarness(agent) as h:
            await h.send("hello", chat_id="c")
            await h.replies(chat_id="c", count=1)
            assert [str(e) for e in seen] == ["a title is a str, not bytes"]
            assert await titles(h) == ["hello"]


class BatchSpy:
    """Passes every call through to ``store``, keeping the batch of each ``commit_and_release``."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.batches: list[WriteBatch] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    async def commit_and_release(self, lease: Lease, batch: WriteBatch) -> bool:
        self.batches.append(batch)
        return await self.store.commit_and_release(lease, batch)


async def test_only_a_conversations_first_turn_carries_a_title(tmp_path: Path) -> None:
    store = await open_store(f"sqlite:///{tmp_path / 'spy.db'}")
    spy = BatchSpy(store)
    try:
        async with GatewayHarness(naming_agent, store=spy, lifecycle=NO_CONFIRM) as h:  # type: ignore[arg-type]
            await say(h, "one", "two", "three", "/new", "four", "five")
            await h.settle()
    finally:
        await store.close()
    assert [b.title for b in spy.batches] == ["one", "", "", "four", ""]
