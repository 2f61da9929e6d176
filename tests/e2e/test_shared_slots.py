"""Two replicas (each its own Envoy and extproc) lease one backend's slots from Redis.

The backend ``sim`` has 4 slots in the policy; the two replicas together never hold
more than 4 requests on it (sampled every 10 ms from both ``/debug/state``), and a
replica killed with SIGKILL while holding slots gives them back within the lease ttl
(10 s) plus one renewal: the survivor can then take all 4.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from bench.procs import get_json
from bench.redis_server import RedisServer
from tests.e2e.harness import Stack, eventually, running
from tests.e2e.test_datapath import auth, chat_body, post

pytestmark = pytest.mark.e2e

POOL = 4
TTL_S = 10.0  # extproc/store/slot_leases.py's default


def _stack(tmp: pytest.TempPathFactory, name: str, url: str) -> Stack:
    s = Stack(tmp.mktemp(name), gateway={"state": url})
    assert s.policy_doc is not None
    s.policy_doc["backends"][0]["max_concurrency"] = POOL
    return s


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, Stack]]:
    redis = RedisServer(tmp_path_factory.mktemp("redis")).start()
    try:
        a, b = _stack(tmp_path_factory, "a", redis.url), _stack(tmp_path_factory, "b", redis.url)
        with running(a), running(b):
            yield a, b
    finally:
        redis.stop()


def _in_use(s: Stack) -> int:
    return int(s.state()["backends"]["sim"]["slots"]["in_use"])


def test_two_replicas_never_hold_more_than_the_pool(pair: tuple[Stack, Stack]) -> None:
    a, b = pair
    headers = {**auth("premium"), "x-sim-tokens": "40", "x-sim-tps": "40"}  # ~1 s per request
    samples: list[int] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            samples.append(_in_use(a) + _in_use(b))
            time.sleep(0.01)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        with ThreadPoolExecutor(12) as pool:
            jobs = []
            for _ in range(6):
                for s in (a, b):
                    jobs.append(pool.submit(post, s, chat_body(max_tokens=40), headers))
                    time.sleep(0.03)  # a lease grows at its replica's next check (50 ms)
            codes = [j.result().status_code for j in jobs]
    finally:
        stop.set()
        sampler.join()
    print(f"12 requests: {codes.count(200)} admitted, {codes.count(429)} refused; "
          f"{len(samples)} samples, most in use at once {max(samples)}")
    assert max(samples) <= POOL, max(samples)
    assert codes.count(200) >= 2 and codes.count(429) >= 1 and set(codes) <= {200, 429}, codes
    assert max(samples) >= 2  # the replicas did hold slots at once (the bound was exercised)
    for s in (a, b):
        st = s.wait_settled(5)
        assert st["in_flight"] == 0 and st["ledger"]["balanced"], st
        pools = st["store"]["slot_leases"]["pools"]["sim"]
        assert pools["pool"] == POOL and pools["leased"] + pools["others"] <= POOL, pools


def test_a_killed_replicas_slots_return_to_the_survivor(pair: tuple[Stack, Stack]) -> None:
    a, b = pair
    slow = {**auth("premium"), "x-sim-tokens": "400", "x-sim-tps": "20"}  # 20 s: still running when killed
    with ThreadPoolExecutor(POOL) as pool:
        held = [pool.submit(post, b, chat_body(max_tokens=400), slow) for _ in range(3)]
        eventually(lambda: _in_use(b) >= 2, 10, "replica b holds slots")
        killed_with = _in_use(b)
        b.procs["extproc"].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        b.procs["extproc"].reap()

        def survivor_leases_all() -> bool:
            pools = get_json(f"{a.admin_url}/debug/state")["store"]["slot_leases"]["pools"]["sim"]
            return pools["others"] == 0

        eventually(survivor_leases_all, TTL_S + TTL_S / 3 + 5, "the dead replica's lease expired")
        back = time.monotonic() - killed
        for f in held:
            with contextlib.suppress(httpx.HTTPError):
                f.result(timeout=30)  # cut off with the replica (Envoy fails closed)
    print(f"replica b killed holding {killed_with} slots; gone from the survivor's view {back:.1f} s later")
    assert back <= TTL_S + TTL_S / 3 + 2, back
    # the survivor can now take the whole pool
    headers = {**auth("premium"), "x-sim-tokens": "40", "x-sim-tps": "40"}
    with ThreadPoolExecutor(POOL) as pool:
        jobs = []
        for _ in range(POOL):
            jobs.append(pool.submit(post, a, chat_body(max_tokens=40), headers))
            time.sleep(0.15)  # each lease check (50 ms) grows the lease by a block
        codes = [j.result().status_code for j in jobs]
    assert codes == [200] * POOL, codes
    b.start_extproc()  # the module's other tests and the teardown expect it back
