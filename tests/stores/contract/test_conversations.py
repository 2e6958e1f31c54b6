"""The contract of :class:`~chatlane.stores.protocols.Conversations`, over every backend."""

from __future__ import annotations

import asyncio

import pytest

from chatlane.errors import AlreadyAnswered, StaleGeneration
from chatlane.runtime.limits import MAX_COUNT
from chatlane.stores import Store, WriteBatch
from tests.keys import chat_key
from tests.stores.conftest import Reopen
from tests.stores.contract.common import KEY, ODD_KEYS, entry


class TestConversations:
    async def test_current_is_stable(self, store: Store) -> None:
        first = await store.conversation(KEY)
        assert (await store.conversation(KEY)).id == first.id
        assert first.ended_at == 0.0
        assert first.key == KEY

    async def test_new_ends_the_current(self, store: Store) -> None:
        old = await store.conversation(KEY)
        await store.append_transcript(KEY, None, entry("old talk", 0))
        new = await store.new_conversation(KEY, title="fresh start")
        assert new.id != old.id
        assert new.title == "fresh start"
        assert (await store.conversation(KEY)).id == new.id
        assert await store.transcript(KEY) == []
        listed = await store.conversations(KEY)
        assert [c.id for c in listed] == [new.id, old.id]
        assert listed[1].ended_at > 0

    async def test_the_longest_history_a_setting_asks_for_is_read(self, store: Store) -> None:
        """``agent.openai.history`` at its largest: a limit every store takes."""
        await store.append_transcript(KEY, None, entry("talk", 0))
        [read] = await store.transcript(KEY, limit=MAX_COUNT)
        assert read.content == "talk"

    async def test_resume_switches_back(self, store: Store) -> None:
        old = await store.conversation(KEY)
        await store.append_transcript(KEY, None, entry("old talk", 0))
        await store.new_conversation(KEY)
        resumed = await store.resume_conversation(KEY, old.id)
        assert resumed.id == old.id
        assert resumed.ended_at == 0.0
        assert [e.content for e in await store.transcript(KEY)] == ["old talk"]

    async def test_resume_unknown_raises_key_error(self, store: Store) -> None:
        with pytest.raises(KeyError):
            await store.resume_conversation(KEY, "c_nope")

    async def test_resume_of_another_sessions_conversation_is_refused(self, store: Store) -> None:
        theirs = await store.conversation(chat_key("someone-else"))
        with pytest.raises(KeyError):
            await store.resume_conversation(KEY, theirs.id)


def titled(text: str, *, rename: bool = False, answered: str = "") -> WriteBatch:
    """A batch saying ``text`` and titling the conversation with it."""
    answers = [answered] if answered else []
    return WriteBatch(transcript=[entry(text, 0)], title=text, rename=rename, answered=answers)


class TestTitles:
    """``WriteBatch.title`` titles the current conversation once; ``rename`` replaces it."""

    async def test_the_first_title_stays(self, store: Store) -> None:
        await store.commit(KEY, None, titled("Trip to Lisbon"))
        await store.commit(KEY, None, titled("a later message"))
        assert (await store.conversation(KEY)).title == "Trip to Lisbon"
        assert [c.title for c in await store.conversations(KEY)] == ["Trip to Lisbon"]

    async def test_a_commit_that_starts_the_conversation_titles_it(self, store: Store) -> None:
        await store.commit(KEY, None, WriteBatch(title="from the first commit"))
        [listed] = await store.conversations(KEY)
        assert listed.title == "from the first commit"

    async def test_rename_replaces_and_stays(self, store: Store) -> None:
        await store.commit(KEY, None, titled("drawn from a message"))
        await store.commit(KEY, None, WriteBatch(title="Chosen", rename=True))
        await store.commit(KEY, None, titled("another message"))
        assert (await store.conversation(KEY)).title == "Chosen"
        await store.commit(KEY, None, WriteBatch(title="Chosen again", rename=True))
        assert (await store.conversation(KEY)).title == "Chosen again"

    async def test_an_empty_title_sets_nothing(self, store: Store) -> None:
        await store.commit(KEY, None, WriteBatch(transcript=[entry("hi", 0)], rename=True))
        assert (await store.conversation(KEY)).title == ""
        await store.commit(KEY, None, titled("now titled"))
        await store.commit(KEY, None, WriteBatch(transcript=[entry("hi", 0)], rename=True))
        assert (await store.conversation(KEY)).title == "now titled"

    async def test_only_the_current_conversation_is_titled(self, store: Store) -> None:
        await store.commit(KEY, None, titled("the old one"))
        old = await store.conversation(KEY)
        new = await store.new_conversation(KEY)
        await store.commit(KEY, None, titled("the new one"))
        await store.commit(chat_key("someone-else"), None, titled("theirs"))
        assert [(c.id, c.title) for c in await store.conversations(KEY)] == [
            (new.id, "the new one"),
            (old.id, "the old one"),
        ]
        await store.resume_conversation(KEY, old.id)
        await store.commit(KEY, None, titled("not this"))
        assert (await store.conversation(KEY)).title == "the old one"

    async def test_a_refused_commit_titles_nothing(self, store: Store) -> None:
        lease = await store.acquire(KEY, "p1", 5)
        await store.commit(KEY, lease.generation, WriteBatch(answered=["m1"]))
        with pytest.raises(AlreadyAnswered):
            await store.commit(KEY, lease.generation, titled("twice", answered="m1"))
        with pytest.raises(StaleGeneration):
            await store.commit(KEY, lease.generation - 1, titled("stale", rename=True))
        assert (await store.conversation(KEY)).title == ""

    async def test_commit_and_release_titles(self, store: Store) -> None:
        lease = await store.acquire(KEY, "p1", 5)
        assert await store.commit_and_release(lease, titled("with the release"))
        assert (await store.conversation(KEY)).title == "with the release"

    async def test_any_text_round_trips(self, store: Store) -> None:
        odd = "ключ 🙂 \"quoted\" 'x'; DROP TABLE conversations; -- \\ % _ {a}"
        for key in ODD_KEYS:
            await store.commit(key, None, WriteBatch(title=odd))
            assert (await store.conversation(key)).title == odd

    async def test_titled_once_when_two_processes_race(self, store: Store, reopen: Reopen) -> None:
        other = await reopen()
        stores = [store, other] * 8
        await asyncio.gather(*(s.commit(KEY, None, titled(f"m{i}")) for i, s in enumerate(stores)))
        [first, *_] = await store.transcript(KEY)
        assert len(await store.transcript(KEY)) == len(stores)
        assert (await store.conversation(KEY)).title == first.content
        assert (await other.conversation(KEY)).title == first.content

    async def test_a_title_survives_a_restart(self, store: Store, reopen: Reopen) -> None:
        await store.commit(KEY, None, titled("kept"))
        await store.close()
        again = await reopen()
        assert (await again.conversation(KEY)).title == "kept"
