"""The delivery ledger of the Redis store (:class:`~chatlane.stores.protocols.Deliveries`).

Kept apart from :mod:`chatlane.stores.redis` so that each stays small; the
store owns one :class:`RedisLedger`, which runs its scripts through the
store's own calls (one round trip each, a forgotten script sent again, any
Redis failure a :class:`~chatlane.errors.StoreError`). The Lua is in
:mod:`chatlane.stores.redis_ledger_scripts`; the keys are named in
:mod:`chatlane.stores.redis_keys`:

* ``<prefix>:d:{<id>}`` — a hash per delivery (its fields: see
  :data:`~chatlane.stores.redis_ledger_scripts.HELPERS`);
* ``<prefix>:dq:{<target>}`` — the target's pending deliveries by seq: its
  head, the lowest, is the only one that can be claimed;
* ``<prefix>:dr:{<lane>}`` — the lane's targets whose head can be claimed
  now, by the head's seq; ``<prefix>:dw:{<lane>}`` — its other targets with
  pending deliveries, by when their head can be (its ``next_at``, or the end
  of its live claim);
* ``<prefix>:dseq`` (the seq counter), ``dpending``, ``ddelivered``,
  ``ddead`` (listing, by seq) and ``ddelivered_at``, ``ddead_at`` (pruning,
  by when settled).

What stays true:

* **A claim reads no more than it must**: it moves the lanes' waiting
  targets that became due since the last claim to their ready sets (each
  target once per change of its head, at most :data:`PROMOTE_AT_ONCE` per
  lane and claim), then reads at most ``limit`` targets from each lane's
  ready set — ``O((lanes * limit + newly due) * log n)``, never every
  delivery recorded. Oldest first holds among the targets found due: only
  when more than :data:`PROMOTE_AT_ONCE` of a lane's became due between two
  claims may a later one be handed out before an earlier one still waiting
  to be found (never within one target).
* **Atomic with the commit**: the commit script records a batch's
  deliveries itself, after its fence and answered checks passed, so a
  refused commit records nothing (:func:`draft_args` builds its part).
* **Applied once**: recording is idempotent per delivery id; settles and
  retries carry request ids, and a claim remembers what it claimed for its
  TTL, so any of them sent again after a lost reply changes nothing more
  and reports what it did.
* **One clock**: ``created_at``, ``next_at``, claim expiry and
  ``settled_at`` come from the server's ``TIME`` (µs), as leases do.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

from chatlane.errors import StoreError
from chatlane.stores import redis_ledger_scripts as lua
from chatlane.stores.ids import new_token
from chatlane.stores.records import (
    DEAD,
    DELIVERED,
    PENDING,
    Delivery,
    DeliveryDraft,
    DeliveryStats,
    Settlement,
)
from chatlane.stores.redis_keys import Keyspace, escape
from chatlane.stores.redis_scripts import LuaScript
from chatlane.stores.resp import Arg
from chatlane.types import SessionKey

__all__ = ["CLAIM_AT_ONCE", "FORGET_AT_ONCE", "PROMOTE_AT_ONCE", "SCRIPTS", "RedisLedger"]

CLAIM_AT_ONCE = 1_000
"""Most deliveries one claim takes, whatever its ``limit`` (each is sent a token)."""

PROMOTE_AT_ONCE = 10_000
"""Most targets of a lane one claim finds due since the last (a larger backlog — a
platform's ``retry_after`` ending for that many chats at once — goes over the next
claims, so that no one script holds the server for long)."""

FORGET_AT_ONCE = 10_000
"""Most delivered, and most dead, deliveries one heartbeat forgets (a backlog goes over
the next ones)."""


def _script(body: str) -> LuaScript:
    return LuaScript(tuple(lua.KEYS.split()), lua.HELPERS + body)


RECORD = _script(lua.RECORD)
CLAIM = _script(lua.CLAIM)
SETTLE = _script(lua.SETTLE)
RETRY_DEAD = _script(lua.RETRY_DEAD)
LISTED = _script(lua.LISTED)
STATS = _script(lua.STATS)
FORGET = _script(lua.FORGET)

SCRIPTS = (RECORD, CLAIM, SETTLE, RETRY_DEAD, LISTED, STATS, FORGET)
"""The ledger's scripts, registered by the store beside its own."""

_STATES = frozenset({PENDING, DELIVERED, DEAD})


class Run(Protocol):
    """The store's way of running a script (see :meth:`RedisStore._run`)."""

    def __call__(self, script: LuaScript, key: SessionKey | None, *args: Arg) -> Awaitable[Any]:
        """Run ``script``; its reply."""


class RedisLedger:
    """The Redis store's :class:`~chatlane.stores.protocols.Deliveries`, one script per call."""

    def __init__(
        self,
        run: Run,
        command: Callable[..., Awaitable[Any]],
        keyspace: Keyspace,
        request_id: Callable[[], str],
    ) -> None:
        self._run = run
        self._command = command
        self._keys = keyspace
        self._affixes = keyspace.ledger_affixes()
        self._request_id = request_id

    def draft_args(self, drafts: Sequence[DeliveryDraft]) -> list[Arg]:
        """What a script that records ``drafts`` is given: the affixes, then each draft
        (nothing at all when there are none)."""
        if not drafts:
            return []
        return [*self._affixes, *(part for draft in drafts for part in _draft(draft))]

    async def record(self, drafts: Sequence[DeliveryDraft]) -> None:
        """See :meth:`~chatlane.stores.protocols.Deliveries.record_deliveries`."""
        if drafts:
            await self._run(RECORD, None, len(drafts), *self.draft_args(drafts))

    async def claim(
        self, lanes: Sequence[str], holder: str, ttl: float, limit: int
    ) -> list[Delivery]:
        """See :meth:`~chatlane.stores.protocols.Deliveries.claim_deliveries` (at most
        :data:`CLAIM_AT_ONCE`)."""
        names = list(dict.fromkeys(map(escape, lanes)))
        count = min(limit, CLAIM_AT_ONCE)
        if not names or count <= 0:
            return []
        tokens = [new_token() for _ in range(count)]
        args: tuple[Arg, ...] = (self._request_id(), holder, _us(ttl), PROMOTE_AT_ONCE, len(names))
        reply = await self._run(CLAIM, None, *self._affixes, *args, *names, *tokens)
        return [_delivery(flat) for flat in reply]

    async def settle(self, settlements: Sequence[Settlement]) -> list[bool]:
        """See :meth:`~chatlane.stores.protocols.Deliveries.settle_deliveries`."""
        if not settlements:
            return []
        args: list[Arg] = [*self._affixes, self._request_id()]
        for s in settlements:
            args += [escape(s.id), s.claim, str(s.kind), _us(s.delay), s.reason, int(s.maybe_sent)]
        reply = await self._run(SETTLE, None, *args)
        return [bool(applied) for applied in reply]

    async def listed(self, state: str, limit: int) -> list[Delivery]:
        """Deliveries in ``state``, oldest recorded first."""
        if state not in _STATES or limit <= 0:
            return []
        reply = await self._run(LISTED, None, *self._affixes, state, limit)
        return [_delivery(flat) for flat in reply]

    async def get(self, delivery_id: str) -> Delivery | None:
        """One delivery by id."""
        flat = await self._command("HGETALL", self._keys.delivery(delivery_id))
        return _delivery(flat) if flat else None

    async def stats(self) -> DeliveryStats:
        """How many are pending (and since when) and dead."""
        pending, oldest, dead = await self._run(STATS, None, *self._affixes)
        return DeliveryStats(int(pending), _seconds(oldest), int(dead))

    async def retry_dead(self, delivery_id: str) -> bool:
        """Make a dead delivery pending again, due now, with no attempts counted."""
        args = (self._request_id(), escape(delivery_id))
        return bool(await self._run(RETRY_DEAD, None, *self._affixes, *args))

    async def prune(self, delivered_retention: float, dead_retention: float) -> None:
        """Forget delivered ones settled ``delivered_retention`` seconds ago or more, dead
        ones ``dead_retention`` ago or more (by the server's clock)."""
        retentions = (_us(delivered_retention), _us(dead_retention))
        await self._run(FORGET, None, *self._affixes, *retentions, FORGET_AT_ONCE)


def _draft(draft: DeliveryDraft) -> tuple[Arg, ...]:
    """A draft as the scripts record it (:data:`~.redis_ledger_scripts.DRAFT` values)."""
    names = (escape(draft.id), escape(draft.lane), escape(draft.target))
    return (*names, draft.id, draft.lane, draft.target, draft.payload)


def _us(seconds: float) -> int:
    """Seconds as whole microseconds."""
    return round(seconds * 1_000_000)


def _seconds(us: bytes | int) -> float:
    """Whole microseconds, as stored, as seconds."""
    return int(us) / 1_000_000


def _delivery(flat: Sequence[bytes]) -> Delivery:
    """A delivery from its hash's field/value pairs.

    :raises StoreError: a field is missing or malformed.
    """
    fields = dict(zip(flat[::2], flat[1::2], strict=True))
    try:
        return Delivery(
            fields[b"id"].decode(),
            int(fields[b"seq"]),
            fields[b"lane"].decode(),
            fields[b"target"].decode(),
            fields[b"payload"],
            _seconds(fields[b"created_at"]),
            fields[b"state"].decode(),
            int(fields[b"attempts"]),
            _seconds(fields[b"next_at"]),
            fields[b"claim"].decode(),
            _seconds(fields[b"claim_expires"]),
            fields[b"holder"].decode(),
            fields[b"uncertain"] == b"1",
            fields[b"reason"].decode(),
            _seconds(fields[b"settled_at"]),
        )
    except (KeyError, ValueError) as error:
        raise StoreError(f"corrupt delivery in the redis store: {error!r}") from None
