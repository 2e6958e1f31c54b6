"""The keys every chat platform's section (``[telegram]``, ``[slack]``, ``[discord]``) shares:
the group keys (:class:`~chatlane.groups.GroupSettings`) and the cap on files.

What stays true:

* Every chat platform refuses a file larger than its section's
  ``max_attachment_bytes`` (:class:`ChatSettings`), with the same notice
  (:func:`~chatlane.attachments.too_large_notice`); a platform may choose its
  own default (:data:`MAX_ATTACHMENT_BYTES` unless it says otherwise).
* The cap is a whole number of bytes above 0 (:func:`check_file_cap`).
"""

from __future__ import annotations

from typing import Final

from chatlane.errors import ConfigError
from chatlane.groups import GroupSettings

__all__ = ["MAX_ATTACHMENT_BYTES", "ChatSettings", "check_file_cap"]

MAX_ATTACHMENT_BYTES: Final = 20 * 1024 * 1024
"""The default cap on one file (20 MB): enough for photos, documents and voice messages,
small enough for an agent to fetch and read."""


class ChatSettings(GroupSettings, frozen=True, kw_only=True):
    """The keys of one chat platform's section (a base: each platform adds its own)."""

    max_attachment_bytes: int = MAX_ATTACHMENT_BYTES
    """The largest file taken (bytes); a message with a larger one is refused with a
    notice, after the allowlist and group checks."""


def check_file_cap(section: str, settings: ChatSettings) -> None:
    """:raises ConfigError: unless ``[section] max_attachment_bytes`` is above 0."""
    cap = settings.max_attachment_bytes
    if not cap > 0:
        raise ConfigError(
            f"configuration key '{section}.max_attachment_bytes' = {cap}: "
            "expected a whole number > 0"
        )
