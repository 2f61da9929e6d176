"""Slots shared by replicas as leases in Redis (extproc/store/slot_leases.py), on a real redis-server."""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from queue import Empty, Queue
from typing import Any

import pytest

from bench.procs import ROOT
from bench.redis_server import RedisServer
from extproc.backends.hold import Hold
from extproc.backends.state import BackendState
from extproc.policy.schema import build_policy, hash_key
from extproc.runtime.runtime import Runtime
from extproc.store import ENV_URL
from extproc.store.client import connect
from extproc.store.registry import Registry
from extproc.store.slot_leases import SlotLeases, block, want
from tests.backend_ops import try_acquire
from tests.redis_server import redis_server_fixture  # noqa: F401 - the redis_server fixture
from tests.slot_lease_holder import POOL


def test_the_lease_is_kept_at_in_use_plus_a_block() -> None:
    assert block(64, 1) == 16 and block(64, 4) == 4 and block(3, 8) == 1 and block(0, 2) == 0
    assert want(64, 0, 0, 1) == 16  # nothing held: ask for a block
    assert want(64, 10, 16, 1) == 26  # 6 spare < half a block: grow
    assert want(64, 10, 30, 1) is None  # 20 spare: keep (renewed on time)
    assert want(64, 0, 40, 1) == 16  # 40 spare > two blocks: give back
    assert want(64, 60, 64, 1) is None or want(64, 60, 64, 1) == 64  # never more than the pool


class Holders:
    """Replicas on one event loop: each its own registry member and lease."""

    def __init__(self, url: str, prefix: str, n: int, ttl: float = 10.0) -> None:
        self.loop = asyncio.new_event_loop()
        self.client = connect(url, socket_timeout_s=5.0)
        self.prefix = prefix
        self.registries = [Registry(f"r{i}", prefix, ttl) for i in range(n)]
        self.leases = [SlotLeases(self.client, r, prefix, ttl_s=ttl, timeout_s=5.0) for r in self.registries]
        for r in self.registries:
            self.run(r.beat(self.client, "", 0.0))
        for ls in self.leases:
            ls.lease("b", POOL, 0)

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def held_in_redis(self) -> int:
        raw = self.run(self.client.hgetall(f"{self.prefix}:slots:b:held"))
        return sum(int(v.split()[0]) for v in raw.values())

    def close(self) -> None:
        self.run(self.client.aclose())
        self.loop.close()


@pytest.fixture
def holders(redis_server: RedisServer, request: pytest.FixtureRequest) -> Iterator[Holders]:
    h = Holders(redis_server.url, f"t{abs(hash(request.node.name))}", 4)
    try:
        yield h
    finally:
        h.close()


def test_concurrent_holders_never_exceed_the_pool(holders: Holders) -> None:
    rng = random.Random(7)

    async def churn(i: int, rounds: int, samples: list[int]) -> None:
        for _ in range(rounds):
            # What each replica may admit against (its local lease) is sampled while the
            # exchanges of the others are in flight.
            task = asyncio.ensure_future(holders.leases[i].exchange("b", rng.randint(0, POOL), 0))
            samples.append(sum(ls.leases["b"].slots for ls in holders.leases))
            await task
            samples.append(sum(ls.leases["b"].slots for ls in holders.leases))

    samples: list[int] = []

    async def all_of_them() -> None:
        await asyncio.gather(*(churn(i, 200, samples) for i in range(4)))

    holders.run(all_of_them())
    assert len(samples) == 1600 and max(samples) <= POOL, max(samples)
    assert max(samples) == POOL  # the pool was used up at times: the bound was tested, not idle
    assert holders.held_in_redis() == sum(ls.leases["b"].slots for ls in holders.leases) <= POOL


def test_a_member_not_in_the_registry_is_fenced_and_gets_nothing(holders: Holders) -> None:
    a = holders.leases[0]
    assert holders.run(a.exchange("b", 5, 0)).slots == 5
    holders.run(holders.client.zrem(f"{holders.prefix}:replicas", holders.registries[0].member))
    assert holders.run(a.exchange("b", 5, 0)).slots == 0
    assert a.fenced == 1 and holders.held_in_redis() == 0  # what it held is dropped with it


def test_an_exact_lease_holds_just_what_is_in_use_and_usage_is_read_when_decided(holders: Holders) -> None:
    a = holders.leases[0]
    holders.run(a.tick({"b": (POOL, 0, 8, 0)}))
    assert a.leases["b"].slots == 8 + block(POOL, a.registry.live)
    reads: list[int] = []

    def draining() -> tuple[int, ...]:  # a draining pool endpoint: 3 requests still in flight
        reads.append(1)
        return (POOL, 0, 3, 0, 1)

    holders.run(a.tick({"b": draining}))
    assert reads == [1] and a.leases["b"].slots == 3 and holders.held_in_redis() == 3
    holders.run(a.tick({"b": draining}))
    assert a.leases["b"].slots == 3  # kept (renewed on time), no block added


def test_a_poke_runs_the_check_at_once_unless_the_last_woken_check_grew_nothing(holders: Holders) -> None:
    a = holders.leases[0]
    a.check_s = 0.5

    async def timed_wait(poke: bool) -> float:
        t0 = time.perf_counter()
        if poke:
            a.poke()
        await a.wait()
        return time.perf_counter() - t0

    others = holders.leases[1]
    holders.run(others.exchange("b", POOL, 0))  # another replica holds the whole pool
    assert holders.run(timed_wait(True)) < a.check_s / 2  # woken at once
    holders.run(a.tick({"b": (POOL, 0, 4, 0)}))  # asks for 4 + a block: gets nothing
    assert a.leases["b"].slots == 0
    quiet = holders.run(timed_wait(True))
    assert quiet >= a.check_s * 0.9, quiet  # that wake grew nothing: the next poke waits for the check
    assert holders.run(timed_wait(True)) < a.check_s / 2 and a.wakes == 2  # and then wakes again


def _lines(p: subprocess.Popen[str]) -> Queue[str]:
    q: Queue[str] = Queue()

    def read() -> None:
        assert p.stdout is not None
        for line in p.stdout:
            q.put(line.strip())

    threading.Thread(target=read, daemon=True).start()
    return q


def _expect(q: Queue[str], prefix: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while True:
        try:
            line = q.get(timeout=max(0.01, deadline - time.monotonic()))
        except Empty:
            raise AssertionError(f"no {prefix!r} line within {timeout}s") from None
        if line.startswith(prefix):
            return line


def _holder(url: str, prefix: str, ttl: float, want_: int) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "tests.slot_lease_holder", url, prefix, str(ttl), str(want_)],
                            cwd=ROOT, stdout=subprocess.PIPE, text=True)


def test_a_killed_replicas_slots_come_back_within_ttl_and_one_renewal(redis_server: RedisServer) -> None:
    ttl = 1.5
    h = Holders(redis_server.url, "kill", 1, ttl)
    p = _holder(redis_server.url, "kill", ttl, POOL)
    try:
        q = _lines(p)
        assert _expect(q, "held", 20) == f"held {POOL}"
        assert h.run(h.leases[0].exchange("b", POOL, 0)).slots == 0  # the other replica holds the whole pool
        p.send_signal(signal.SIGKILL)
        p.wait(5)
        killed = time.monotonic()
        renewal = ttl / 3
        got = 0
        while got < POOL:
            assert time.monotonic() - killed < ttl + renewal + 1.0, "the dead replica's slots did not come back"
            h.run(h.registries[0].beat(h.client, "", time.monotonic()))
            got = h.run(h.leases[0].exchange("b", POOL, 0)).slots
            time.sleep(0.05)
        back = time.monotonic() - killed
        print(f"slots back {back:.2f}s after SIGKILL (ttl {ttl}s)")
        assert ttl - renewal - 0.2 < back, "they came back before the lease could have expired"
        assert h.held_in_redis() == POOL  # all of it, once: nothing double-released
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        h.close()


def test_a_replica_paused_past_its_ttl_is_fenced_and_registers_again(redis_server: RedisServer) -> None:
    ttl = 1.0
    h = Holders(redis_server.url, "pause", 1, ttl)
    p = _holder(redis_server.url, "pause", ttl, 6)
    try:
        q = _lines(p)
        first = _expect(q, "member", 20)
        assert _expect(q, "held", 20) == "held 6"
        p.send_signal(signal.SIGSTOP)
        time.sleep(ttl + 0.5)
        h.run(h.registries[0].beat(h.client, "", 0.0))  # another replica's heartbeat purges the expired member
        assert h.run(h.leases[0].exchange("b", POOL, 0)).slots == POOL  # its slots are free again
        p.send_signal(signal.SIGCONT)
        seen: list[str] = []
        deadline = time.monotonic() + 10
        while not ("fenced" in seen and "held 0" in seen and any(x.startswith("member") for x in seen)):
            assert time.monotonic() < deadline, seen
            with contextlib.suppress(Empty):
                seen.append(q.get(timeout=0.1))
        assert "fenced" in seen  # it may not renew what is no longer its ...
        assert "held 0" in seen and f"held {POOL}" not in seen  # ... nor take back the slots now held by another
        again = next(x for x in seen if x.startswith("member"))
        assert again != first and again.startswith("member holder#")  # registered again, a new epoch
        h.run(h.registries[0].beat(h.client, "", 0.0))
        assert h.held_in_redis() == POOL and h.run(h.leases[0].exchange("b", POOL, 0)).slots == POOL
    finally:
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
            p.kill()
            p.wait()
        h.close()


def test_redis_gone_the_lease_holds_until_its_deadline_then_a_local_share(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    server = RedisServer(tmp_path_factory.mktemp("gone")).start()
    loop = asyncio.new_event_loop()
    client = connect(server.url, socket_timeout_s=0.2)
    t = [100.0]
    try:
        registry = Registry("r", "gone", 10.0)
        leases = SlotLeases(client, registry, "gone", ttl_s=10.0, timeout_s=0.2, clock=lambda: t[0])
        loop.run_until_complete(registry.beat(client, "", t[0]))
        registry.observe(4, t[0])  # four replicas seen in the last ttl
        usage = {"b": (POOL, 0, 8, 0)}  # 8 slots in use: wants 8 + a block
        loop.run_until_complete(leases.tick(usage))
        held = leases.leases["b"].slots
        assert held > POOL // 4
        server.kill()
        t[0] += 5.0  # renewal due, Redis gone: the lease is kept until its deadline
        loop.run_until_complete(leases.tick(usage))
        assert leases.leases["b"].slots == held and leases.errors == 1
        t[0] += 5.5  # past the deadline: floor(pool / the most replicas seen) = 4
        changed = loop.run_until_complete(leases.tick(usage))
        assert leases.leases["b"].slots == POOL // 4 and "b" in changed
    finally:
        server.stop()
        with contextlib.suppress(Exception):
            loop.run_until_complete(client.aclose())
        loop.close()


# -- a replica's Runtime on the shared pools (extproc/runtime/leases.py) ----------------------

def _doc(url: str, backend: dict[str, Any]) -> dict[str, Any]:
    return {"gateway": {"state": url},
            "backends": [{"models": [{"name": "m", "context_window": 8192}], **backend}],
            "tiers": {"t": {"priority": 1, "tpm": 10_000_000, "rpm": 100_000, "max_concurrency": 1000,
                            "max_queue_depth": 256, "max_queue_wait_ms": 10_000}},
            "tenants": [{"name": "a", "tier": "t", "keys": [hash_key("a")]}]}


async def _replicas(doc: dict[str, Any], n: int, tag: str) -> tuple[list[Runtime], list[asyncio.Task[None]]]:
    rts = [Runtime(build_policy(doc), replica_id=f"{tag}{i}") for i in range(n)]
    for rt in rts:
        await rt.first_leases()
    for rt in rts:  # every replica has seen the others: blocks are sized for n
        await rt.state._beat(0.0)  # type: ignore[attr-defined]
    return rts, [asyncio.create_task(rt.run_leases()) for rt in rts]


async def _stop(rts: list[Runtime], tasks: list[asyncio.Task[None]]) -> None:
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for rt in rts:
        await rt.state.aclose()  # type: ignore[attr-defined]
        rt.close()


async def _take(be: BackendState, kv: int, now: float) -> Hold | None:
    """Acquire as admission does: at once, or queued until the grant (None: refused or timed out)."""
    got = try_acquire(be, "t", "a", None, kv, now)
    if isinstance(got, Hold):
        return got
    w = be.queue.enqueue("t", "a", None, kv, now)
    assert not isinstance(w, str), w
    try:
        res = await asyncio.wait_for(asyncio.shield(w.future), 5.0)
    except TimeoutError:
        be.queue.leave(w)
        return None
    return res if isinstance(res, Hold) else None


def test_a_burst_beyond_the_lease_is_admitted_in_one_exchange_not_one_block_per_check(
        redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_URL, raising=False)
    doc = _doc(redis_server.url, {"name": "burst", "address": "127.0.0.1:1", "max_concurrency": 64})

    async def main() -> tuple[float, float, int, int, int]:
        rts, tasks = await _replicas(doc, 2, "burst")
        a = rts[0]
        assert a.slot_leases is not None
        check_s = a.slot_leases.check_s = 1.0  # a check a burst could not wait for unnoticed
        b = block(64, a.slot_leases.registry.live)
        be = a.backends["burst"]
        await asyncio.sleep(0.05)
        held_before = be.pool.total
        t0 = time.perf_counter()
        # the lease, then two blocks more: one block per check would need two checks
        holds = await asyncio.gather(*(_take(be, 0, a.clock()) for _ in range(held_before + 2 * b)))
        took = time.perf_counter() - t0
        assert all(h is not None for h in holds)
        leased = sum(ls.leases["burst"].slots for r in rts if (ls := r.slot_leases) is not None)
        wakes = a.slot_leases.wakes
        for h in holds:
            assert h is not None
            be.release(h, a.clock())
        await _stop(rts, tasks)
        return took, check_s, held_before, leased, wakes

    took, check_s, held_before, leased, wakes = asyncio.run(main())
    print(f"burst beyond a lease of {held_before}: admitted in {took * 1000:.1f} ms (check_s {check_s * 1000:.0f} ms), "
          f"{wakes} wake(s)")
    # One block per check would take two checks (>= check_s); the woken check takes one round trip.
    assert took < check_s / 4, took
    assert wakes >= 1 and leased <= 64


def test_two_replicas_lease_each_pool_endpoint_separately_and_never_overfill_one(
        redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_URL, raising=False)
    caps = {"127.0.0.1:7101": (1000, 4), "127.0.0.1:7102": (2000, 6)}
    doc = _doc(redis_server.url, {"name": "pl", "kv_block_size": 10, "endpoints": [
        {"address": k, "kv_capacity_tokens": kv, "max_concurrency": s} for k, (kv, s) in caps.items()]})
    rng = random.Random(11)
    samples: list[dict[str, tuple[int, int]]] = []
    placed: dict[tuple[int, str], int] = {}
    beyond: list[tuple[str, str, int, int | None]] = []

    async def main() -> tuple[int, int, dict[str, Any]]:
        rts, tasks = await _replicas(doc, 2, "pool")
        stop = asyncio.Event()

        def sample() -> dict[str, tuple[int, int]]:
            out = {}
            for rt in rts:  # each replica's reservations on an endpoint fit its own lease there
                eps, leases = rt.backends["pl"].endpoints, rt.slot_leases
                assert eps is not None and leases is not None
                for key, st in eps.by_key.items():
                    ls = leases.leases.get(f"pl@{key}")
                    if st.in_flight and (ls is None or st.kv_in_use > ls.kv or st.in_flight > ls.slots):
                        beyond.append((rt.replica_id, key, st.kv_in_use, None if ls is None else ls.kv))
            for key in caps:
                sts = [st for rt in rts if (eps := rt.backends["pl"].endpoints) is not None
                       and (st := eps.by_key.get(key)) is not None]
                out[key] = (sum(st.kv_in_use for st in sts), sum(st.in_flight for st in sts))
            return out

        async def sampler() -> None:
            while not stop.is_set():
                samples.append(sample())
                await asyncio.sleep(0.002)

        async def client(i: int, rt: Runtime) -> tuple[int, int]:
            be = rt.backends["pl"]
            ok = refused = 0
            for _ in range(40):
                h = await _take(be, rng.choice([100, 300, 500, 800]), rt.clock())
                if h is None:
                    refused += 1
                    continue
                ok += 1
                assert h.endpoint is not None
                placed[(i, h.endpoint)] = placed.get((i, h.endpoint), 0) + 1
                samples.append(sample())
                await asyncio.sleep(rng.uniform(0.0, 0.02))
                be.release(h, rt.clock())
            return ok, refused

        s = asyncio.create_task(sampler())
        res = await asyncio.gather(*(client(i, rt) for i, rt in enumerate(rts) for _ in range(8)))
        stop.set()
        await s
        in_redis = {}
        for key in caps:
            raw = await rts[0].state.client.hgetall(f"sluice:slots:pl@{key}:held")  # type: ignore[attr-defined]
            in_redis[key] = [tuple(int(x) for x in v.split()) for v in raw.values()]
        snap = rts[0].status()["backends"]["pl"]["endpoints"]
        await _stop(rts, tasks)
        return sum(r[0] for r in res), sum(r[1] for r in res), {"redis": in_redis, "snap": snap}

    ok, refused, seen = asyncio.run(main())
    peak = {k: (max(s[k][0] for s in samples), max(s[k][1] for s in samples)) for k in caps}
    print(f"{ok} admitted, {refused} refused; {len(samples)} samples; peak (kv, slots) per endpoint {peak}")
    assert not beyond, beyond[:5]
    for key, (kv_cap, slots) in caps.items():
        assert peak[key][0] <= kv_cap and peak[key][1] <= slots, (key, peak[key])
        assert sum(s for s, _ in seen["redis"][key]) <= slots and sum(k for _, k in seen["redis"][key]) <= kv_cap
    # the bound was exercised: both endpoints filled past half, each replica placed on both
    assert all(peak[k][0] > caps[k][0] // 2 for k in caps), peak
    assert {(i, k) for i in (0, 1) for k in caps} <= set(placed), placed
    assert ok > refused
    assert all(e["lease"] is not None for e in seen["snap"])
