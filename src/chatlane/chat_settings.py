"""The keys every chat platform's section (``[telegram]``, ``[slack]``, ``[discord]``) shares:
the group keys (:class:`~chatlane.groups.GroupSettings`) and the cap on files.

What stays true:

* Every chat platform refuses a file larger than its section's
  ``max_attachment_bytes`` (:class:`ChatSettings`), with the same notice
  (:func:`~chatlane.attachments.too_large_notice`); a platform may choose its
  own default (:data:`MAX_ATTACHMENT_BYTES` unless it says otherwise).
* The cap is a whole number of bytes from 1 to
  :data:`~chatlane.runtime.limits.MAX_BYTES` (:data:`~chatlane.runtime.limits.Bytes`,
  checked with every other bounded key by :func:`chatlane.config.check_config`).
"""

from __future__ import annotations

from typing import Final

from chatlane.groups import GroupSettings
from chatlane.runtime.limits import Bytes

__all__ = ["MAX_ATTACHMENT_BYTES", "ChatSettings"]

MAX_ATTACHMENT_BYTES: Final = 20 * 1024 * 1024
"""The default cap on one file (20 MB): enough for photos, documents and voice messages,
small enough for an agent to fetch and read."""


class ChatSettings(GroupSettings, frozen=True, kw_only=True):
    """The keys of one chat platform's section (a base: each platform adds its own)."""

    max_attachment_bytes: Bytes = MAX_ATTACHMENT_BYTES
    """The largest file taken (bytes); a message with a larger one is refused with a
    notice, after the allowlist and group checks."""
