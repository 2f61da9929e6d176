"""A pool's placement through its index equals the scan it replaced, over random histories.

Two ``EndpointSet``s are built from the same policy and fed the same history: holds taken
and released, moves, scrape samples, breaker outcomes, trips and overrides, lease changes,
reloads, time passing. One places as Sluice does (``extproc.backends.endpoints``, through
its index); the other by the algorithm the index replaced, kept here: a candidate built
for every endpoint on every request, ``pick`` and ``second_choice`` over all of them. Every
answer must be the same: the pick, its score, the second choice, affinity, fits, owed
endpoints, the candidates, the largest cache.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import replace
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.backends.endpoints import EndpointSet, EndpointState
from extproc.policy.breaker_outcome import Outcome
from extproc.policy.owed import owed_endpoints
from extproc.policy.placement import Candidate, Placement, largest_capacity, pick, second_choice
from extproc.policy.schema import Backend, build_policy, hash_key

PRIORITIES = {"hi": 3, "mid": 2, "lo": 1}


def reference_candidate(st: EndpointState, now: float, kv: int = 0) -> Candidate:
    """``EndpointState.candidate`` as it was before the index."""
    waiting = 0.0
    w = st.wm.state(now) if st.spec.metrics_url else None
    if w is not None and w.smoothed_waiting is not None:
        waiting = w.smoothed_waiting
    usable = st.usable(now)
    kv_in_use, in_flight = st.kv_in_use, st.in_flight
    if st.leased_slots is not None:
        usable = (
            usable
            and st.in_flight < st.leased_slots
            and (st.spec.kv_capacity_tokens is None or st.kv_in_use + kv <= st.leased_kv)
        )
        kv_in_use += st.others_kv
        in_flight += st.others_slots
    return Candidate(
        key=st.key,
        usable=usable,
        kv_in_use=kv_in_use,
        kv_capacity=st.spec.kv_capacity_tokens,
        kv_scale=st.scale(now) * st.overcommit,
        in_flight=in_flight,
        max_concurrency=st.spec.max_concurrency,
        waiting=waiting,
    )


def reference_candidates(eps: EndpointSet, now: float, kv: int = 0) -> list[Candidate]:
    return [reference_candidate(s, now, kv) for s in eps.by_key.values()]


def reference_place(
    eps: EndpointSet, kv: int, now: float, prefix: tuple[int, ...], exclude: Collection[str]
) -> Placement | None:
    """``EndpointSet.place`` as it was before the index: every endpoint scored, twice."""
    aff = eps.affinity if prefix else None
    known = aff.lookup(prefix, now) if aff is not None else None
    preferred = known[0] if known is not None else None
    candidates = reference_candidates(eps, now, kv)
    got = pick(candidates, kv, preferred, eps.placement.affinity_min_headroom, exclude)
    if got is not None:
        s = eps.by_key[got.key]
        s.kv_in_use += kv
        s.in_flight += 1
        second = second_choice(candidates, kv, got.key, exclude) if len(candidates) > 1 else None
        if second is not None:
            got = replace(got, second=second)
        if aff is not None:
            aff.record(prefix, got.key, now)
            result = "miss" if preferred is None else "hit" if got.preferred else "spill"
            got = replace(got, affinity=result)
    return got


def reference_owed(
    eps: EndpointSet, heads: dict[str, int], tier: str, now: float, behind_head: bool
) -> tuple[str, ...]:
    if not heads:
        return ()
    return owed_endpoints(reference_candidates(eps, now), heads, PRIORITIES, tier, behind_head)


def reference_largest(eps: EndpointSet) -> int | None:
    return largest_capacity(
        [
            Candidate(k, True, 0, s.spec.kv_capacity_tokens, 1.0, 0, 1)
            for k, s in eps.by_key.items()
            if not s.draining
        ]
    )


ADDRESSES = [f"127.0.0.1:{7001 + i}" for i in range(6)]


def backend(endpoints: list[dict[str, Any]], affinity: bool) -> Backend:
    return build_policy(
        {
            "backends": [
                {
                    "name": "pool",
                    "max_concurrency": 4,
                    "kv_block_size": 16,
                    "endpoints": endpoints,
                    "models": [{"name": "m", "context_window": 8192}],
                    "watermark": {"recover_per_s": 0.2, "stale_after_s": 5.0},
                    "breaker": {
                        "consecutive_failures": 3,
                        "cooldown_s": 2.0,
                        "max_cooldown_s": 8.0,
                        "ramp_step_s": 1.0,
                        "latency_slo_s": 0.5,
                        "min_requests": 4,
                    },
                    "placement": {"prefix_affinity": affinity, "affinity_min_headroom": 0.3},
                }
            ],
            "tiers": {t: {"priority": p, "tpm": 10**6, "rpm": 1000} for t, p in PRIORITIES.items()},
            "tenants": [{"name": "a", "tier": "lo", "keys": [hash_key("a")]}],
        }
    ).backends[0]


@st.composite
def endpoint(draw: st.DrawFn, address: str) -> dict[str, Any]:
    e: dict[str, Any] = {"address": address, "max_concurrency": draw(st.sampled_from([2, 4]))}
    cap = draw(st.sampled_from([1000, 1000, 4000, None]))
    if cap is not None:
        e["kv_capacity_tokens"] = cap
    if draw(st.booleans()):
        e["metrics_url"] = f"http://{address}/metrics"
    return e


@st.composite
def pools(draw: st.DrawFn) -> list[dict[str, Any]]:
    n = draw(st.integers(1, len(ADDRESSES)))
    eps = [draw(endpoint(a)) for a in ADDRESSES[:n]]
    if any("kv_capacity_tokens" not in e for e in eps) and draw(st.booleans()):
        for e in eps:  # mostly a pool either bounds KV everywhere or nowhere
            e.setdefault("kv_capacity_tokens", 2000)
    return eps


OPS = st.sampled_from(
    ["place"] * 6
    + ["release"] * 3
    + ["time"] * 3
    + ["sample"] * 3
    + ["breaker", "breaker", "manual", "lease", "move", "fits", "owed", "candidates", "reload"]
)
FOOTPRINT = st.sampled_from([16, 160, 480, 800, 1600, 3200, 5000])


@settings(max_examples=150, deadline=None)
@given(pools(), st.booleans(), st.data())
def test_the_index_places_as_the_scan_did(
    endpoints: list[dict[str, Any]], affinity: bool, data: st.DataObject
) -> None:
    spec = backend(endpoints, affinity)
    new, old = EndpointSet.create(spec, 0.0), EndpointSet.create(spec, 0.0)
    both = (new, old)
    now = 0.0
    held: list[tuple[str, int]] = []
    for _ in range(data.draw(st.integers(10, 70))):
        assert list(new.by_key) == list(old.by_key)  # a drained endpoint is forgotten in both
        keys = list(new.by_key)
        op = data.draw(OPS)
        key = data.draw(st.sampled_from(keys))
        if op == "place":
            kv = data.draw(FOOTPRINT)
            prefix = data.draw(st.sampled_from([(), (1,), (1, 2), (3,)]))
            exclude = set(data.draw(st.lists(st.sampled_from(keys), max_size=2)))
            got = new.place(kv, now, prefix, exclude)
            assert got == reference_place(old, kv, now, prefix, exclude)
            if got is not None:
                held.append((got.key, kv))
        elif op == "release" and held:
            k, kv = held.pop(data.draw(st.integers(0, len(held) - 1)))
            for eps in both:
                eps.release(k, kv)
        elif op == "move" and held:
            i = data.draw(st.integers(0, len(held) - 1))
            k, kv = held[i]
            to = data.draw(st.sampled_from(keys))
            moved = [eps.move(k, to, kv, repick=data.draw(st.booleans())) for eps in both]
            assert moved[0] == moved[1]
            if moved[0]:
                held[i] = (to, kv)
        elif op == "time":
            now += data.draw(st.sampled_from([0.0, 0.001, 0.4, 1.0, 2.0, 2.5, 5.0, 6.0, 30.0]))
        elif op == "sample":
            usage = data.draw(st.sampled_from([None, 0.0, 0.5, 0.72, 0.8, 0.9, 1.0]))
            waiting = data.draw(st.sampled_from([None, 0.0, 3.0, 12.0]))
            for eps in both:
                if key in eps.by_key:
                    eps.by_key[key].wm.observe(usage, waiting, now)
        elif op == "breaker":
            outcome = data.draw(
                st.sampled_from([Outcome.FAILURE, Outcome.SUCCESS, Outcome.CANCELLED])
            )
            latency = data.draw(st.sampled_from([None, 0.1, 1.0]))
            times = data.draw(st.sampled_from([1, 3]))
            trip = data.draw(st.booleans()) and data.draw(st.booleans())
            answers = []
            for eps in both:
                if key in eps.by_key:
                    if trip:
                        eps.by_key[key].breaker.trip(now)
                    answers.append([eps.record(key, outcome, latency, now) for _ in range(times)])
            assert answers == [answers[0]] * len(answers)
        elif op == "manual":
            state = data.draw(st.sampled_from([None, "open", "closed"]))
            until = data.draw(st.sampled_from([None, 1.5, 4.0]))
            for eps in both:
                if key in eps.by_key:
                    eps.by_key[key].breaker.set_manual(
                        state, "test", None if until is None else now + until, now
                    )
        elif op == "lease":
            lease = data.draw(
                st.sampled_from(
                    [None, (0, 0, 0, 0), (1, 800, 1, 500), (4, 4000, 0, 0), (2, 100, 3, 3000)]
                )
            )
            for eps in both:
                if key in eps.by_key:
                    s = eps.by_key[key]
                    if lease is None:
                        s.leased_slots, s.leased_kv, s.others_slots, s.others_kv = None, 0, 0, 0
                    else:
                        s.leased_slots, s.leased_kv, s.others_slots, s.others_kv = lease
        elif op == "fits":
            kv = data.draw(FOOTPRINT)
            exclude = set(data.draw(st.lists(st.sampled_from(keys), max_size=2)))
            want = pick(reference_candidates(old, now, kv), kv, exclude=exclude) is not None
            assert new.fits_somewhere(kv, now, exclude) == want
        elif op == "owed":
            heads = data.draw(
                st.dictionaries(st.sampled_from(list(PRIORITIES)), FOOTPRINT, max_size=3)
            )
            tier = data.draw(st.sampled_from(list(PRIORITIES)))
            behind = data.draw(st.booleans())
            assert new.owed(heads, PRIORITIES, tier, now, behind) == reference_owed(
                old, heads, tier, now, behind
            )
        elif op == "candidates":
            kv = data.draw(FOOTPRINT)
            assert new.candidates(now, kv) == reference_candidates(old, now, kv)
        elif op == "reload":
            # An endpoint leaves (it drains), or every endpoint comes back with a changed budget.
            changed = [dict(e) for e in endpoints]
            if data.draw(st.booleans()) and len(changed) > 1:
                changed = [e for e in changed if e["address"] != key]
            else:
                for e in changed:
                    if e["address"] == key and "kv_capacity_tokens" in e:
                        e["kv_capacity_tokens"] = data.draw(st.sampled_from([500, 1000, 6000]))
            for eps in both:
                eps.sync(backend(changed, affinity), now)
            held = [(k, kv) for k, kv in held if k in new.by_key]
        assert new.largest_capacity() == reference_largest(old)
    # Whatever happened, both hold the same, and the index still agrees at the end.
    assert [(s.kv_in_use, s.in_flight) for s in new.by_key.values()] == [
        (s.kv_in_use, s.in_flight) for s in old.by_key.values()
    ]
    for kv in (16, 800, 5000):
        assert new.candidates(now + 60.0, kv) == reference_candidates(old, now + 60.0, kv)


def twins(endpoints: list[dict[str, Any]]) -> tuple[EndpointSet, EndpointSet]:
    spec = backend(endpoints, False)
    return EndpointSet.create(spec, 0.0), EndpointSet.create(spec, 0.0)


def placed(new: EndpointSet, old: EndpointSet, kv: int, now: float) -> str | None:
    got = new.place(kv, now)
    assert got == reference_place(old, kv, now, (), ())
    return None if got is None else got.key


TWO_PLAIN = [
    {"address": ADDRESSES[0], "kv_capacity_tokens": 1000},
    {"address": ADDRESSES[1], "kv_capacity_tokens": 4000},
]


def test_time_alone_ends_a_cooldown_and_a_ramp_step_with_a_trip() -> None:
    new, old = twins(TWO_PLAIN)
    big = ADDRESSES[1]  # the larger one: the pick while it is usable
    for eps in (new, old):
        eps.by_key[big].breaker.trip(0.0)
    assert placed(new, old, 16, 0.0) == ADDRESSES[0]
    # The cooldown (2 s) ends with nothing recorded: half open, a probe may go there.
    assert placed(new, old, 16, 2.0) == big
    for eps in (new, old):
        eps.by_key[big].breaker.record(Outcome.SUCCESS, 0.1, 2.0)  # the probe: the ramp starts
        eps.by_key[big].breaker.record(Outcome.SUCCESS, 1.0, 2.1)  # slow (SLO 0.5 s)
    assert placed(new, old, 16, 2.5) == big
    # The step ends at 3.0 with half its outcomes slow: open again, by time alone.
    assert placed(new, old, 16, 3.1) == ADDRESSES[0]


def test_time_alone_makes_metrics_stale_and_ramps_a_scale_up() -> None:
    new, old = twins(
        [
            {"address": ADDRESSES[0], "kv_capacity_tokens": 1000},
            {
                "address": ADDRESSES[1],
                "kv_capacity_tokens": 1000,
                "metrics_url": f"http://{ADDRESSES[1]}/metrics",
            },
        ]
    )
    scraped = ADDRESSES[1]
    for eps in (new, old):
        eps.by_key[ADDRESSES[0]].kv_in_use = 300  # the plain one is fuller
        eps.by_key[scraped].kv_in_use = 200
        eps.by_key[scraped].wm.observe(0.0, 0.0, 0.0)
    assert placed(new, old, 16, 0.1) == scraped
    for eps in (new, old):
        for i in range(4):  # full: the scale drops to the floor
            eps.by_key[scraped].wm.observe(1.0, 0.0, 0.9 + i / 100)
        eps.by_key[scraped].wm.observe(0.0, 0.0, 1.01)  # and then ramps up, 0.2 a second
    assert placed(new, old, 16, 1.02) == ADDRESSES[0]  # 216 of 600 beats 316 of 1000 less
    assert placed(new, old, 16, 2.5) == scraped  # the budget has grown back meanwhile
    assert placed(new, old, 16, 6.5) == ADDRESSES[0]  # no sample for 5 s: stale, ejected
