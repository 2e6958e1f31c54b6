"""Session keys for tests: built the way a gateway builds them, or taken as they are where a
test needs keys no source has."""

from __future__ import annotations

from chatlane.identity import SessionKey, SessionSource, build_session_key


def chat_key(chat_id: str, platform: str = "test") -> SessionKey:
    """The key of the direct chat ``chat_id`` on ``platform``: ``main:<platform>:dm:<chat_id>``."""
    return build_session_key(SessionSource(platform, chat_id=chat_id))


def odd_keys(*texts: str) -> list[SessionKey]:
    """``texts`` taken as keys as they are: a store keeps any key it is given, built or not."""
    return [SessionKey(text) for text in texts]
