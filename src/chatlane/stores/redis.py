"""The Redis store: sessions, leases and the durable queue, shared by processes on several hosts.

Every check-and-set is one Lua script from :mod:`chatlane.stores.redis_scripts`
(one round trip; a script the server forgot is sent again whole), every key is
named in :mod:`chatlane.stores.redis_keys`, and records are encoded here with
msgspec, so the scripts only move bytes. Commands travel over one pipelined
connection (:mod:`chatlane.stores.resp`): everything a process sends in one
event-loop tick shares one write.

What stays true beyond the :class:`~chatlane.stores.base.Store` contract:

* A dropped connection is retried with exponential backoff
  (:data:`~chatlane.stores.resp.RETRIES` times); a script whose reply was lost
  is sent again and, thanks to its request id, applied once. A commit that
  still failed keeps its request id: the same batch committed again (the
  runtime retries through a longer outage, such as a failover) is applied
  once too, and reported as applied.
* When the server cannot be reached, an operation raises
  :class:`~chatlane.errors.StoreError` — except :meth:`RedisStore.renew`,
  which raises :class:`~chatlane.errors.LeaseLost`: a lease that could not be
  renewed must be treated as gone.
* A lease's ``expires_at`` is the moment the server expires its key (its
  ``TIME`` plus the TTL), not this host's clock plus the TTL: time a call
  spends queued does not shorten the lease. Hosts' clocks must agree with the
  server's to well within a TTL (NTP).

Works on Redis 6+ and Valkey, standalone; a Redis Cluster node is refused at
open (see ``docs/stores.md``). :meth:`RedisStore.open` takes a URL;
:meth:`RedisStore.from_client` a configured redis-py client
(:mod:`chatlane.stores.redis_transport`).
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import msgspec
from msgspec.structs import replace

from chatlane.errors import (
    ActiveSessionLimit,
    AlreadyAnswered,
    EarlierMessageFirst,
    LeaseLost,
    MessageIdInUse,
    SessionBusy,
    StaleGeneration,
    StoreError,
)
from chatlane.stores import redis_scripts as lua
from chatlane.stores.base import (
    PRUNE_AFTER,
    Admission,
    AnsweredMark,
    Conversation,
    Delivery,
    DeliveryDraft,
    DeliveryStats,
    FailedRecord,
    Lease,
    PendingRecord,
    Settlement,
    Store,
    Taken,
    TranscriptEntry,
    WriteBatch,
    already_released,
    now,
    taken_over,
)
from chatlane.stores.codec import decode_value, encode_value, encoding_refused
from chatlane.stores.ids import ProcessIds, new_conversation_id, new_token
from chatlane.stores.redis_keys import DEFAULT_PREFIX, Keyspace
from chatlane.stores.redis_ledger import SCRIPTS as LEDGER_SCRIPTS
from chatlane.stores.redis_ledger import RedisLedger
from chatlane.stores.redis_scripts import LuaScript, Status
from chatlane.stores.redis_sentinel import SCHEME as SENTINEL_SCHEME
from chatlane.stores.redis_sentinel import Sentinels, parse_sentinel_url
from chatlane.stores.redis_transport import RedisPyTransport, Transport
from chatlane.stores.redis_url import parse_url, redact, refusal
from chatlane.stores.resp import RETRIES, Arg, ReplyError, RespClient, maybe_sent
from chatlane.types import SessionKey

if TYPE_CHECKING:
    import redis.asyncio

__all__ = ["RedisStore"]

log = logging.getLogger("chatlane.stores.redis")

OPEN_TIMEOUT = 3.0
"""Seconds :meth:`RedisStore.open` waits for the first ``PING``."""

FULL_SCAN_EVERY = 60.0
"""Seconds between two adoption scans of every queue when no known process died
(to find messages of processes that died before their first heartbeat)."""

FORGET_AT_ONCE = 10_000
"""Most answered marks one heartbeat forgets (a backlog goes over the next ones)."""

REMEMBERED = 16_384
"""Most (script, session) command heads, and sessions seen with a conversation, a store
remembers; past that it forgets them all and starts again (they are only shortcuts)."""

_msgpack = msgspec.msgpack.Encoder()
_entries = msgspec.msgpack.Decoder(TranscriptEntry)


class _Told(msgspec.Struct, array_like=True, frozen=True):
    """What an answered mark keeps beside its answer: the session that set it, and why its
    turn failed ("" if it was answered)."""

    key: SessionKey
    failure: str


class _Queued(msgspec.Struct, array_like=True, frozen=True):
    """What is stored of a pending record; key, seq, message id and owner sit beside it."""

    payload: bytes
    accepted_at: float


_queued = msgspec.msgpack.Decoder(_Queued)
_told = msgspec.msgpack.Decoder(_Told)
_failed = msgspec.msgpack.Decoder(FailedRecord)


class RedisStore(Store):
    """A :class:`~chatlane.stores.base.Store` on a Redis (6+) or Valkey server."""

    answers_may_be_lost = True  # a script's reply can be lost past the client's retries

    def __init__(self, url: str, client: Transport, keyspace: Keyspace) -> None:
        self.url = url
        self._name = f"redis store {redact(url)}"
        self._client = client
        self._keys = keyspace
        self._digests = {script: _sha1(script.source) for script in (*lua.ALL, *LEDGER_SCRIPTS)}
        self._heads: dict[tuple[LuaScript, SessionKey | None], tuple[Arg, ...]] = {}
        """``EVALSHA``, digest, key count and keys, by script and session."""
        self._conversing: set[SessionKey] = set()
        """Sessions a commit of this store found with a conversation (a hint: see COMMIT)."""
        self._unsettled: dict[tuple[SessionKey, str, str], tuple[WriteBatch, str]] = {}
        """A commit that failed (it may have applied), with its request id, by session,
        fence and lease token: the same commit sent again reuses that id."""
        self._closed = False
        self._scanned_at = float("-inf")
        endpoint = client.endpoint if isinstance(client, RespClient) else None
        self._wait_replicas = 0 if endpoint is None else endpoint.wait_replicas
        self._wait_timeout = 1.0 if endpoint is None else endpoint.wait_timeout
        self._ledger = RedisLedger(self._run, self._command, keyspace, _request_id)

    @classmethod
    async def open(cls, url: str) -> RedisStore:
        """Connect to ``url`` (``redis[s]://[[user]:password@]host:port/db[?prefix=name]``,
        or ``redis+sentinel://…/<primary name>[/db]``: :mod:`.redis_sentinel`).

        :raises StoreError: the URL is malformed or the server does not answer a ``PING``.
        """
        client, prefix = _client_for(url)
        store = cls(url, client, Keyspace(prefix))
        await store._check_reachable()
        client.retries = RETRIES  # retries on for good, once the server answered
        return store

    @classmethod
    async def from_client(
        cls,
        client: redis.asyncio.Redis,
        *,
        prefix: str = DEFAULT_PREFIX,
        close_client: bool = False,
    ) -> RedisStore:
        """A store on a configured redis-py client of yours (see :mod:`.redis_transport`).

        Its retry settings are yours; closing the store leaves the client open,
        unless ``close_client``.

        :raises ConfigError: the client decodes replies to text.
        :raises StoreError: the server does not answer a ``PING``, or is a cluster node.
        """
        transport = RedisPyTransport(client, owned=close_client)
        store = cls(transport.describe(prefix), transport, Keyspace(prefix))
        await store._check_reachable()
        return store

    async def _check_reachable(self) -> None:
        """One ``PING``, then make sure the server is not a cluster node.

        :raises StoreError: it does not answer in time, refuses (a password it needs or
            does not take, a database it does not have), or runs Redis Cluster.
        """
        try:
            async with asyncio.timeout(OPEN_TIMEOUT):
                await self._client.execute("PING")
                info = await self._client.execute("INFO", "cluster")
        except ReplyError as error:  # it answered: reached, and refused
            await self._client.close()
            raise StoreError(f"{self._name}: {refusal(str(error))}") from error
        except (ConnectionError, TimeoutError, OSError) as error:
            await self._client.close()
            reason = str(error) or "timed out"
            raise StoreError(f"{self._name}: cannot reach the server ({reason})") from error
        if b"cluster_enabled:1" in (info or b""):
            await self._client.close()
            raise StoreError(
                f"{self._name}: the server is a Redis Cluster node; the Redis store needs a "
                "standalone server (a primary, with Sentinel for failover if you like); "
                "see docs/stores.md"
            )

    # -- talking to the server -------------------------------------------------

    async def _run(self, script: LuaScript, key: SessionKey | None, *args: Arg) -> Any:
        """Run ``script`` on ``key``'s keys; any Redis failure becomes :class:`StoreError`.

        The script is sent by digest (``EVALSHA``); if the server forgot it
        (restart, ``SCRIPT FLUSH``), it is sent again whole, which also caches it.
        """
        head = self._heads.get((script, key))
        if head is None:
            head = self._head(script, key)
        if self._closed:
            raise self._closed_error()
        try:
            try:
                reply = await self._client.execute(*head, *args)
            except ReplyError as error:
                if not str(error).startswith("NOSCRIPT"):
                    raise
                reply = await self._client.execute("EVAL", script.source, *head[2:], *args)
        except (ReplyError, ConnectionError) as error:
            raise self._failure(error) from error
        except UnicodeEncodeError as error:  # a text the client cannot send: never sent
            raise encoding_refused(self._name, error) from None
        if self._wait_replicas:
            try:
                await self._replicated()
            except (ReplyError, ConnectionError) as error:
                raise self._failure(error, ran=True) from error
        return reply

    async def _replicated(self) -> None:
        """Wait until ``wait_replicas`` replicas have every write so far (``WAIT``).

        Fewer within ``wait_timeout`` (none is connected, as right after a
        failover) leaves the write on the primary alone: it stands, and a
        warning says so (``min-replicas-to-write`` on the server refuses such
        writes up front instead).
        """
        wanted, seconds = self._wait_replicas, self._wait_timeout
        acked = await self._client.execute("WAIT", wanted, max(int(seconds * 1000), 1))
        if int(acked) < wanted:
            log.warning(
                "%s: a write reached %s of %d replicas in %gs", self._name, acked, wanted, seconds
            )

    def _head(self, script: LuaScript, key: SessionKey | None) -> tuple[Arg, ...]:
        """``EVALSHA``, the digest, the key count and the keys of ``script`` on ``key``."""
        keys = self._keys.keys(script.keys, key)
        head: tuple[Arg, ...] = ("EVALSHA", self._digests[script], len(keys), *keys)
        if len(self._heads) >= REMEMBERED:
            self._heads.clear()
        self._heads[script, key] = head
        return head

    async def _command(self, *args: Arg) -> Any:
        """Run one plain command; any Redis failure becomes :class:`StoreError`."""
        if self._closed:
            raise self._closed_error()
        try:
            return await self._client.execute(*args)
        except (ReplyError, ConnectionError) as error:
            raise self._failure(error) from error
        except UnicodeEncodeError as error:  # a text the client cannot send: never sent
            raise encoding_refused(self._name, error) from None

    def _packed(self, value: Any) -> bytes:
        """``value`` as msgpack; a text no UTF-8 carries refused as every store refuses it."""
        try:
            return _msgpack.encode(value)
        except UnicodeEncodeError as error:
            raise encoding_refused(self._name, error) from None

    def _closed_error(self) -> StoreError:
        return StoreError(f"{self._name} is closed")

    def _failure(self, error: ReplyError | ConnectionError, *, ran: bool = False) -> StoreError:
        """``error`` as a :class:`StoreError`; ``ran``: the command it follows surely ran
        (so did the call), else it may have only if it was ever sent (:func:`maybe_sent`)."""
        text = f"{self._name}: {type(error).__name__}: {error}"
        return StoreError(text, maybe_applied=ran or maybe_sent(error))

    # -- generations and leases ----------------------------------------------

    async def acquire(
        self,
        key: SessionKey,
        holder: str,
        ttl: float,
        *,
        head_seq: int | None = None,
        max_active: int = 0,
        token: str = "",
    ) -> Lease:
        token = token or new_token()
        head = "" if head_seq is None else head_seq
        reply = await self._run(lua.ACQUIRE, key, token, holder, _ms(ttl), head, max_active, key)
        return _granted(key, holder, token, reply, max_active)

    async def renew(self, lease: Lease, ttl: float) -> Lease:
        """See :meth:`Store.renew`; failing to reach the server also raises ``LeaseLost``."""
        args = (lease.token, lease.generation, _ms(ttl), lease.key)
        try:
            reply = await self._run(lua.RENEW, lease.key, *args)
        except StoreError as error:
            raise LeaseLost(
                f"lease on {lease.key!r} could not be renewed: {error}",
                key=lease.key,
                generation=lease.generation,
            ) from error
        if reply[0] != Status.OK:
            raise LeaseLost(
                f"lease on {lease.key!r} (generation {lease.generation}) was lost",
                key=lease.key,
                generation=lease.generation,
            )
        return replace(lease, expires_at=reply[1] / 1000)

    async def renew_many(self, leases: Sequence[Lease], ttl: float) -> list[Lease | None]:
        """See :meth:`Store.renew_many`: the renewals share one write to the server."""
        replies = await asyncio.gather(
            *(
                self._run(lua.RENEW, lease.key, lease.token, lease.generation, _ms(ttl), lease.key)
                for lease in leases
            )
        )
        return [
            replace(lease, expires_at=reply[1] / 1000) if reply[0] == Status.OK else None
            for lease, reply in zip(leases, replies, strict=True)
        ]

    async def release(self, lease: Lease) -> None:
        args = (lease.token, lease.generation, _request_id(), lease.key)
        status = (await self._run(lua.RELEASE, lease.key, *args))[0]
        if status == Status.RELEASED:
            raise already_released(lease)
        if status == Status.LOST:
            raise taken_over(lease)

    async def bump_generation(self, key: SessionKey) -> int:
        return int(await self._run(lua.BUMP, key, _request_id()))

    async def generation(self, key: SessionKey) -> int:
        return int(await self._command("GET", self._keys.one("gen", key)) or 0)

    async def generations(self, keys: Sequence[SessionKey]) -> list[int]:
        if not keys:
            return []
        found = await self._command("MGET", *(self._keys.one("gen", key) for key in keys))
        return [int(value or 0) for value in found]

    async def lease_holder(self, key: SessionKey) -> str | None:
        """See :meth:`Store.lease_holder`: one ``GET`` of the lease, which expires on the server."""
        held = await self._command("GET", self._keys.one("lease", key))
        return None if held is None else held.decode().split("|", 2)[2]

    async def active_sessions(self) -> int:
        return int(await self._run(lua.ACTIVE, None))

    # -- fenced writes and reads -----------------------------------------------

    async def commit(self, key: SessionKey, generation: int | None, batch: WriteBatch) -> None:
        await self._commit(key, generation, batch, "")

    async def _commit(
        self, key: SessionKey, generation: int | None, batch: WriteBatch, token: str
    ) -> bool:
        """The commit script; with a lease's ``token``, it releases that lease if it applies.

        A commit that raised may have applied all the same (its reply, or the
        ``WAIT`` after it, was lost past the client's retries): the same batch
        committed again under the same fence and token is sent with the same
        request id, so the script applies it once and says it applied, instead
        of refusing its own answer as given before.
        """
        fence = "" if generation is None else str(generation)
        head, tail = self._keys.transcript_affixes()
        drafts = self._ledger.draft_args(batch.deliveries)
        try:
            args = _batch_args(key, batch, self.answered_retention, token, drafts)
        except UnicodeEncodeError as error:  # a transcript entry's text
            raise encoding_refused(self._name, error) from None
        slot = (key, fence, token)
        unsettled = self._unsettled.pop(slot, None)
        rid = unsettled[1] if unsettled is not None and unsettled[0] == batch else _request_id()
        # A session seen with a conversation keeps one (nothing deletes it), so no new id is
        # made for it; should it have none after all, the script says so and writes nothing.
        candidate = "" if key in self._conversing else new_conversation_id()
        try:
            reply = await self._run(lua.COMMIT, key, fence, rid, candidate, head, tail, key, *args)
            if reply[0] == Status.UNSTARTED:
                self._conversing.discard(key)
                candidate = new_conversation_id()
                reply = await self._run(
                    lua.COMMIT, key, fence, rid, candidate, head, tail, key, *args
                )
        except StoreError:
            if len(self._unsettled) >= REMEMBERED:
                self._unsettled.clear()
            self._unsettled[slot] = (copy.deepcopy(batch), rid)
            raise
        if reply[0] == Status.STALE:
            raise StaleGeneration(key, int(fence), int(reply[1]), "commit")
        if reply[0] == Status.ANSWERED:
            raise AlreadyAnswered([message_id.decode() for message_id in reply[1:]], key=key)
        if candidate:
            if len(self._conversing) >= REMEMBERED:
                self._conversing.clear()
            self._conversing.add(key)
        return bool(reply[1])

    async def load_persistent(self, key: SessionKey) -> dict[str, Any]:
        return _fields(key, await self._command("HGETALL", self._keys.one("persist", key)))

    async def load_fields(self, key: SessionKey, names: Sequence[str]) -> dict[str, Any]:
        wanted = list(dict.fromkeys(names))
        if not wanted:
            return {}
        raw = await self._command("HMGET", self._keys.one("persist", key), *wanted)
        found = zip(wanted, raw, strict=True)
        return {name: decode_value(key, name, value) for name, value in found if value is not None}

    async def transcript(
        self, key: SessionKey, conversation_id: str | None = None, limit: int = 100
    ) -> list[TranscriptEntry]:
        if conversation_id is None:
            affixes = self._keys.transcript_affixes()
            reply = await self._run(lua.TRANSCRIPT, key, new_conversation_id(), *affixes, limit)
            conversation_id, rows = reply[0].decode(), reply[1:]
        elif limit > 0:
            transcript = self._keys.transcript(conversation_id)
            rows = await self._command("LRANGE", transcript, -limit, -1)
        else:
            rows = []
        return [_entry(raw, conversation_id) for raw in rows]

    async def is_answered(self, message_id: str) -> bool:
        at = await self._command("ZSCORE", self._keys.one("answered_at"), message_id)
        return self._kept(at)

    async def mark(self, message_id: str) -> AnsweredMark | None:
        at, text, told = await asyncio.gather(  # one write: all read in one round trip
            self._command("ZSCORE", self._keys.one("answered_at"), message_id),
            self._command("HGET", self._keys.one("answers"), message_id),
            self._command("HGET", self._keys.one("answer_marks"), message_id),
        )
        if not self._kept(at):
            return None
        answer = "" if text is None else text.decode()
        if told is None:  # set before marks kept their session
            return AnsweredMark(answer)
        kept: _Told = _decoded(_told, told)
        return AnsweredMark(answer, kept.key, kept.failure)

    def _kept(self, at: bytes | None) -> bool:
        """Whether an answered mark set at ``at`` (ms, as stored) is within the retention."""
        return at is not None and float(at) / 1000 > now() - self.answered_retention

    # -- a turn's fused calls: one script each ------------------------------------------

    async def enqueue_and_acquire(
        self,
        key: SessionKey,
        message_id: str,
        owner: str,
        payload: bytes,
        ttl: float,
        *,
        max_active: int = 0,
        with_persistent: bool = True,
        token: str = "",
    ) -> Admission:
        record = _msgpack.encode(_Queued(payload, now()))
        token = token or new_token()
        args = (message_id, owner, record, key, token, _ms(ttl), max_active, int(with_persistent))
        seq, granted, flat = await self._run(lua.ENQUEUE_ACQUIRE, key, *args)
        if seq == lua.FOREIGN:
            raise MessageIdInUse(message_id, key=key)
        lease: Lease | None = None
        refusal: SessionBusy | None = None
        try:
            lease = _granted(key, owner, token, granted, max_active)
        except SessionBusy as error:
            refusal = error
        persistent = _fields(key, flat) if with_persistent else None
        return Admission(int(seq), lease, refusal, persistent)

    async def acquire_and_read(
        self,
        key: SessionKey,
        holder: str,
        ttl: float,
        *,
        head_seq: int | None = None,
        max_active: int = 0,
        token: str = "",
    ) -> Taken:
        token = token or new_token()
        head = "" if head_seq is None else head_seq
        args = (token, holder, _ms(ttl), head, max_active, key)
        granted, flat = await self._run(lua.ACQUIRE_READ, key, *args)
        return Taken(_granted(key, holder, token, granted, max_active), _fields(key, flat))

    async def commit_and_release(self, lease: Lease, batch: WriteBatch) -> bool:
        return await self._commit(lease.key, lease.generation, batch, lease.token)

    # -- conversations -----------------------------------------------------------

    async def conversation(self, key: SessionKey) -> Conversation:
        reply = await self._run(lua.CONVERSATION, key, new_conversation_id())
        return _conversation(key, reply)

    async def new_conversation(self, key: SessionKey, title: str = "") -> Conversation:
        reply = await self._run(lua.NEW_CONVERSATION, key, new_conversation_id(), title)
        return _conversation(key, reply)

    async def resume_conversation(self, key: SessionKey, conversation_id: str) -> Conversation:
        reply = await self._run(lua.RESUME, key, conversation_id)
        if not reply:
            raise KeyError(conversation_id)
        return _conversation(key, reply)

    async def conversations(self, key: SessionKey, limit: int = 20) -> list[Conversation]:
        reply = await self._run(lua.CONVERSATIONS, key, new_conversation_id(), limit)
        listed = [_conversation(key, reply[i : i + 4]) for i in range(0, len(reply), 4)]
        return listed[:limit]

    # -- the durable pending queue -------------------------------------------------

    async def enqueue(
        self, key: SessionKey, message_id: str, owner: str, payload: bytes, *, seq: int = 0
    ) -> int:
        record = _msgpack.encode(_Queued(payload, now()))
        queued = int(await self._run(lua.ENQUEUE, key, message_id, owner, record, key, seq))
        if queued == lua.FOREIGN:
            raise MessageIdInUse(message_id, key=key)
        return queued

    async def pending(self, key: SessionKey) -> list[PendingRecord]:
        reply = await self._run(lua.PENDING, key)
        return [_pending(key, *reply[i : i + 4]) for i in range(0, len(reply), 4)]

    async def pending_keys(self) -> list[SessionKey]:
        members = await self._command("SMEMBERS", self._keys.one("pkeys"))
        return sorted(SessionKey(member.decode()) for member in members)

    async def drop_pending(self, key: SessionKey, seqs: Sequence[int]) -> None:
        if seqs:
            await self._run(lua.DROP, key, key, *seqs)

    async def drop_own(self, key: SessionKey, seqs: Sequence[int], owner: str) -> list[int]:
        if not seqs:
            return []
        dropped = await self._run(lua.DROP_OWN, key, key, owner, *sorted(seqs))
        return [int(seq) for seq in dropped]

    async def adopt(
        self,
        key: SessionKey,
        seqs: Sequence[int],
        old_owner: str,
        new_owner: str,
        *,
        generation: int | None = None,
    ) -> list[int]:
        if not seqs:
            return []
        owners = (old_owner, new_owner)
        fence = "" if generation is None else str(generation)
        adopted = await self._run(lua.ADOPT, key, _request_id(), *owners, fence, *sorted(seqs))
        return [int(seq) for seq in adopted]

    async def adopt_orphans(self, holder: str, limit: int) -> list[PendingRecord]:
        """See :meth:`Store.adopt_orphans`: every queue is read only when a process died.

        The ``holders`` set says which processes stopped beating; when none
        did, only a scan every :data:`FULL_SCAN_EVERY` seconds looks for the
        messages of a process that died before its first heartbeat.
        """
        holders = self._keys.one("holders")
        dead = await self._command("ZRANGEBYSCORE", holders, "-inf", _ms(now()), "LIMIT", 0, 1)
        moment = asyncio.get_running_loop().time()
        if not dead and moment - self._scanned_at < FULL_SCAN_EVERY and not self._adoptions.unsure:
            return []
        adopted = await super().adopt_orphans(holder, limit)
        if len({record.key for record in adopted}) < limit:
            self._scanned_at = moment
            cutoff = _ms(now() - PRUNE_AFTER)
            await self._command("ZREMRANGEBYSCORE", holders, "-inf", cutoff)
        return adopted

    async def park(self, key: SessionKey, seqs: Sequence[int], reason: str) -> None:
        wanted = set(seqs)
        records = [r for r in await self.pending(key) if r.seq in wanted]
        if not records:
            return
        moment = now()
        args: list[Arg] = [key, _ms(moment)]
        for record in records:
            failed = self._packed(FailedRecord(record, reason, moment))
            args += [record.seq, record.message_id, failed]
        await self._run(lua.PARK, key, *args)

    async def failed(self, limit: int = 100) -> list[FailedRecord]:
        if limit <= 0:
            return []
        ids = await self._command("ZRANGE", self._keys.one("failed_at"), 0, limit - 1)
        if not ids:
            return []
        raws = await self._command("HMGET", self._keys.one("failed"), *ids)
        return [_decoded(_failed, raw) for raw in raws if raw is not None]

    async def retry_failed(self, message_id: str, owner: str) -> PendingRecord | None:
        raw = await self._command("HGET", self._keys.one("failed"), message_id)
        if raw is None:
            return None
        record = replace(_decoded(_failed, raw).record, owner=owner)
        queued = _msgpack.encode(_Queued(record.payload, record.accepted_at))
        args = (message_id, raw, record.seq, owner, queued, record.key)
        retried = await self._run(lua.RETRY, record.key, *args)
        if retried == lua.FOREIGN:
            raise MessageIdInUse(message_id, key=record.key)
        return record if retried else None

    # -- the delivery ledger (chatlane.stores.redis_ledger) ------------------------------

    async def record_deliveries(self, drafts: Sequence[DeliveryDraft]) -> None:
        await self._ledger.record(drafts)

    async def claim_deliveries(
        self, lanes: Sequence[str], holder: str, ttl: float, limit: int
    ) -> list[Delivery]:
        return await self._ledger.claim(lanes, holder, ttl, limit)

    async def settle_deliveries(self, settlements: Sequence[Settlement]) -> list[bool]:
        return await self._ledger.settle(settlements)

    async def deliveries(self, state: str, limit: int = 100) -> list[Delivery]:
        return await self._ledger.listed(state, limit)

    async def delivery(self, delivery_id: str) -> Delivery | None:
        return await self._ledger.get(delivery_id)

    async def delivery_stats(self) -> DeliveryStats:
        return await self._ledger.stats()

    async def retry_dead(self, delivery_id: str) -> bool:
        return await self._ledger.retry_dead(delivery_id)

    # -- process liveness ------------------------------------------------------------

    async def heartbeat(self, holder: str, ttl: float) -> None:
        """See :meth:`Store.heartbeat`; a ``ttl`` of 0 or less signs ``holder`` off at once.

        It also prunes the delivery ledger: delivered deliveries after
        :attr:`delivered_retention`, dead ones after :attr:`answered_retention`.
        """
        beat = self._keys.heartbeat(holder)
        moment = now()
        cutoff = _ms(moment - self.answered_retention)
        beating = ("SET", beat, b"1", "PX", _ms(ttl)) if ttl > 0 else ("DEL", beat)
        listed = ("ZADD", self._keys.one("holders"), _ms(moment + max(ttl, 0.0)), holder)
        forgetting = self._run(lua.FORGET_ANSWERED, None, cutoff, FORGET_AT_ONCE)
        pruning = self._ledger.prune(self.delivered_retention, self.answered_retention)
        await asyncio.gather(  # one write
            self._command(*beating), self._command(*listed), forgetting, pruning
        )

    async def alive(self, holders: Sequence[str]) -> Mapping[str, bool]:
        if not holders:
            return {}
        found = await self._command("MGET", *map(self._keys.heartbeat, holders))
        return {holder: value is not None for holder, value in zip(holders, found, strict=True)}

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            await self._client.close()


def _client_for(url: str) -> tuple[RespClient, str]:
    """The client (not retrying yet) and key prefix a ``redis[s]://`` or Sentinel URL names.

    :raises StoreError: the URL is malformed.
    """
    if not url.startswith(f"{SENTINEL_SCHEME}://"):
        endpoint, prefix = parse_url(url)
        return RespClient(endpoint, retries=0), prefix
    sentinel = parse_sentinel_url(url)
    endpoint, prefix = parse_url(sentinel.redis_url)
    return RespClient(endpoint, retries=0, locate=Sentinels(sentinel, endpoint).locate), prefix


# -- encoding and decoding -------------------------------------------------------------


def _sha1(source: str) -> str:
    """The digest ``EVALSHA`` knows a script by."""
    return hashlib.sha1(source.encode(), usedforsecurity=False).hexdigest()


def _ms(seconds: float) -> int:
    """A TTL in whole milliseconds, at least 1 (``PX`` refuses 0)."""
    return max(1, round(seconds * 1000))


_request_ids = ProcessIds()


def _request_id() -> str:
    """The id that makes a retried script apply once (unique across processes, forked too)."""
    return _request_ids.next()


def _batch_args(
    key: SessionKey, batch: WriteBatch, retention: float, token: str, drafts: Sequence[Arg]
) -> list[Arg]:
    """``batch`` as the commit script's counts, retention, answer, release token, delivery
    count and title, then its encoded items, then ``drafts`` (its deliveries, as the
    ledger encodes them)."""
    stamp = now()
    entries = [_msgpack.encode(_stamped(entry, stamp)) for entry in batch.transcript]
    fields = [part for item in batch.persistent.items() for part in _json_field(key, *item)]
    counts = (len(entries), len(batch.persistent), len(batch.answered))
    rename = 1 if batch.rename else 0
    head = (
        *counts,
        _ms(retention),
        batch.answer,
        token,
        len(batch.deliveries),
        batch.title,
        rename,
        _msgpack.encode(_Told(key, batch.failure)),
    )
    return [*head, *entries, *fields, *batch.answered, *batch.done, *drafts]


def _json_field(key: SessionKey, name: str, value: Any) -> tuple[str, str]:
    """A persistent field as stdlib JSON, as every store keeps it (ASCII; NaN survives).

    :raises StoreError: ``value`` is not JSON-compatible.
    """
    return name, encode_value(key, name, value)


def _stamped(entry: TranscriptEntry, stamp: float) -> TranscriptEntry:
    return entry if entry.created_at else replace(entry, created_at=stamp)


def _entry(raw: bytes, conversation_id: str) -> TranscriptEntry:
    """A stored entry; one stored without a conversation id belongs to the list it is in."""
    entry: TranscriptEntry = _decoded(_entries, raw)
    return entry if entry.conversation_id else replace(entry, conversation_id=conversation_id)


def _pending(key: SessionKey, *fields: bytes) -> PendingRecord:
    """A record from the pending script's ``seq, message id, owner, stored record``."""
    seq, message_id, owner, raw = fields
    queued: _Queued = _decoded(_queued, raw)
    return PendingRecord(
        key,
        int(float(seq)),
        message_id.decode(),
        owner.decode(),
        queued.payload,
        queued.accepted_at,
    )


def _conversation(key: SessionKey, reply: Sequence[bytes]) -> Conversation:
    """A conversation from the scripts' ``id, started µs, ended µs, title``."""
    id_, started, ended, title = reply
    return Conversation(id_.decode(), key, float(started) / 1e6, float(ended) / 1e6, title.decode())


def _decoded(decoder: Any, raw: bytes) -> Any:
    try:
        return decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as error:
        raise StoreError(f"corrupt record in the redis store: {error}") from None


def _fields(key: SessionKey, flat: Sequence[bytes]) -> dict[str, Any]:
    """Persistent fields from ``HGETALL``'s field/value pairs."""
    pairs = zip(flat[::2], flat[1::2], strict=True)
    return {name.decode(): decode_value(key, name.decode(), raw) for name, raw in pairs}


def _granted(key: SessionKey, holder: str, token: str, reply: Sequence[Any], cap: int) -> Lease:
    """The lease an acquire script's reply grants.

    :raises SessionBusy: (or a subclass) the script refused it.
    """
    if reply[0] == Status.OK:
        if len(reply) > 3:  # the live lease already carried the token: its own holder
            holder = reply[3].decode()
        return Lease(key, holder, token, int(reply[1]), reply[2] / 1000)
    raise _refusal(key, Status(reply[0]), reply, cap)


def _refusal(key: SessionKey, status: Status, reply: Sequence[Any], cap: int) -> SessionBusy:
    """The error for an acquire the script refused."""
    if status is Status.LIMIT:
        return ActiveSessionLimit(f"at the active session limit ({reply[1]}/{cap})", key=key)
    if status is Status.EARLIER:
        return EarlierMessageFirst(f"an earlier message of {key!r} runs first", key=key)
    return SessionBusy(f"session {key!r} is running elsewhere", key=key)
