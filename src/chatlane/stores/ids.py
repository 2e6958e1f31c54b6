"""The ids a store makes: lease tokens and conversation ids, the same for every backend."""

from __future__ import annotations

import itertools
import secrets

__all__ = ["new_conversation_id", "new_token"]

_TOKEN_PREFIX = secrets.token_hex(8)
_token_numbers = itertools.count(1)


def new_token() -> str:
    """A lease token: never reused in this process, unguessable from another."""
    return f"{_TOKEN_PREFIX}-{next(_token_numbers)}"


def new_conversation_id() -> str:
    """A conversation id: random and URL-safe."""
    return "c_" + secrets.token_hex(8)
