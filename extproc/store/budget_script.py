"""The Lua script behind shared budgets: one exchange per tenant, period and replica.

One key per tenant and period (``<prefix>:bud:<tenant>:<period key>``), a hash:

- ``gen``: the generation of this count, made when the key is (re)created. A replica
  confirmed under another generation saw a count Redis has since lost.
- ``mt``/``mc``: settled tokens/nanos carried over from before this generation: the
  durable copy (the console's) or the highest count a replica saw of the lost one.
- ``h:<holder>``: per replica process, ``seq st sc bt bc ot oc lt lc e``: the holder's
  last applied exchange, its cumulative settled spend in this period, the part of that
  already counted in ``mt``/``mc`` (its confirmed spend when it registered in this
  generation), its reservations in flight, its lease (room set aside for it to admit
  from without a round trip) and the lease's deadline (Redis time).

Settled = mt + sum(s - b); committed = settled + sum(o) + the unexpired leases. A
request is admitted when committed + its cost fits the limit (per limited unit), so the
replicas together never reserve past the budget. A holder reports absolute values, with
a sequence number: a late, older exchange is ignored, and a retry after a lost reply
just reports again (what a lost reply admitted is overwritten by the holder's own
count: the holder never knew of it, its request was not sent).

Why the count survives losing Redis: each replica remembers the settled total of its
last answer and its own settled spend at that time; after the loss, the highest such
total (or the console's copy, whichever is higher) plus what each replica settled since
its last answer is the count again. Numbers travel as ``%.17g`` strings (exact integers
up to 2**53).
"""

from __future__ import annotations

# KEYS[1]: the period's hash. ARGV[1] holder, ARGV[2] now ('' = Redis TIME), ARGV[3] the
# numbers (one argument, space-separated): seq, limit t/c (-1: unlimited), settled t/c,
# in flight t/c, confirmed settled t/c, seen settled t/c, seed t/c, slice cap t/c, live
# replicas, lease ttl, want a lease (0/1), expire-at (epoch s); ARGV[4] the holder's
# generation ('' none), ARGV[5] the costs to admit ("t:c t:c ...").
BUDGET_EXCHANGE = r"""
local h = ARGV[1]
local now
if ARGV[2] ~= '' then now = tonumber(ARGV[2]) else
  local t = redis.call('TIME'); now = tonumber(t[1]) + tonumber(t[2]) / 1000000
end
local A = {}
for x in string.gmatch(ARGV[3], '%S+') do A[#A + 1] = tonumber(x) end
local seq, lim_t, lim_c = A[1], A[2], A[3]
local st, sc, ot, oc, cst, csc = A[4], A[5], A[6], A[7], A[8], A[9]
local vt, vc, seed_t, seed_c, cap_t, cap_c = A[10], A[11], A[12], A[13], A[14], A[15]
local live, ttl, want, expire_at = math.max(1, A[16]), A[17], A[18] == 1, A[19]
local hgen = ARGV[4]
local function fmt(x) return string.format('%.17g', x) end

local raw = redis.call('HGETALL', KEYS[1])
local f = {}
for i = 1, #raw, 2 do f[raw[i]] = raw[i + 1] end
local gen = f['gen']
local mt, mc = tonumber(f['mt'] or '0'), tonumber(f['mc'] or '0')
if gen == nil then
  gen = fmt(now) .. '/' .. h
  mt, mc = math.max(seed_t, vt), math.max(seed_c, vc)
end
local holders = {}
for k, v in pairs(f) do
  if string.sub(k, 1, 2) == 'h:' then
    local r = {}
    for x in string.gmatch(v, '%S+') do r[#r + 1] = tonumber(x) end
    holders[string.sub(k, 3)] = r
  end
end
local me = holders[h]
if me == nil or hgen ~= gen then
  -- Registering in this generation: what it had confirmed is in mt/mc already (through its
  -- own view, another replica's, or the console's copy), what it settled since is not.
  if hgen ~= '' and hgen ~= gen then mt, mc = math.max(mt, vt), math.max(mc, vc) end
  me = {-1, cst, csc, cst, csc, 0, 0, 0, 0, 0}
  holders[h] = me
end
local stale = seq <= me[1]
if not stale then
  me[1], me[2], me[3], me[6], me[7], me[8], me[9] = seq, st, sc, ot, oc, 0, 0
end

local set_t, set_c, out_t, out_c, lease_t, lease_c = mt, mc, 0, 0, 0, 0
for _, r in pairs(holders) do
  set_t, set_c = set_t + r[2] - r[4], set_c + r[3] - r[5]
  out_t, out_c = out_t + r[6], out_c + r[7]
  if r[10] > now then lease_t, lease_c = lease_t + r[8], lease_c + r[9] end
end
local com_t, com_c = set_t + out_t + lease_t, set_c + out_c + lease_c
local function fits(t, c)
  return (lim_t < 0 or com_t + t <= lim_t) and (lim_c < 0 or com_c + c <= lim_c)
end

local flags = {}
if not stale then
  for pair in string.gmatch(ARGV[5], '%S+') do
    local t, c = string.match(pair, '([^:]+):([^:]+)')
    t, c = tonumber(t), tonumber(c)
    if fits(t, c) then
      com_t, com_c = com_t + t, com_c + c
      me[6], me[7] = me[6] + t, me[7] + c
      flags[#flags + 1] = '1'
    else
      flags[#flags + 1] = '0'
    end
  end
end

-- The lease: a slice of the room left that shrinks to nothing as the budget nears its end.
local sl_t, sl_c = 0, 0
if want and not stale then
  local ok = true
  if lim_t >= 0 then
    sl_t = math.floor(math.min(cap_t, (lim_t - com_t) / (2 * live)))
    ok = ok and sl_t >= 1
  end
  if lim_c >= 0 then
    sl_c = math.floor(math.min(cap_c, (lim_c - com_c) / (2 * live)))
    ok = ok and sl_c >= 1
  end
  if not ok then sl_t, sl_c = 0, 0 end
  if ok then
    me[8], me[9], me[10] = sl_t, sl_c, now + ttl
    com_t, com_c = com_t + sl_t, com_c + sl_c
  end
end

redis.call('HSET', KEYS[1], 'gen', gen, 'mt', fmt(mt), 'mc', fmt(mc), 'h:' .. h,
  table.concat({fmt(me[1]), fmt(me[2]), fmt(me[3]), fmt(me[4]), fmt(me[5]), fmt(me[6]), fmt(me[7]),
                fmt(me[8]), fmt(me[9]), fmt(me[10])}, ' '))
redis.call('PEXPIREAT', KEYS[1], math.ceil(expire_at * 1000))
return {gen, fmt(set_t), fmt(set_c), fmt(com_t), fmt(com_c), fmt(sl_t), fmt(sl_c), stale and 'stale' or '',
        table.concat(flags, '')}
"""
