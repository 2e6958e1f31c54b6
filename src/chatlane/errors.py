"""The exceptions chatlane raises.

Every exception derives from :class:`ChatlaneError`, and from a builtin where
the meaning fits, so callers can catch either the family or the plain
condition (``except ValueError`` still catches a malformed session source).
Each class is named for the condition, never for the place it was raised.
"""

from __future__ import annotations


class ChatlaneError(Exception):
    """Root of every error raised by chatlane."""


class InvalidSource(ChatlaneError, ValueError):
    """A message source lacks what a session key needs (platform, chat or user)."""


class InvalidSessionKey(ChatlaneError, ValueError):
    """A string is not a session key produced by :func:`chatlane.identity.build_session_key`."""


class InvalidSessionName(ChatlaneError, ValueError):
    """A name a client chose for its session cannot be used exactly as written."""


class ConfigError(ChatlaneError, ValueError):
    """A configuration key or value is invalid; the message names the key and the expectation."""


class SessionBusy(ChatlaneError):
    """A session cannot be taken now: it already runs a turn, or must wait its turn."""


class EarlierMessageFirst(SessionBusy):
    """An earlier message of the session, claimed by another holder, must run first."""


class StaleGeneration(ChatlaneError):
    """A write or delivery was attempted for a turn whose generation is no longer current."""

    def __init__(self, session_key: str, generation: int, current: int, reason: str = "") -> None:
        self.session_key = session_key
        self.generation = generation
        self.current = current
        self.reason = reason
        detail = f" ({reason})" if reason else ""
        super().__init__(
            f"stale generation {generation} for session {session_key!r}; "
            f"current is {current}{detail}"
        )


class LeaseError(ChatlaneError):
    """A lease was misused: released twice, released with a foreign token, or never held."""


class LeaseLost(LeaseError):
    """A held lease expired or was taken over; the holder must stop acting for the session."""


class ActiveSessionLimit(SessionBusy):
    """``max_active_sessions`` sessions already run; the message waits in the queue."""


class AlreadyAnswered(ChatlaneError):
    """An inbound message was answered before; a second answer is refused."""

    def __init__(self, message_ids: list[str]) -> None:
        self.message_ids = message_ids
        super().__init__(f"already answered: {', '.join(message_ids)}")


class StoreError(ChatlaneError):
    """A store could not be opened or used (bad URL, unreachable server, damaged file)."""


class StoreDamaged(StoreError):
    """A store's data is damaged or incomplete; the message says what to do.

    ``reason`` is the condition alone (SQLite's own words where it gave some),
    without the file's path, for places that show it to anyone who asks
    (the health endpoint).
    """

    def __init__(self, message: str, reason: str) -> None:
        self.reason = reason
        super().__init__(message)


class GatewayFull(ChatlaneError):
    """A process-wide limit is reached; the message was refused before it was stored.

    ``limit`` names the setting (``queued_bytes``, ``live_sessions``), so an
    adapter can answer with an explicit refusal (503) rather than a guess.
    """

    def __init__(self, limit: str, detail: str) -> None:
        self.limit = limit
        super().__init__(f"the gateway is full ({limit}): {detail}; try again later")
