"""The exceptions chatlane raises, and what users may be shown of them.

Every exception derives from :class:`ChatlaneError`, and from a builtin where
the meaning fits, so callers can catch either the family or the plain
condition (``except ValueError`` still catches a malformed session source).
Each class is named for the condition, never for the place it was raised.
A store's errors name its file or server: :func:`shown_to_users` is what a
chat's users and the API's clients are told of any error.
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


class InvalidChatMove(ChatlaneError, ValueError):
    """A chat is said to have moved, but the ids given are not a group and the other chat
    it became (a Telegram upgrade message with odd values)."""


class ConfigError(ChatlaneError, ValueError):
    """A configuration key or value is invalid; the message names the key and the expectation."""


class SessionBusy(ChatlaneError):
    """A session cannot be taken now: it already runs a turn, or must wait its turn.

    ``key`` is the session's key.
    """

    def __init__(self, message: str, *, key: str) -> None:
        self.key = key
        super().__init__(message)


class EarlierMessageFirst(SessionBusy):
    """An earlier message of the session, claimed by another holder, must run first."""


class StaleGeneration(ChatlaneError):
    """A write or delivery was attempted for a turn whose generation is no longer current.

    ``key`` is the session's key, ``generation`` the turn's, ``current`` the
    session's generation now.
    """

    def __init__(self, key: str, generation: int, current: int, reason: str = "") -> None:
        self.key = key
        self.generation = generation
        self.current = current
        self.reason = reason
        detail = f" ({reason})" if reason else ""
        super().__init__(
            f"stale generation {generation} for session {key!r}; current is {current}{detail}"
        )

    @property
    def session_key(self) -> str:
        """The same as :attr:`key`."""
        return self.key


class LeaseError(ChatlaneError):
    """A lease was misused: released twice, released with a foreign token, or never held.

    ``key`` and ``generation`` name the session and the lease's generation;
    ``None`` where the raiser does not know them (a turn's state refusing a
    second lease token knows no key).
    """

    def __init__(
        self, message: str, *, key: str | None = None, generation: int | None = None
    ) -> None:
        self.key = key
        self.generation = generation
        super().__init__(message)


class LeaseLost(LeaseError):
    """A held lease expired or was taken over; the holder must stop acting for the session.

    ``key`` and ``generation`` are the lost lease's.
    """

    key: str
    generation: int

    def __init__(self, message: str, *, key: str, generation: int) -> None:
        super().__init__(message, key=key, generation=generation)


class ActiveSessionLimit(SessionBusy):
    """``max_active_sessions`` sessions already run; the message waits in the queue."""


class AlreadyAnswered(ChatlaneError):
    """An inbound message was answered before; a second answer is refused.

    ``key`` is the session whose commit was refused, ``message_ids`` the
    messages in it that were answered already.
    """

    def __init__(self, message_ids: list[str], *, key: str) -> None:
        self.message_ids = message_ids
        self.key = key
        super().__init__(f"already answered: {', '.join(message_ids)}")


class MessageIdInUse(ChatlaneError):
    """A message's id is already used by another session's message (queued, set aside or
    answered): message ids are unique across a gateway's sessions, so it is not run.

    ``message_id`` is the id, ``key`` the session the refused message was sent to.
    """

    def __init__(self, message_id: str, *, key: str) -> None:
        self.message_id = message_id
        self.key = key
        super().__init__(f"message id {message_id!r} is already used by another session")


class TakenElsewhere(ChatlaneError):
    """A waiting message could not be taken back (``/unqueue``, a cancelled request): it
    had already left this process — another process's running turn drew it in (or
    took it over from this one) — and runs or ran there. Its sender hears what became
    of it from the store.

    ``message_id`` is the message's id.
    """

    def __init__(self, message_id: str) -> None:
        self.message_id = message_id
        super().__init__(f"message {message_id!r} was already drawn into a turn elsewhere")


class AgentFailed(ChatlaneError):
    """An agent's failure that the agent explains itself: a condition to fix (its endpoint,
    its key, its model), not a bug.

    Its message is what the sender is told, after "the agent failed on this
    message:"; ``detail`` is what the log gets, in one line without a traceback
    (the message when empty). Neither names a secret.
    """

    def __init__(self, told: str, detail: str = "") -> None:
        super().__init__(told)
        self.detail = detail or told


class StartInterrupted(ChatlaneError):
    """A signal (Ctrl-C, SIGTERM) came before the gateway was ready: the start was called
    off and what it had started shut down. ``signal`` is the signal's number."""

    def __init__(self, signal: int) -> None:
        self.signal = signal
        super().__init__(f"stopped by signal {signal} before the gateway was ready")


class StoreError(ChatlaneError):
    """A store could not be opened or used (bad URL, unreachable server, damaged file).

    ``maybe_applied``: whether the call may have changed the store all the same
    (it reached a server and its answer was lost on the way back). ``False``
    where it surely did not — the server could not be reached, or the
    transaction failed before its commit — so nothing needs taking back.
    """

    def __init__(self, *args: object, maybe_applied: bool = True) -> None:
        super().__init__(*args)
        self.maybe_applied = maybe_applied


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


class MessageTooLarge(GatewayFull):
    """A message larger on its own than the process-wide ``queued_bytes`` limit: it can
    never be taken, however long its sender waits (so not "try again later")."""

    def __init__(self, size: int, limit: int) -> None:
        self.limit = "queued_bytes"
        self.size = size
        ChatlaneError.__init__(
            self,
            f"the message is too large: {size} bytes, more than the gateway holds for all "
            f"waiting messages together (queued_bytes = {limit}); send a shorter one",
        )


class DeliveryFailed(ChatlaneError):
    """A platform did not take an outbound message; the subclass says what to do about it.

    An adapter's ``send`` raises one of the subclasses so that the delivery
    worker (:mod:`chatlane.delivery.worker`) can tell a send worth retrying
    from one that never will succeed. Anything else it raises counts as a
    :class:`TransientDelivery` that may have been sent.
    """


class TransientDelivery(DeliveryFailed):
    """A failure that may pass (a timeout, a 5xx): retried with backoff, spending an attempt.

    ``maybe_sent``: the platform may have taken the message before failing (a
    timeout after the request went out), so a re-send is labelled.
    """

    def __init__(self, message: str, *, maybe_sent: bool = False) -> None:
        self.maybe_sent = maybe_sent
        super().__init__(message)


class PermanentDelivery(DeliveryFailed):
    """A failure no retry can cure (the bot was blocked, the chat is gone, a 400): dead-lettered.

    ``maybe_sent``: part of the message may have reached the platform before
    the refusal (an earlier part of a long reply went out), so a redelivery
    of the dead letter is labelled.
    """

    def __init__(self, message: str, *, maybe_sent: bool = False) -> None:
        self.maybe_sent = maybe_sent
        super().__init__(message)


class RateLimited(DeliveryFailed):
    """The platform asked to wait ``retry_after`` seconds (a 429): waited out, no attempt spent."""

    def __init__(self, message: str, retry_after: float) -> None:
        self.retry_after = max(retry_after, 0.0)
        super().__init__(message)


class PlatformUnavailable(DeliveryFailed):
    """The adapter is disconnected or its platform is down: nothing was sent, no attempt spent.

    The worker pauses the platform's lane, with a growing backoff, until a send succeeds.
    """


STORE_UNAVAILABLE = "the store is unavailable; try again later"
"""What a user or a client is told of a :class:`StoreError`."""


def shown_to_users(error: ChatlaneError) -> str:
    """The text of ``error`` fit for a chat's users and the API's clients.

    A store's errors name its file or its server, which only the operator's log
    may show: a user is told that the store is unavailable, or, for damage, the
    condition alone (:attr:`StoreDamaged.reason`, as ``/health`` shows it). Every
    other error is shown in its own words.
    """
    if isinstance(error, StoreDamaged):
        return f"the store is damaged: {error.reason}"
    if isinstance(error, StoreError):
        return STORE_UNAVAILABLE
    return str(error)
