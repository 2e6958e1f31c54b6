"""Stored and wire encodings of inbound messages (msgspec JSON).

Encoding is total for every :class:`~chatlane.types.InboundMessage`; decoding
checks types, so a corrupt record raises :class:`~chatlane.errors.StoreError`
instead of handing the engine a half-built message.
"""

from __future__ import annotations

import msgspec

from chatlane.errors import StoreError
from chatlane.types import InboundMessage

_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(InboundMessage)


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
