"""What a store must show once a gateway took back a message it was told was not taken."""

from __future__ import annotations

from chatlane.stores import Store
from chatlane.testing import GatewayHarness


async def check_taken_back(h: GatewayHarness, store: Store, replies: list[str]) -> None:
    """Once the gateway settles, chat ``c``'s session holds no queued record and no lease,
    and its next message runs at once: chat ``c`` then has ``replies`` (ending in it)."""
    await h.settle()
    key = h.session_key(chat_id="c")
    assert await store.pending(key) == []
    assert await store.active_sessions() == 0
    await h.send("next", chat_id="c")  # its session is free at once
    assert await h.replies(chat_id="c", count=len(replies)) == replies
