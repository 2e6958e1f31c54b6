"""Every key the Redis store reads or writes, named in this one module.

All keys live under a namespace ``prefix`` (default ``chatlane``) and take one
of these shapes::

    <prefix>:<kind>                       one per store    (seq, live, pkeys, answered_at, ...)
    <prefix>:s:{<session>}:<part>         one per session  (gen, lease, last, persist, ...)
    <prefix>:t:{<conversation id>}        one per conversation (its transcript, a list)
    <prefix>:hb:{<holder>}                one per process  (heartbeat, with a PX expiry)
    <prefix>:d:{<delivery id>}            one per delivery (a hash: the delivery ledger)
    <prefix>:dq:{<target>}                one per target   (its pending deliveries by seq)
    <prefix>:dr:{<lane>}, :dw:{<lane>}    one pair per lane (targets ready / waiting to be claimed)
    <prefix>:dc:{<request id>}            one per recent claim (what it claimed, until its TTL)

Every name in braces is escaped by :func:`escape`, which is injective and
never yields ``{`` or ``}``. So the braces are always the key's Redis Cluster
hash tag — every key of one session lands on one slot — and no session key,
conversation id, holder, delivery id, target, lane or prefix (which may not
contain braces) can make two distinct things share a key.

The ledger's scripts find a delivery's, target's or lane's keys from the
escaped names they store (an escaped name never holds a brace, so it is safe
between :meth:`Keyspace.ledger_affixes`); :meth:`Keyspace.delivery` names the
same key from Python.

Conversation ids are made by the store (``c_<hex>``), so escaping leaves them
as they are: the scripts build a transcript key by putting the id between
:meth:`Keyspace.transcript_affixes`.
"""

from __future__ import annotations

from collections.abc import Sequence

from chatlane.errors import StoreError
from chatlane.types import SessionKey

DEFAULT_PREFIX = "chatlane"

SESSION_PARTS = frozenset(
    {
        "gen",  # string: the generation (INCR), never deleted
        "lease",  # string "token|generation|holder" with a PX expiry: the live lease
        "last",  # string: token of the last lease granted and not yet released (no expiry)
        "persist",  # hash: field -> JSON value
        "conv",  # string: id of the current conversation
        "convs",  # sorted set: conversation id by started_at (microseconds)
        "ctitle",  # hash: conversation id -> title (only non-empty titles)
        "cended",  # hash: conversation id -> ended_at (microseconds), absent while open
        "pending",  # sorted set: message id by seq
        "pmsg",  # hash: message id -> encoded pending record (payload, accepted_at)
        "powner",  # hash: message id -> owner (the holder that waits for the reply)
        "ops",  # list: ids of the last few applied requests (makes retried scripts no-ops)
    }
)
"""The per-session keys: ``<prefix>:s:{<session>}:<part>``."""

GLOBAL_PARTS = frozenset(
    {
        "seq",  # string: the pending-record counter (INCR); never reused
        "live",  # sorted set: session key by lease expiry (milliseconds)
        "pkeys",  # set: session keys with at least one pending record
        "answered_at",  # sorted set: inbound message id by when it was answered (ms)
        "answers",  # hash: answered message id -> the answer's text (pruned with answered_at)
        "answer_marks",  # hash: answered message id -> msgpack [session key, failure]
        # (pruned with answered_at; absent for a mark set before it was kept)
        "msgseq",  # hash: pending message id -> seq (enqueue is idempotent per message id)
        "holders",  # sorted set: holder by heartbeat expiry (ms); a past score is a dead process
        "failed",  # hash: failed message id -> encoded failed record
        "failed_at",  # sorted set: failed message id by when it failed (ms)
        "dseq",  # string: the delivery counter (INCR); never reused
        "dpending",  # sorted set: escaped id of each pending delivery by seq
        "ddelivered",  # sorted set: escaped id of each delivered delivery by seq
        "ddead",  # sorted set: escaped id of each dead delivery by seq
        "ddelivered_at",  # sorted set: the same ids by when they were delivered (µs)
        "ddead_at",  # sorted set: the same ids by when they were given up on (µs)
    }
)
"""The store-wide keys: ``<prefix>:<part>``."""


def escape(text: str) -> str:
    """``text`` with ``%``, ``{`` and ``}`` percent-encoded; never empty.

    Distinct inputs give distinct outputs (``%`` is escaped first), and the
    empty string becomes ``%``, which no other input produces.
    """
    if not text:
        return "%"
    return text.replace("%", "%25").replace("{", "%7B").replace("}", "%7D")


def check_prefix(prefix: str) -> str:
    """``prefix`` if it can head every key without breaking hash tags.

    :raises StoreError: if it is empty or contains ``{`` or ``}``.
    """
    if not prefix or "{" in prefix or "}" in prefix:
        raise StoreError(f"redis key prefix {prefix!r}: expected a non-empty name without braces")
    return prefix


class Keyspace:
    """The key names of one store namespace."""

    __slots__ = ("prefix",)

    def __init__(self, prefix: str = DEFAULT_PREFIX) -> None:
        self.prefix = check_prefix(prefix)

    def session(self, key: SessionKey) -> str:
        """The stem every key of session ``key`` starts with (ends in ``:``)."""
        return f"{self.prefix}:s:{{{escape(key)}}}:"

    def transcript(self, conversation_id: str) -> str:
        """The list holding one conversation's transcript (encoded entries, oldest first)."""
        head, tail = self.transcript_affixes()
        return f"{head}{escape(conversation_id)}{tail}"

    def transcript_affixes(self) -> tuple[str, str]:
        """What goes before and after a (store-made) conversation id to name its transcript."""
        return f"{self.prefix}:t:{{", "}"

    def heartbeat(self, holder: str) -> str:
        """The key whose existence says process ``holder`` is alive."""
        return f"{self.prefix}:hb:{{{escape(holder)}}}"

    def delivery(self, delivery_id: str) -> str:
        """The hash holding one delivery of the ledger (see :mod:`.redis_ledger`)."""
        head, *_, tail = self.ledger_affixes()
        return f"{head}{escape(delivery_id)}{tail}"

    def ledger_affixes(self) -> tuple[str, str, str, str, str, str]:
        """What the ledger's scripts put before an escaped name — a delivery's hash, a
        target's queue, a lane's ready and waiting sets, a claim's record — and the one
        tail after it."""
        p = self.prefix
        return f"{p}:d:{{", f"{p}:dq:{{", f"{p}:dr:{{", f"{p}:dw:{{", f"{p}:dc:{{", "}"

    def part(self, name: str) -> str:
        """A store-wide key (one of :data:`GLOBAL_PARTS`)."""
        return f"{self.prefix}:{name}"

    def one(self, name: str, key: SessionKey | None = None) -> str:
        """The key ``name`` (a session part of ``key``, or a global part)."""
        return self._resolve(name, "" if key is None else self.session(key))

    def keys(self, names: Sequence[str], key: SessionKey | None = None) -> list[str]:
        """The keys ``names`` (session parts of ``key`` or global parts), in order."""
        stem = "" if key is None else self.session(key)
        return [self._resolve(name, stem) for name in names]

    def _resolve(self, name: str, stem: str) -> str:
        if name in GLOBAL_PARTS:
            return self.part(name)
        if name not in SESSION_PARTS or not stem:
            raise ValueError(f"no key named {name!r} here")
        return stem + name
