"""Stored encodings every backend shares: inbound messages and persistent values.

* Messages are msgspec JSON. Encoding is total for every
  :class:`~chatlane.types.InboundMessage`; decoding checks types, so a corrupt
  record raises :class:`~chatlane.errors.StoreError` instead of handing the
  engine a half-built message.
* A transcript entry's attachments are msgspec JSON too, stored beside its
  text; none are stored as ``None`` (no bytes at all), and ``None`` reads
  back as none, so rows written before attachments existed stay readable.
* Persistent values are stdlib JSON text, ASCII-escaped, so every ``str``
  round-trips (lone surrogates included), and so do big ints, ``NaN`` and the
  infinities. A value that is not JSON-compatible is refused with
  :class:`~chatlane.errors.StoreError` naming the field; tuples come back as
  lists and non-``str`` dict keys as strings — in every backend alike.
* A batch handed to a store thread or a pool (:func:`detached_batch`) is a
  copy the caller can no longer change, its persistent fields already encoded.
* Every other text is kept as UTF-8, which cannot carry a lone surrogate: a
  call given a text holding one is refused by every backend alike, with
  :func:`unstorable`'s :class:`~chatlane.errors.StoreError` (nothing written,
  ``maybe_applied`` false) — the memory store checks with :func:`storable`,
  the others find it as their driver encodes the call.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

import msgspec

from chatlane.errors import StoreError
from chatlane.stores.records import WriteBatch
from chatlane.types import Attachment, InboundMessage, SessionKey

_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(InboundMessage)
_attachments = msgspec.json.Decoder(tuple[Attachment, ...])


def encode_message(message: InboundMessage) -> bytes:
    """The stored form of ``message``."""
    return _encoder.encode(message)


def decode_message(payload: bytes) -> InboundMessage:
    """Read a message written by :func:`encode_message`.

    :raises StoreError: if ``payload`` is not such a message.
    """
    try:
        return _decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as error:
        raise StoreError(f"corrupt pending message record: {error}") from None


def encode_attachments(attachments: tuple[Attachment, ...]) -> bytes | None:
    """The stored form of a transcript entry's ``attachments``: ``None`` for none."""
    return _encoder.encode(attachments) if attachments else None


def decode_attachments(stored: bytes | None) -> tuple[Attachment, ...]:
    """Read what :func:`encode_attachments` wrote (``None``: none).

    :raises StoreError: if ``stored`` is not such a list.
    """
    if stored is None:
        return ()
    try:
        return _attachments.decode(stored)
    except (msgspec.DecodeError, msgspec.ValidationError) as error:
        raise StoreError(f"corrupt transcript attachments: {error}") from None


def encode_value(key: SessionKey, name: str, value: Any) -> str:
    """The stored form of persistent field ``name`` of ``key``.

    :raises StoreError: ``value`` is not JSON-compatible.
    """
    try:
        return json.dumps(value)
    except (TypeError, ValueError) as error:
        raise StoreError(
            f"persistent field {name!r} of {key!r} is not JSON-compatible: {error}"
        ) from None


def decode_value(key: SessionKey, name: str, stored: str | bytes) -> Any:
    """Read a value written by :func:`encode_value`.

    :raises StoreError: ``stored`` is not JSON.
    """
    try:
        return json.loads(stored)
    except ValueError:
        raise StoreError(f"corrupt persistent field {name!r} of {key!r}: {stored[:80]!r}") from None


def detached_batch(key: SessionKey, batch: WriteBatch) -> tuple[list[tuple[str, str]], WriteBatch]:
    """``batch``'s persistent fields encoded, and a copy of the rest the caller can no
    longer change: what a store writes on another thread or after an ``await``.

    :raises StoreError: a persistent value is not JSON-compatible (before any write).
    """
    rest = WriteBatch(
        list(batch.transcript),
        {},
        list(batch.answered),
        list(batch.done),
        batch.answer,
        list(batch.deliveries),
        batch.title,
        batch.rename,
        batch.failure,
    )
    fields = [(name, encode_value(key, name, value)) for name, value in batch.persistent.items()]
    return fields, rest


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def unstorable(store: str, surrogate: str) -> StoreError:
    """The refusal of a call whose text holds ``surrogate``, a lone surrogate: no UTF-8
    carries one, so no store keeps it; nothing of the call was written or sent."""
    return StoreError(
        f"{store}: a text holding a lone surrogate ({surrogate!r}) cannot be stored",
        maybe_applied=False,
    )


def encoding_refused(store: str, error: UnicodeEncodeError) -> StoreError:
    """:func:`unstorable`, for a driver's failure to encode a call's text as UTF-8."""
    return unstorable(store, error.object[error.start : error.end])


def storable(store: str, texts: Iterable[str]) -> None:
    """Refuse ``texts`` as the stores that encode them do, if one holds a lone surrogate.

    :raises StoreError: :func:`unstorable`'s.
    """
    joined = "".join(texts)  # one scan for the common case: none, or ASCII
    if joined.isascii():
        return
    found = _LONE_SURROGATE.search(joined)
    if found is not None:
        raise unstorable(store, found.group())


def batch_texts(key: SessionKey, batch: WriteBatch) -> list[str]:
    """``key`` and the texts of ``batch`` a store keeps as text: its persistent values are
    JSON, which keeps every ``str``, and are not among them (their names are)."""
    texts = [key, batch.answer, batch.title, batch.failure, *batch.answered]
    for entry in batch.transcript:
        texts += (entry.role, entry.content, entry.conversation_id, entry.message_id)
        for attachment in entry.attachments:
            texts += (attachment.ref, attachment.mime_type, attachment.name)
    if batch.persistent:
        texts += batch.persistent
    for draft in batch.deliveries:
        texts += (draft.id, draft.lane, draft.target)
    return texts
