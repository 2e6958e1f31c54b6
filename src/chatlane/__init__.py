"""chatlane: the session-and-turn runtime for AI chat-agent gateways."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from chatlane.errors import (
    ChatlaneError,
    ConfigError,
    InvalidSessionKey,
    InvalidSource,
    LeaseError,
    LeaseLost,
    SessionBusy,
    StaleGeneration,
)
from chatlane.identity import (
    ChatType,
    KeyPolicy,
    SessionKey,
    SessionSource,
    build_session_key,
    check_session_key,
    parse_session_key,
)

try:
    __version__ = version("chatlane")
except PackageNotFoundError:  # pragma: no cover - running from a source tree without install
    __version__ = "0.0.0+unknown"

__all__ = [
    "ChatType",
    "ChatlaneError",
    "ConfigError",
    "InvalidSessionKey",
    "InvalidSource",
    "KeyPolicy",
    "LeaseError",
    "LeaseLost",
    "SessionBusy",
    "SessionKey",
    "SessionSource",
    "StaleGeneration",
    "__version__",
    "build_session_key",
    "check_session_key",
    "parse_session_key",
]
