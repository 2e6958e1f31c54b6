"""The Lua scripts of the Redis store: every check-and-set is one of these, run in one round trip.

Each :class:`LuaScript` names the keys it touches (see
:mod:`chatlane.stores.redis_keys`); its source starts with a generated
preamble binding them to ``K.<name>`` in that order, and the :class:`Status`
codes to Lua locals, so Python and Lua cannot disagree about either.

What the scripts keep true:

* They only move bytes: records are encoded and decoded in Python.
* Times come from the server's ``TIME`` (milliseconds for leases,
  microseconds for conversations and the delivery ledger), one clock for
  every process. Lease expiry
  is the lease key's ``PX`` TTL; acquire and renew return the moment it ends.
* A script that changes state when run twice (release, bump, commit, adopt)
  takes a request id and remembers the last few in the session's ``ops``
  list; a retry after a dropped reply finds its id there and changes nothing
  (adopt then reports what it had adopted). Acquire and new-conversation use
  their client-made token and conversation id the same way.
* Only commands of Redis 6.0 and Valkey are used (no ``FUNCTION``, no
  ``LPOS``, no ``ZRANGE … BYSCORE``, no ``EXPIRE`` options).
* Transcript keys, and the delivery ledger's, are built inside the scripts
  from a conversation id (or a stored escaped name) and the affixes the
  caller passes. They and the store-wide keys (``seq``, ``live``,
  ``answered_at``, …) are outside the session's hash slot, so the scripts
  need a standalone server (or one shard), not Redis Cluster.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from chatlane.stores import redis_ledger_scripts as ledger

OPS_KEPT = 16
"""How many recent request ids a session remembers for retried scripts."""

FOREIGN = -1
"""What a script that queues a message replies (for its seq) when another session's queued
message has its id: nothing was written."""


class Status(enum.IntEnum):
    """The first element of a check-and-set script's reply."""

    OK = 0
    BUSY = 1
    EARLIER = 2
    LIMIT = 3
    STALE = 4
    ANSWERED = 5
    LOST = 6
    RELEASED = 7
    UNSTARTED = 8


@dataclass(frozen=True, slots=True)
class LuaScript:
    """A script body and the keys it is given, in ``KEYS`` order."""

    keys: tuple[str, ...]
    body: str

    @property
    def source(self) -> str:
        """The whole script: the preamble, the shared helpers, then the body."""
        table = ", ".join(f"{name} = KEYS[{i}]" for i, name in enumerate(self.keys, 1))
        codes = "".join(f"local {status.name} = {status.value}\n" for status in Status)
        head = f"local K = {{{table}}}\nlocal OPS_KEPT = {OPS_KEPT}\nlocal FOREIGN = {FOREIGN}\n"
        return f"{head}{codes}{_HELPERS}{self.body}"


def _script(keys: str, body: str) -> LuaScript:
    return LuaScript(tuple(keys.split()), body)


_HELPERS = """
local function now_us()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end

local function now_ms()
  return math.floor(now_us() / 1000)
end

local function int(x)
  return string.format('%.0f', x)
end

local function seen(rid)
  for _, done in ipairs(redis.call('LRANGE', K.ops, 0, -1)) do
    if done == rid then return true end
  end
  return false
end

local function remember(rid)
  redis.call('LPUSH', K.ops, rid)
  redis.call('LTRIM', K.ops, 0, OPS_KEPT - 1)
end

local function holds(lease, token)
  return lease and string.sub(lease, 1, #token + 1) == token .. '|'
end

local function start_conversation(id, title)
  local started = now_us()
  local newest = redis.call('ZREVRANGE', K.convs, 0, 0, 'WITHSCORES')
  if newest[2] and tonumber(newest[2]) >= started then started = tonumber(newest[2]) + 1 end
  redis.call('ZADD', K.convs, int(started), id)
  if title ~= '' then redis.call('HSET', K.ctitle, id, title) end
  redis.call('SET', K.conv, id)
  return id
end

local function current_conversation(candidate)
  return redis.call('GET', K.conv) or start_conversation(candidate, '')
end

local function end_current()
  local id = redis.call('GET', K.conv)
  if id then redis.call('HSET', K.cended, id, int(now_us())) end
end

local function describe(id)
  return {id, redis.call('ZSCORE', K.convs, id),
          redis.call('HGET', K.cended, id) or '0', redis.call('HGET', K.ctitle, id) or ''}
end

local function remove_pending(seq)
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', K.pending, seq, seq)) do
    redis.call('ZREM', K.pending, id)
    redis.call('HDEL', K.pmsg, id)
    redis.call('HDEL', K.powner, id)
    redis.call('HDEL', K.msgseq, id)
  end
end

local function forget_if_empty(member)
  if redis.call('EXISTS', K.pending) == 0 then redis.call('SREM', K.pkeys, member) end
end

local function enqueue(id, owner, record, member, wanted)
  local known = redis.call('HGET', K.msgseq, id)
  if known and not redis.call('ZSCORE', K.pending, id) then return FOREIGN end
  if known then return tonumber(known) end
  local seq = tonumber(wanted or 0)
  if seq == 0 then seq = redis.call('INCR', K.seq) end
  redis.call('ZADD', K.pending, seq, id)
  redis.call('HSET', K.pmsg, id, record)
  redis.call('HSET', K.powner, id, owner)
  redis.call('HSET', K.msgseq, id, seq)
  redis.call('SADD', K.pkeys, member)
  return seq
end

local function acquire(token, holder, ttl, head, cap, member)
  local held = redis.call('GET', K.lease)
  if holds(held, token) then
    local generation, owner = string.match(string.sub(held, #token + 2), '^(%d+)|(.*)$')
    return {OK, tonumber(generation), now_ms() + redis.call('PTTL', K.lease), owner}
  end
  if held then return {BUSY} end
  if head ~= '' then
    for _, id in ipairs(redis.call('ZRANGEBYSCORE', K.pending, '-inf', '(' .. head)) do
      if redis.call('HGET', K.powner, id) ~= holder then return {EARLIER} end
    end
  end
  local now = now_ms()
  redis.call('ZREMRANGEBYSCORE', K.live, '-inf', int(now))
  local active = redis.call('ZCARD', K.live)
  if cap > 0 and active >= cap then return {LIMIT, active} end
  local generation = redis.call('INCR', K.gen)
  redis.call('SET', K.lease, token .. '|' .. generation .. '|' .. holder, 'PX', ttl)
  redis.call('SET', K.last, token)
  redis.call('ZADD', K.live, int(now + ttl), member)
  return {OK, generation, now + ttl}
end
"""

# -- generations and leases --------------------------------------------------------------

ACQUIRE = _script(
    "gen lease last pending powner live",
    """
return acquire(ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4], tonumber(ARGV[5]), ARGV[6])
""",
)
"""ARGV: token, holder, ttl ms, head seq or '', max active, session key.
Reply: {OK, generation, expiry ms} | {OK, generation, expiry ms, holder} (the live lease
already carrying the token, as it stands) | {BUSY} | {EARLIER} | {LIMIT, active}."""

RENEW = _script(
    "gen lease live",
    """
local token, generation, ttl, member = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4]
if not holds(redis.call('GET', K.lease), token) or redis.call('GET', K.gen) ~= generation then
  return {LOST}
end
local expiry = now_ms() + ttl
redis.call('PEXPIRE', K.lease, ttl)
redis.call('ZADD', K.live, int(expiry), member)
return {OK, expiry}
""",
)
"""ARGV: token, generation, ttl ms, session key. Reply: {OK, expiry ms} | {LOST}."""

RELEASE = _script(
    "gen lease last live ops",
    """
local token, generation, rid, member = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
if seen(rid) then return {OK} end
local last = redis.call('GET', K.last)
if last == token then
  redis.call('DEL', K.lease, K.last)
  redis.call('ZREM', K.live, member)
  remember(rid)
  return {OK}
end
if not last and (redis.call('GET', K.gen) or '0') == generation then return {RELEASED} end
return {LOST}
""",
)
"""ARGV: token, generation, request id, session key. Reply: {OK} | {RELEASED} | {LOST}.

``last`` outlives the lease key's expiry, so an expired lease nobody took
since can still be released by its holder, as in the memory store."""

BUMP = _script(
    "gen ops",
    """
if seen(ARGV[1]) then return tonumber(redis.call('GET', K.gen)) end
local generation = redis.call('INCR', K.gen)
remember(ARGV[1])
return generation
""",
)
"""ARGV: request id. Reply: the generation."""

ACTIVE = _script(
    "live",
    """
return redis.call('ZCOUNT', K.live, '(' .. int(now_ms()), '+inf')
""",
)
"""Reply: how many sessions hold a lease that has not expired."""

# -- fenced writes ------------------------------------------------------------------------

COMMIT = _script(
    "gen conv convs ctitle persist pending pmsg powner ops answered_at answers answer_marks "
    "msgseq pkeys "
    f"lease last live {ledger.COMMIT_KEYS}",
    ledger.HELPERS
    + """
local fence, rid, candidate, member, answer = ARGV[1], ARGV[2], ARGV[3], ARGV[6], ARGV[11]
local token, drafts, title, told = ARGV[12], tonumber(ARGV[13]), ARGV[14], ARGV[16]
local fields_at = 17 + tonumber(ARGV[7])
local answered_at = fields_at + 2 * tonumber(ARGV[8])
local done_at = answered_at + tonumber(ARGV[9])
local ledger_at = #ARGV + 1 - ledger_args(drafts)
if seen(rid) then return {OK, token ~= '' and redis.call('GET', K.last) ~= token and 1 or 0} end
local current = redis.call('GET', K.gen) or '0'
if fence ~= '' and fence ~= current then return {STALE, tonumber(current)} end
local moment = answered_at < done_at and now_ms() or 0
local cutoff = moment - tonumber(ARGV[10])
local repeated = {ANSWERED}
for j = answered_at, done_at - 1 do
  local at = redis.call('ZSCORE', K.answered_at, ARGV[j])
  if at and tonumber(at) > cutoff then repeated[#repeated + 1] = ARGV[j] end
end
if #repeated > 1 then return repeated end
local conversation = redis.call('GET', K.conv)
if not conversation and candidate == '' then return {UNSTARTED} end
conversation = conversation or start_conversation(candidate, '')
local transcript = ARGV[4] .. conversation .. ARGV[5]
for j = 17, fields_at - 1 do redis.call('RPUSH', transcript, ARGV[j]) end
if title ~= '' then
  redis.call(ARGV[15] == '1' and 'HSET' or 'HSETNX', K.ctitle, conversation, title)
end
for j = fields_at, answered_at - 1, 2 do redis.call('HSET', K.persist, ARGV[j], ARGV[j + 1]) end
for j = answered_at, done_at - 1 do
  redis.call('ZADD', K.answered_at, int(moment), ARGV[j])
  redis.call('HSET', K.answers, ARGV[j], answer)
  redis.call('HSET', K.answer_marks, ARGV[j], told)
end
for j = done_at, ledger_at - 1 do remove_pending(ARGV[j]) end
if done_at < ledger_at then forget_if_empty(member) end
record_deliveries(ledger_at, drafts)
local released = 0
if token ~= '' and redis.call('GET', K.last) == token then
  redis.call('DEL', K.lease, K.last)
  redis.call('ZREM', K.live, member)
  released = 1
end
remember(rid)
return {OK, released}
""",
)
"""ARGV: generation or '', request id, candidate conversation id (or '' from a caller that
saw the session's conversation started), the two transcript key affixes, session key,
#entries, #fields, #answered, the answered retention (ms), the answer's text, the token of
a lease to release with the commit or '', #deliveries, the title or '' and 1 if it replaces
the conversation's own (else it is set only where none is), what each mark keeps beside
its answer (msgpack [session key, failure]), then the entries, field/value
pairs, answered ids and done seqs, then (only with deliveries) the delivery ledger's
affixes and drafts (:mod:`chatlane.stores.redis_ledger_scripts`), recorded if the commit
applies.
Reply: {OK, 1 if the lease was released else 0} | {STALE, current} | {ANSWERED, id...} |
{UNSTARTED} (no candidate, and the session has no conversation: nothing was written).
The lease is released (as :data:`RELEASE` would) only by a commit that applied."""

FORGET_ANSWERED = _script(
    "answered_at answers answer_marks",
    """
local ids = redis.call('ZRANGEBYSCORE', K.answered_at, '-inf', ARGV[1], 'LIMIT', 0, ARGV[2])
for _, id in ipairs(ids) do
  redis.call('HDEL', K.answers, id)
  redis.call('HDEL', K.answer_marks, id)
end
if #ids > 0 then redis.call('ZREMRANGEBYRANK', K.answered_at, 0, #ids - 1) end
return #ids
""",
)
"""ARGV: the cutoff (ms), the most marks to forget. Forgets the oldest answered marks
set at or before the cutoff, with their answers. Reply: how many it forgot."""

# -- the pending queue ----------------------------------------------------------------------

ENQUEUE = _script(
    "pending pmsg powner seq msgseq pkeys",
    """
return enqueue(ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5])
""",
)
"""ARGV: message id, owner, encoded record, session key, the seq to queue it under (0: a
new one). Reply: the seq (the known one if the message is queued already), or -1 if
another session's queued message has that id (nothing written)."""

PENDING = _script(
    "pending pmsg powner",
    """
local out = {}
local rows = redis.call('ZRANGE', K.pending, 0, -1, 'WITHSCORES')
for i = 1, #rows, 2 do
  local id = rows[i]
  out[#out + 1] = rows[i + 1]
  out[#out + 1] = id
  out[#out + 1] = redis.call('HGET', K.powner, id)
  out[#out + 1] = redis.call('HGET', K.pmsg, id)
end
return out
""",
)
"""Reply: seq, message id, owner, record — four values per record, in seq order."""

DROP = _script(
    "pending pmsg powner msgseq pkeys",
    """
for j = 2, #ARGV do remove_pending(ARGV[j]) end
forget_if_empty(ARGV[1])
return 0
""",
)
"""ARGV: session key, then the seqs to remove."""

DROP_OWN = _script(
    "pending pmsg powner msgseq pkeys",
    """
local owner, dropped = ARGV[2], {}
for j = 3, #ARGV do
  local id = redis.call('ZRANGEBYSCORE', K.pending, ARGV[j], ARGV[j])[1]
  if id and redis.call('HGET', K.powner, id) == owner then
    remove_pending(ARGV[j])
    dropped[#dropped + 1] = tonumber(ARGV[j])
  end
end
if #dropped > 0 then forget_if_empty(ARGV[1]) end
return dropped
""",
)
"""ARGV: session key, owner, then the seqs to remove if that owner still owns them."""

ADOPT = _script(
    "pending powner ops gen",
    """
local rid, old, new, fence = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local retried = seen(rid)
local wanted = old
if retried then wanted = new end
if not retried and fence ~= '' and (redis.call('GET', K.gen) or '0') ~= fence then
  return {}
end
local adopted, ids = {}, {}
for j = 5, #ARGV do
  local id = redis.call('ZRANGEBYSCORE', K.pending, ARGV[j], ARGV[j])[1]
  if id and redis.call('HGET', K.powner, id) == wanted then
    adopted[#adopted + 1] = tonumber(ARGV[j])
    ids[#ids + 1] = id
  end
end
if not retried then
  for _, id in ipairs(ids) do redis.call('HSET', K.powner, id, new) end
  remember(rid)
end
return adopted
""",
)
"""ARGV: request id, old owner, new owner, the generation it is fenced by (empty: none),
then the seqs in order. Reply: the seqs adopted (none if the generation moved on)."""

PARK = _script(
    "pending pmsg powner msgseq pkeys failed failed_at",
    """
local member, moment = ARGV[1], ARGV[2]
local parked = 0
for j = 3, #ARGV, 3 do
  local seq, id, record = ARGV[j], ARGV[j + 1], ARGV[j + 2]
  if redis.call('ZSCORE', K.pending, id) then
    remove_pending(seq)
    redis.call('HSET', K.failed, id, record)
    redis.call('ZADD', K.failed_at, moment, id)
    parked = parked + 1
  end
end
forget_if_empty(member)
return parked
""",
)
"""ARGV: session key, failure time ms, then (seq, message id, encoded failed record) for
each record. A record no longer pending is left alone. Reply: how many were parked."""

RETRY = _script(
    "pending pmsg powner msgseq pkeys failed failed_at",
    """
local id, expected, seq, owner = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local record, member = ARGV[5], ARGV[6]
if redis.call('HGET', K.failed, id) ~= expected then return 0 end
if redis.call('HGET', K.msgseq, id) and not redis.call('ZSCORE', K.pending, id) then
  return FOREIGN
end
redis.call('HDEL', K.failed, id)
redis.call('ZREM', K.failed_at, id)
redis.call('ZADD', K.pending, seq, id)
redis.call('HSET', K.pmsg, id, record)
redis.call('HSET', K.powner, id, owner)
redis.call('HSET', K.msgseq, id, seq)
redis.call('SADD', K.pkeys, member)
return 1
""",
)
"""ARGV: message id, its failed record as read, seq, new owner, encoded pending record,
session key. Reply: 1, or 0 if the failed record changed or went since it was read, or -1
if another session's queued message has its id (nothing written)."""

# -- a turn's fused calls ----------------------------------------------------------------------

ENQUEUE_ACQUIRE = _script(
    "pending pmsg powner seq msgseq pkeys gen lease last live persist",
    """
local id, owner, record, member = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local token, ttl, cap = ARGV[5], tonumber(ARGV[6]), tonumber(ARGV[7])
local seq = enqueue(id, owner, record, member)
if seq == FOREIGN then return {seq, {}, {}} end
local granted = acquire(token, owner, ttl, int(seq), cap, member)
local fields = {}
if ARGV[8] == '1' then fields = redis.call('HGETALL', K.persist) end
return {seq, granted, fields}
""",
)
"""ARGV: message id, owner, encoded record, session key, token, ttl ms, max active,
'1' to read the persistent fields. Reply: {seq, the reply :data:`ACQUIRE` would give
with the seq as head seq, the persistent fields as field/value pairs (empty if not asked)}.
The message is queued whatever the lease's answer; if another session's queued message has
its id, nothing is written and the reply is {-1, {}, {}}."""

ACQUIRE_READ = _script(
    "gen lease last pending powner live persist",
    """
local granted = acquire(ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4], tonumber(ARGV[5]), ARGV[6])
if granted[1] ~= OK then return {granted, {}} end
return {granted, redis.call('HGETALL', K.persist)}
""",
)
"""ARGV: as :data:`ACQUIRE`. Reply: {its reply, the persistent fields as field/value pairs}."""

# -- conversations ---------------------------------------------------------------------------

_CONVERSATION_KEYS = "conv convs ctitle cended"

CONVERSATION = _script(
    _CONVERSATION_KEYS,
    """
return describe(current_conversation(ARGV[1]))
""",
)
"""ARGV: candidate id. Reply: id, started µs, ended µs (0 while current), title."""

NEW_CONVERSATION = _script(
    _CONVERSATION_KEYS,
    """
if redis.call('GET', K.conv) ~= ARGV[1] then
  end_current()
  start_conversation(ARGV[1], ARGV[2])
end
return describe(ARGV[1])
""",
)
"""ARGV: new id, title. Reply: as :data:`CONVERSATION`."""

RESUME = _script(
    _CONVERSATION_KEYS,
    """
local id = ARGV[1]
if not redis.call('ZSCORE', K.convs, id) then return {} end
end_current()
redis.call('HDEL', K.cended, id)
redis.call('SET', K.conv, id)
return describe(id)
""",
)
"""ARGV: conversation id. Reply: as :data:`CONVERSATION`, or empty if it is not the session's."""

CONVERSATIONS = _script(
    _CONVERSATION_KEYS,
    """
current_conversation(ARGV[1])
local limit = tonumber(ARGV[2])
local stop = -1
if limit > 0 then stop = limit - 1 end
local out = {}
for _, id in ipairs(redis.call('ZREVRANGE', K.convs, 0, stop)) do
  for _, value in ipairs(describe(id)) do out[#out + 1] = value end
end
return out
""",
)
"""ARGV: candidate id, limit. Reply: four values per conversation, newest first."""

TRANSCRIPT = _script(
    _CONVERSATION_KEYS,
    """
local id = current_conversation(ARGV[1])
local limit = tonumber(ARGV[4])
if limit <= 0 then return {id} end
local out = redis.call('LRANGE', ARGV[2] .. id .. ARGV[3], -limit, -1)
table.insert(out, 1, id)
return out
""",
)
"""ARGV: candidate id, the two transcript key affixes, limit. Reply: the current
conversation's id, then its last ``limit`` entries."""

ALL = (
    *(ACQUIRE, RENEW, RELEASE, BUMP, ACTIVE, COMMIT, FORGET_ANSWERED),
    *(ENQUEUE, PENDING, DROP, DROP_OWN, ADOPT, PARK, RETRY, ENQUEUE_ACQUIRE, ACQUIRE_READ),
    *(CONVERSATION, NEW_CONVERSATION, RESUME, CONVERSATIONS, TRANSCRIPT),
)
"""Every script, registered once per store."""
