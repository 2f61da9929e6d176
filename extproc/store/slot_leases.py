"""Slots and KV reservations shared by every replica: leases in Redis, in blocks.

Each replica holds a lease on a part of each pool: ``s`` slots and ``k`` KV tokens,
one sorted-set entry per holder (the replica's registry member, ``<id>#<epoch>``)
scored by a Redis-time deadline (``ttl_s``, default 10 s), its amounts in a hash
beside it. A pool is a backend's, or one endpoint's of a pool backend
(``extproc.runtime.leases`` names them and wires them into the backends). The
replica admits from its lease locally, with the pure slot pool and KV rule unchanged
(its ``BackendState`` is configured with the leased amounts as its
``max_concurrency`` and ``kv_capacity_tokens``), so a request costs no round trip.

The lease is kept at ``wanted + block`` (wanted: in use plus what waits for room;
block = ``ceil(pool / (4 × live replicas))``, the same for KV): a check every
``check_s`` (50 ms) asks for more when fewer than half a block is spare and gives
back what exceeds two blocks; otherwise the lease is renewed every ttl/3. An acquire
refused for room ``poke``s the check to run at once (coalesced; a woken check that
grew nothing is not repeated by a wake before ``check_s``). One script
(``SLOT_LEASE``) per pool and exchange, one exchange per pool in flight: it purges
expired holders first, then grants ``min(want, pool − what the others hold)``, so the
leases together never exceed the pool. Asking is absolute ("I want to hold s, k"),
so a lost answer is harmless; an ask Redis runs late, after a newer one of the same
replica, is ignored (a sequence number per ask, ``SlotLeases.exchange``).

Fencing: the script grants nothing to a member that is not alive in the registry
(expired or gone) and drops what it held; the replica sets its lease to 0 (it admits
nothing new; its requests in flight finish) until the registry's heartbeat registers
it again under a new epoch. A replica that dies gives its lease back when the lease
expires: within ttl; the survivors see the room at their next check.

Bounds: the slots (KV) in use by all replicas ≤ the pool, except while the requests
in flight of a replica fenced alone (paused past its ttl while the others reached
Redis) finish. A hot replica can lease at least ``pool − (N −
1) × block`` ≈ ``pool × (3N + 1) / (4N)`` while the others are idle; a request
finding its replica's lease full waits one round trip in the queue (or, in a tier
without a queue, is refused while the lease grows for the next). Redis unreachable:
the lease is used until its local deadline, then cut to ``floor(pool / the most
replicas seen in the last ttl Redis answered)`` (``Registry.most_seen``) until Redis answers.

Redis back without the leases (restarted empty, or frozen past the ttl so that every
member expired): each replica caps its leases at what it held when it found itself
fenced until every replica has reported on the pool (``extproc.store.lease_recovery``,
with why the pool is not exceeded meanwhile).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

from extproc.store.lease_recovery import LeaseRecovery
from extproc.store.pool_lease import PoolLease
from extproc.store.registry import Registry

log = logging.getLogger("sluice.store")

# KEYS[1]: the pool's holders (sorted set, score: Redis-time deadline), KEYS[2]: their
# amounts (hash member -> "slots kv"), KEYS[3]: the replica registry, KEYS[4]: the members
# that reported on this pool (sorted set, score: Redis-time deadline; a holder of 0 too),
# KEYS[5]: each member's last ask (hash member -> "token seq").
# ARGV: member, want slots, want kv, pool slots, pool kv, ttl, now ('' = Redis TIME), the
# ask's sequence number, the process's registry token.
# Returns {granted slots, granted kv, slots the others hold, kv the others hold, registered
# members that reported here within the ttl, registered members}; granted -1: fenced;
# -2: an older ask than one already applied (from the same process), ignored.
SLOT_LEASE = r"""
local now
if ARGV[7] ~= '' then now = tonumber(ARGV[7]) else
  local t = redis.call('TIME'); now = tonumber(t[1]) + tonumber(t[2]) / 1000000
end
local m = ARGV[1]
local alive = redis.call('ZSCORE', KEYS[3], m)
if not alive or tonumber(alive) < now then
  redis.call('ZREM', KEYS[1], m); redis.call('HDEL', KEYS[2], m); redis.call('HDEL', KEYS[5], m)
  return {-1, 0, 0, 0, 0, 0}
end
-- An ask run late (sent before a newer one that Redis ran first) must not overwrite it. The
-- token: a member name handed out again by an epoch counter restarted from 0 is another's.
local last = redis.call('HGET', KEYS[5], m)
if last then
  local tok, n = string.match(last, '(%S+) (%S+)')
  if tok == ARGV[9] and tonumber(n) >= tonumber(ARGV[8]) then return {-2, 0, 0, 0, 0, 0} end
end
redis.call('HSET', KEYS[5], m, ARGV[9] .. ' ' .. ARGV[8])
for _, o in ipairs(redis.call('HKEYS', KEYS[5])) do  -- forget the asks of members gone
  local a = redis.call('ZSCORE', KEYS[3], o)
  if not a or tonumber(a) < now then redis.call('HDEL', KEYS[5], o) end
end
local dead = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. string.format('%.17g', now))
for _, d in ipairs(dead) do redis.call('HDEL', KEYS[2], d) end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. string.format('%.17g', now))
local os_, ok_ = 0, 0
local raw = redis.call('HGETALL', KEYS[2])
for i = 1, #raw, 2 do
  if raw[i] ~= m then
    local s, k = string.match(raw[i + 1], '(%S+) (%S+)')
    os_, ok_ = os_ + tonumber(s), ok_ + tonumber(k)
  end
end
local gs = math.max(0, math.min(tonumber(ARGV[2]), tonumber(ARGV[4]) - os_))
local gk = math.max(0, math.min(tonumber(ARGV[3]), tonumber(ARGV[5]) - ok_))
if gs == 0 and gk == 0 then
  redis.call('ZREM', KEYS[1], m); redis.call('HDEL', KEYS[2], m)
else
  redis.call('HSET', KEYS[2], m, gs .. ' ' .. gk)
  redis.call('ZADD', KEYS[1], string.format('%.17g', now + tonumber(ARGV[6])), m)
end
local nows = string.format('%.17g', now)
redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', '(' .. nows)
redis.call('ZADD', KEYS[4], string.format('%.17g', now + tonumber(ARGV[6])), m)
local reported = 0
for _, r in ipairs(redis.call('ZRANGE', KEYS[4], 0, -1)) do
  local a = redis.call('ZSCORE', KEYS[3], r)
  if a and tonumber(a) >= now then reported = reported + 1 end
end
return {gs, gk, os_, ok_, reported, redis.call('ZCOUNT', KEYS[3], nows, '+inf')}
"""


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def block(pool: int, live: int) -> int:
    """The lease's headroom: ``ceil(pool / (4 × live))``, at least 1 (0 for an empty pool)."""
    return 0 if pool <= 0 else max(1, -(-pool // (4 * max(1, live))))


def want(pool: int, in_use: int, held: int, live: int) -> int | None:
    """What to hold next: ``in use + block`` when spare < block / 2 or > 2 blocks; None: keep."""
    b = block(pool, live)
    spare = held - in_use
    if 2 * spare < b or spare > 2 * b:
        return min(pool, in_use + b)
    return None


class SlotLeases:
    """Every backend's pool lease of one replica; ``run`` keeps them (see the module docstring;
    Redis back without the leases: ``recovery``)."""

    def __init__(self, client: Any, registry: Registry, prefix: str = "sluice", *, ttl_s: float = 10.0,
                 check_s: float = 0.05, timeout_s: float = 0.1, recover_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.client, self.registry, self.prefix = client, registry, prefix
        self.ttl_s, self.check_s, self.timeout_s, self.clock = ttl_s, check_s, timeout_s, clock
        self.leases: dict[str, PoolLease] = {}
        self.recovery = LeaseRecovery(registry, self.leases, ttl_s, recover_s)
        self.fenced = 0  # times an exchange found this replica's member gone
        self.errors = 0
        self.wakes = 0  # checks run early because an acquire found its lease short
        # lease name -> (slots, kv) refused for room since the last check (extproc.runtime.leases)
        self.short: dict[str, tuple[int, int]] = {}
        self._script = client.register_script(SLOT_LEASE)
        self.seq = 0  # the last ask's sequence number (the script ignores an ask older than one it ran)
        self._wake = asyncio.Event()
        self._woken = False  # the last check ran because of a wake
        self._grew = False  # ... and some lease grew in it
        self.failing = False  # the last exchange failed (a lease waiter does not wait for the next)
        self.asked = 0  # want_more calls so far: a check started after the n-th has read it
        self._lease_waiters: list[tuple[int, asyncio.Future[None]]] = []  # (asked when refused, woken by)

    # -- waking the check early -----------------------------------------------------------
    def want_more(self, name: str, slots: int, kv: int) -> None:
        """Requests of ``slots`` and ``kv`` found lease ``name`` short: the next check asks for them too."""
        s, k = self.short.get(name, (0, 0))
        self.short[name] = (s + slots, k + kv)
        self.asked += 1

    def poke(self) -> None:
        """An acquire found its lease short: run the next check now (coalesced: many pokes, one check)."""
        self._wake.set()

    async def wait(self) -> None:
        """Until the next check: ``check_s``, or sooner when poked.

        A check run by a wake that grew nothing (the others hold the rest of the pool)
        is not repeated by the next wake before ``check_s``: waiters that still do not
        fit would otherwise poke a round trip per loop turn."""
        if self._woken and not self._grew:
            await asyncio.sleep(self.check_s)
            self._woken = False
        else:
            # asyncio.timeout, not wait_for: Python 3.11's wait_for returns the result when the
            # wait ends as the task is cancelled, dropping the cancel (run_leases, cancelled
            # right after a poke, then looped on for ever: seen as a test hung in its teardown).
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.check_s):
                    await self._wake.wait()
            self._woken = self._wake.is_set()
            if self._woken:
                self.wakes += 1
        self._wake.clear()

    def next_check(self, timeout_s: float) -> asyncio.Future[None]:
        """Done once a check that has read the caller's ``want_more`` (the last one) has ended, or
        after ``timeout_s``. Not simply the next check to end: one already running may have read
        it (and grown the lease), and the check after that shrinks the lease again, since the
        refusal it recorded is no longer pending. For the same reason the wait is registered
        here, at the call, not when it is awaited: call it in the step that was refused, before
        any await, so that a check which reads the refusal and ends before the caller awaits
        still counts (else the refused stream, resuming after that check has ended, would wait
        for the next one, which shrinks the lease, and its retry would be refused). The last
        exchange failed (Redis unreachable): done at once, no lease can grow."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        if self.failing:
            fut.set_result(None)
            return fut
        self._lease_waiters.append((self.asked, fut))
        timer = loop.call_later(timeout_s, _resolve, fut)
        fut.add_done_callback(lambda _: timer.cancel())
        return fut

    def begin_check(self) -> int:
        """A check starts: it reads every ``want_more`` so far (pass the result to ``end_check``)."""
        return self.asked

    def end_check(self, seen: int) -> None:
        """The check begun at ``seen`` has ended: wake who it answered."""
        keep = []
        for asked, fut in self._lease_waiters:
            if asked <= seen:
                _resolve(fut)
            elif not fut.done():
                keep.append((asked, fut))
        self._lease_waiters = keep

    def keys(self, backend: str) -> list[str]:
        return [f"{self.prefix}:slots:{backend}", f"{self.prefix}:slots:{backend}:held", self.registry.keys[0],
                f"{self.prefix}:slots:{backend}:reported", f"{self.prefix}:slots:{backend}:seq"]

    def _args(self, member: str, slots: int, kv: int, ls: PoolLease) -> list[Any]:
        self.seq += 1
        return [member, slots, kv, ls.pool_slots, ls.pool_kv, repr(self.ttl_s), "", self.seq, self.registry.token]

    def lease(self, backend: str, pool_slots: int, pool_kv: int) -> PoolLease:
        ls = self.leases.get(backend)
        if ls is None:
            ls = self.leases[backend] = PoolLease(pool_slots, pool_kv)
        ls.pool_slots, ls.pool_kv = pool_slots, pool_kv
        return ls

    async def exchange(self, backend: str, slots: int, kv: int) -> PoolLease:
        """Ask to hold ``slots`` and ``kv`` of ``backend``'s pool; the lease as granted."""
        ls = self.leases[backend]
        now = self.clock()
        member = self.registry.member
        # Shrink here before Redis hears of it (it may hand the rest to another replica at
        # once); grow only when Redis answers. So this side never holds more than Redis says.
        ls.slots, ls.kv = min(ls.slots, slots), min(ls.kv, kv)
        if not member:
            ls.slots, ls.kv = 0, 0
            return ls
        # Asks are absolute, and one is in flight at a time, but one that timed out here may
        # still run in Redis (sent, then its connection dropped; Redis frozen or slow) after
        # the next, sent on another of the pool's connections: the order Redis takes two
        # connections in is not the order they were written. Run late, an older ask would
        # overwrite the newer record (holding 3 while this replica holds the 7 it was then
        # granted: the others may be granted the 4). Each ask carries a sequence number and
        # the script ignores one lower than the member's last.
        async with asyncio.timeout(self.timeout_s):  # not wait_for: see wait()
            got = await self._script(keys=self.keys(backend), args=self._args(member, slots, kv, ls))
        gs, gk, others, others_kv, reported, registered = (int(x) for x in got)
        if gs == -2:  # never the ask awaited here (the newest): kept as is
            return ls
        if gs < 0:
            self.fenced += 1
            self.recovery.recover(now)
            log.warning("slot leases: replica %s is fenced (its registration expired): %s lease dropped until "
                        "it registers again", member, backend)
            self.registry.beat_at = -math.inf  # the store's next heartbeat finds it fenced and registers anew
            ls.slots, ls.kv, ls.others, ls.others_kv = 0, 0, 0, 0
            # Not a report: the counts of the last exchange before the loss must not lift a claim.
            ls.reported, ls.registered = 0, 0
            ls.renew_at = -math.inf
            return ls
        ls.slots, ls.kv, ls.others, ls.others_kv = gs, gk, others, others_kv
        ls.reported, ls.registered = reported, registered
        ls.expires = now + self.ttl_s
        ls.renew_at = now + self.ttl_s / 3
        return ls

    async def tick(self, usage: Mapping[str, tuple[int, ...] | Callable[[], tuple[int, ...]]],
                   apply: Callable[[str, PoolLease], None] | None = None) -> dict[str, PoolLease]:
        """One check: ``usage`` lease name -> (pool slots, pool kv, slots wanted, kv wanted[, exact[,
        slots in use, kv in use]]), or a function returning it, called just before that lease
        is decided (what is in use changes while earlier exchanges of the check are awaited; a
        lease must not shrink below it).

        "Wanted" is what is in use plus what waits for room (``extproc.runtime.leases``);
        the lease is kept at that plus a block. ``exact`` (a draining pool endpoint): hold
        just what is in use, no block. What is in use (0 when not given) raises a recovering
        lease's cap to cover its requests in flight. ``apply`` is called with each lease that
        changed, a shrink before it is sent (so the backend admits within it before Redis
        gives the rest away), a grant when it arrives. Returns the leases that changed.
        """
        live = self.registry.live
        self.recovery.notice_fence(self.clock())
        changed: dict[str, PoolLease] = {}
        grew = False
        for name in [n for n in self.leases if n not in usage]:
            with contextlib.suppress(Exception):
                await self.exchange(name, 0, 0)
            del self.leases[name]
        for name, entry in usage.items():
            ps, pk, used_s, used_k, *rest = entry() if callable(entry) else entry
            exact = bool(rest and rest[0])
            busy = (int(rest[1]), int(rest[2])) if len(rest) >= 3 else (0, 0)
            ls = self.lease(name, ps, pk)
            before = (ls.slots, ls.kv)
            if exact:
                ws = None if ls.slots == used_s else min(ps, used_s)
                wk = None if pk <= 0 or ls.kv == used_k else min(pk, used_k)
            else:
                ws = want(ps, used_s, ls.slots, live)
                wk = want(pk, used_k, ls.kv, live) if pk > 0 else None
            now = self.clock()
            # before each lease, not once a check: the heartbeat may land while an earlier lease's
            # exchange is awaited, and this one would go out under the new member uncapped
            self.recovery.notice_fence(now)
            cap = self.recovery.cap(name, now, busy)
            # recovering and wanting more than the claim: exchange every check, to learn when it is lifted
            pressed = cap is not None and ((ws or 0) > cap[0] or (wk or 0) > cap[1])
            if ws is None and wk is None and now < ls.renew_at and not pressed:
                continue
            ask_s, ask_k = ls.slots if ws is None else ws, ls.kv if wk is None else wk
            if cap is not None:
                ask_s, ask_k = min(ask_s, cap[0]), min(ask_k, cap[1])
            if apply is not None and (ask_s < ls.slots or ask_k < ls.kv):
                ls.slots, ls.kv = min(ls.slots, ask_s), min(ls.kv, ask_k)
                apply(name, ls)
            try:
                await self.exchange(name, ask_s, ask_k)
                self.failing = False
                if cap is not None:
                    self.recovery.reported(name, ls)
            except Exception as exc:  # noqa: BLE001 - any store failure: keep the lease until it expires
                self.errors += 1
                self.failing = True
                self.registry.down()
                if now >= ls.expires:
                    n = max(1, self.registry.most_seen(now) or 1)
                    ls.slots, ls.kv = min(ls.slots, ps // n), min(ls.kv, pk // n)
                    log.debug("slot leases: %s: %s; local share %d slots", name, exc, ls.slots)
            if (ls.slots, ls.kv) != before:
                grew = grew or ls.slots > before[0] or ls.kv > before[1]
                changed[name] = ls
                if apply is not None:
                    apply(name, ls)
        self._grew = grew
        return changed

    def snapshot(self) -> dict[str, Any]:
        return {"fenced": self.fenced, "errors": self.errors, "wakes": self.wakes,
                "recoveries": self.recovery.recoveries, "recovering": dict(self.recovery.claims),
                "pools": {n: {"pool": ls.pool_slots, "leased": ls.slots, "others": ls.others,
                              "pool_kv": ls.pool_kv, "leased_kv": ls.kv, "others_kv": ls.others_kv}
                          for n, ls in self.leases.items()}}

    def release_all_sync(self, url: str | None) -> None:
        """Give every lease back at shutdown, through a blocking client."""
        if url is None or not self.registry.member or not self.leases:
            return
        import redis

        try:
            c = redis.Redis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.5)
            script = c.register_script(SLOT_LEASE)
            for name, ls in self.leases.items():
                script(keys=self.keys(name), args=self._args(self.registry.member, 0, 0, ls))
            c.close()
        except (redis.RedisError, OSError) as exc:
            log.warning("slot leases not returned at shutdown (%s); they expire in %.0fs", exc, self.ttl_s)
