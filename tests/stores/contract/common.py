"""What the contract modules share: session keys and transcript entries."""

from __future__ import annotations

from chatlane.stores import TranscriptEntry
from tests.keys import chat_key, odd_keys

KEY = chat_key("c1")
ODD_KEYS = odd_keys(
    "main:tg:group:-1%3A2::7", "k{with}braces", "spaces and\nnewline", "ключ🙂", "a" * 300
)
"""Keys with separators, braces, whitespace, non-ASCII and length: each must stay its own."""


def entry(content: str, generation: int, role: str = "user") -> TranscriptEntry:
    return TranscriptEntry(role, content, generation)
