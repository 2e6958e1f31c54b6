"""The Lua of the Redis store's delivery ledger (see :mod:`chatlane.stores.redis_ledger`).

Text only: :mod:`chatlane.stores.redis_ledger` makes the ledger's scripts of
it, and the commit script (:data:`chatlane.stores.redis_scripts.COMMIT`)
takes :data:`HELPERS` to record a batch's deliveries in its own run, so that
they are written exactly when the commit applies. Each script's source is
``redis_scripts``' preamble and helpers, then :data:`HELPERS`, then its body.

What the scripts keep true:

* **Names, not keys, are stored.** A delivery id, target or lane is stored
  escaped (:func:`~chatlane.stores.redis_keys.escape`: never a brace), and a
  key is made by putting a name between two of the affixes
  (:meth:`~chatlane.stores.redis_keys.Keyspace.ledger_affixes`) the caller
  passes first; :func:`ledger` binds them.
* **Every target with pending deliveries is in exactly one of its lane's
  two sets**, as its head (its oldest pending delivery, the lowest seq in
  its queue) says: in the lane's ready set, scored by the head's seq, when
  the head can be claimed now; else in the lane's waiting set, scored by
  when it can be (its ``next_at``, or the end of its live claim). Every
  script that changes a head, or a head's claim or ``next_at``, calls
  :func:`schedule` for its target; a target with nothing pending is in
  neither set.
* Times are the server's ``TIME`` in microseconds, as whole numbers (so a
  hash field or score never holds ``1.7e+15``).
"""

from __future__ import annotations

KEYS = "dseq dpending ddelivered ddead ddelivered_at ddead_at"
"""The store-wide keys every ledger script is given (``KEYS`` order)."""

COMMIT_KEYS = "dseq dpending"
"""The store-wide keys the commit script adds to its own, to record deliveries."""

AFFIXES = 6
"""How many affixes open a ledger script's ``ARGV`` (see :func:`ledger`)."""

DRAFT = 7
"""``ARGV`` values per recorded draft: escaped id, lane and target, then id, lane, target
and payload as they are."""

HELPERS = f"""
local AFFIXES, DRAFT = {AFFIXES}, {DRAFT}
local L = {{}}

local function ledger(at)
  L.d, L.q, L.r, L.w, L.c = ARGV[at], ARGV[at + 1], ARGV[at + 2], ARGV[at + 3], ARGV[at + 4]
  L.tail = ARGV[at + 5]
  return at + AFFIXES
end

local function named(head, name)
  return head .. name .. L.tail
end

local function due_at(key)
  local f = redis.call('HMGET', key, 'next_at', 'claim', 'claim_expires')
  if not f[1] then return nil end
  if f[2] == '' then return tonumber(f[1]) end
  return math.max(tonumber(f[1]), tonumber(f[3]))
end

local function schedule(lname, tname, now)
  local ready, waiting, queue = named(L.r, lname), named(L.w, lname), named(L.q, tname)
  local head, at = {{}}, nil
  repeat
    head = redis.call('ZRANGE', queue, 0, 0, 'WITHSCORES')
    if #head == 0 then
      redis.call('ZREM', ready, tname)
      redis.call('ZREM', waiting, tname)
      return
    end
    at = due_at(named(L.d, head[1]))
    if not at then  -- its hash is gone (evicted or deleted): a stray, dropped
      redis.call('ZREM', queue, head[1])
      redis.call('ZREM', K.dpending, head[1])
    end
  until at
  if at <= now then
    redis.call('ZREM', waiting, tname)
    redis.call('ZADD', ready, head[2], tname)
  else
    redis.call('ZREM', ready, tname)
    redis.call('ZADD', waiting, int(at), tname)
  end
end

local function ledger_args(drafts)
  if drafts == 0 then return 0 end
  return AFFIXES + DRAFT * drafts
end

local function record_deliveries(at, drafts)
  if drafts == 0 then return end
  local first, now = ledger(at), now_us()
  for j = first, first + DRAFT * (drafts - 1), DRAFT do
    local name, lname, tname = ARGV[j], ARGV[j + 1], ARGV[j + 2]
    local key = named(L.d, name)
    if redis.call('EXISTS', key) == 0 then
      local seq = int(redis.call('INCR', K.dseq))
      redis.call('HSET', key, 'id', ARGV[j + 3], 'lane', ARGV[j + 4], 'target', ARGV[j + 5],
        'payload', ARGV[j + 6], 'seq', seq, 'created_at', int(now), 'state', 'pending',
        'attempts', 0, 'next_at', 0, 'claim', '', 'claim_expires', 0, 'holder', '',
        'uncertain', 0, 'reason', '', 'settled_at', 0, 'lname', lname, 'tname', tname, 'op', '')
      local queue = named(L.q, tname)
      redis.call('ZADD', queue, seq, name)
      redis.call('ZADD', K.dpending, seq, name)
      if redis.call('ZCARD', queue) == 1 then schedule(lname, tname, now) end
    end
  end
end
"""
"""Shared by the ledger's scripts and the commit script:

* ``ledger(at)`` binds the affixes at ``ARGV[at]`` (a delivery's hash, a target's
  queue, a lane's ready and waiting sets, a claim's record, then the tail) and
  returns where the script's own arguments start; ``named(head, name)`` makes a key.
* ``schedule(lname, tname, now)`` puts a target in its lane's ready or waiting set
  (or neither), as its head says. A queued name whose hash is gone (a Redis that
  evicts keys, or one deleted by hand) is dropped from the queue on the way, so the
  lane is never stuck on it.
* ``record_deliveries(at, drafts)`` records ``drafts`` drafts (:data:`DRAFT` values
  each, after the affixes at ``at``) not recorded before: pending, due at once, with
  the next seq; ``ledger_args(drafts)`` is how many ``ARGV`` values that takes.

A delivery's hash holds ``id``, ``lane``, ``target``, ``payload``, ``seq``,
``created_at``, ``state``, ``attempts``, ``next_at``, ``claim``, ``claim_expires``,
``holder``, ``uncertain`` (``0``/``1``), ``reason``, ``settled_at`` (times in µs), the
escaped ``lname`` and ``tname`` its keys are found by, and ``op``: the request id of
the last settle or retry applied to it (so the same request sent again says it applied).
"""

RECORD = """
record_deliveries(2, tonumber(ARGV[1]))
return 0
"""
"""ARGV: how many drafts, the affixes, then :data:`DRAFT` values per draft."""

CLAIM = """
local first = ledger(1)
local rid, holder, ttl = ARGV[first], ARGV[first + 1], tonumber(ARGV[first + 2])
local most, lanes = ARGV[first + 3], tonumber(ARGV[first + 4])
local tokens_at = first + 5 + lanes
local record = named(L.c, rid)
local claimed = redis.call('LRANGE', record, 0, -1)
if #claimed == 0 then
  local now, limit, heads = now_us(), #ARGV - tokens_at + 1, {}
  for j = first + 5, tokens_at - 1 do
    local lname = ARGV[j]
    local due = redis.call('ZRANGEBYSCORE', named(L.w, lname), '-inf', int(now), 'LIMIT', 0, most)
    for _, tname in ipairs(due) do schedule(lname, tname, now) end
    local ready = redis.call('ZRANGE', named(L.r, lname), 0, limit - 1, 'WITHSCORES')
    for i = 1, #ready, 2 do heads[#heads + 1] = {tonumber(ready[i + 1]), lname, ready[i]} end
  end
  table.sort(heads, function(a, b) return a[1] < b[1] end)
  for i = 1, math.min(limit, #heads) do
    local lname, tname = heads[i][2], heads[i][3]
    local name = redis.call('ZRANGE', named(L.q, tname), 0, 0)[1]
    local key = name and named(L.d, name)
    local at = key and due_at(key)
    if at and at <= now then
      local f = redis.call('HMGET', key, 'claim', 'uncertain')
      local uncertain = (f[1] ~= '' or f[2] == '1') and 1 or 0
      redis.call('HSET', key, 'claim', ARGV[tokens_at + #claimed], 'claim_expires',
        int(now + ttl), 'holder', holder, 'uncertain', uncertain)
      claimed[#claimed + 1] = name
    end
    schedule(lname, tname, now)
  end
  if #claimed > 0 then
    redis.call('RPUSH', record, unpack(claimed))
    redis.call('PEXPIRE', record, math.max(1, math.ceil(ttl / 1000)))
  end
end
local out = {}
for i, name in ipairs(claimed) do
  local key = named(L.d, name)
  if redis.call('HGET', key, 'claim') == ARGV[tokens_at + i - 1] then
    out[#out + 1] = redis.call('HGETALL', key)
  end
end
return out
"""
"""ARGV: the affixes, request id, holder, ttl µs, the most targets to move per lane, how
many lanes, the escaped lanes, then one fresh token per delivery it may claim (their
number is the limit).

Moves each lane's waiting targets that became due to its ready set (those due
longest first, up to the most it is given: a larger backlog goes over the next
claims), takes up to the limit of the lowest seqs among the ready sets, and claims
each head: the next
token, ``claim_expires`` now + ttl, the holder, and ``uncertain`` if an earlier claim
of it expired unsettled. What it claimed is remembered under the request id for the
ttl, so the same request sent again (its reply was lost) claims nothing more and
hands back the same deliveries. Reply: each claimed delivery's hash, as ``HGETALL``
gives it, oldest first."""

SETTLE = """
local function settle(name, key, kind, delay, reason, maybe_sent, now)
  local f = redis.call('HMGET', key, 'seq', 'lname', 'tname')
  if kind == 'delivered' or kind == 'dead' then
    local by_seq, by_time = K.ddelivered, K.ddelivered_at
    if kind == 'dead' then
      by_seq, by_time = K.ddead, K.ddead_at
      redis.call('HSET', key, 'reason', reason)
      if maybe_sent then redis.call('HSET', key, 'uncertain', 1) end
    end
    redis.call('HSET', key, 'state', kind, 'claim', '', 'settled_at', int(now))
    redis.call('ZREM', named(L.q, f[3]), name)
    redis.call('ZREM', K.dpending, name)
    redis.call('ZADD', by_seq, f[1], name)
    redis.call('ZADD', by_time, int(now), name)
  else
    if kind == 'retry' then redis.call('HINCRBY', key, 'attempts', 1) end
    redis.call('HSET', key, 'next_at', int(now + delay), 'claim', '')
    if reason ~= '' then redis.call('HSET', key, 'reason', reason) end
    if maybe_sent then redis.call('HSET', key, 'uncertain', 1) end
  end
  schedule(f[2], f[3], now)
end

local first = ledger(1)
local rid, now, applied = ARGV[first], now_us(), {}
for j = first + 1, #ARGV, 6 do
  local name, token = ARGV[j], ARGV[j + 1]
  local key, op = named(L.d, name), rid .. '/' .. j
  local f = redis.call('HMGET', key, 'claim', 'op')
  local ok = f[2] == op
  if not ok and token ~= '' and f[1] == token then
    settle(name, key, ARGV[j + 2], tonumber(ARGV[j + 3]), ARGV[j + 4], ARGV[j + 5] == '1', now)
    redis.call('HSET', key, 'op', op)
    ok = true
  end
  applied[#applied + 1] = ok and 1 or 0
end
return applied
"""
"""ARGV: the affixes, request id, then for each settlement: escaped id, claim token,
kind (``delivered``, ``retry``, ``release`` or ``dead``), delay µs, reason, ``1`` if
maybe sent else ``0``.

Applies each settlement whose token is the delivery's claim (a settlement of this
request applied before, its reply lost, counts as applied). Reply: ``1`` or ``0`` per
settlement, in order."""

RETRY_DEAD = """
local first = ledger(1)
local rid, name = ARGV[first], ARGV[first + 1]
local key = named(L.d, name)
local f = redis.call('HMGET', key, 'state', 'op', 'seq', 'lname', 'tname')
if f[2] == rid then return 1 end
if f[1] ~= 'dead' then return 0 end
redis.call('HSET', key, 'state', 'pending', 'attempts', 0, 'next_at', 0, 'settled_at', 0,
  'op', rid)
redis.call('ZREM', K.ddead, name)
redis.call('ZREM', K.ddead_at, name)
redis.call('ZADD', K.dpending, f[3], name)
redis.call('ZADD', named(L.q, f[5]), f[3], name)
schedule(f[4], f[5], now_us())
return 1
"""
"""ARGV: the affixes, request id, escaped id. Makes a dead delivery pending again with
its seq, due now, no attempts counted. Reply: 1 if it did (or this request did
before), else 0."""

LISTED = """
local first = ledger(1)
local sets = {pending = K.dpending, delivered = K.ddelivered, dead = K.ddead}
local set, limit = sets[ARGV[first]], tonumber(ARGV[first + 1])
local out = {}
if not set or limit <= 0 then return out end
for i, name in ipairs(redis.call('ZRANGE', set, 0, limit - 1)) do
  out[i] = redis.call('HGETALL', named(L.d, name))
end
return out
"""
"""ARGV: the affixes, a state, the limit. Reply: the hashes of up to ``limit``
deliveries in that state, lowest seq first (none for an unknown state)."""

STATS = """
ledger(1)
local oldest, at = redis.call('ZRANGE', K.dpending, 0, 0)[1], '0'
if oldest then at = redis.call('HGET', named(L.d, oldest), 'created_at') end
return {redis.call('ZCARD', K.dpending), at, redis.call('ZCARD', K.ddead)}
"""
"""ARGV: the affixes. Reply: {pending, ``created_at`` µs of the lowest pending seq or
0, dead}. The lowest seq was recorded first, by one server clock, so it is the
earliest ``created_at`` (unless that clock was set back in between)."""

FORGET = """
local first = ledger(1)
local now, most = now_us(), tonumber(ARGV[first + 2])
local function forget(by_seq, by_time, retention)
  local names = redis.call('ZRANGEBYSCORE', by_time, '-inf', int(now - retention), 'LIMIT', 0, most)
  for _, name in ipairs(names) do
    redis.call('DEL', named(L.d, name))
    redis.call('ZREM', by_seq, name)
  end
  if #names > 0 then redis.call('ZREMRANGEBYRANK', by_time, 0, #names - 1) end
  return #names
end
return forget(K.ddelivered, K.ddelivered_at, tonumber(ARGV[first]))
  + forget(K.ddead, K.ddead_at, tonumber(ARGV[first + 1]))
"""
"""ARGV: the affixes, the delivered retention µs, the dead retention µs, the most to
forget of each. Forgets delivered and dead deliveries settled at least their
retention ago, oldest settled first. Reply: how many it forgot."""
