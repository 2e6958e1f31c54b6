"""The contract of :class:`~chatlane.stores.protocols.Conversations`, over every backend."""

from __future__ import annotations

import pytest

from chatlane.stores import Store
from tests.keys import chat_key
from tests.stores.contract.common import KEY, entry


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
