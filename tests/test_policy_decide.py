"""decide(view, request, now): the slot-and-KV decision, as a table and as properties.

The view is a frozen BackendSnapshot; the last tests check that the live BackendState
is read the same way (it implements the same BackendView).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.backends.hold import Hold
from extproc.backends.state import BackendState
from extproc.policy.admit import SlotRequest, can_admit, decide
from extproc.policy.context import completion_budget
from extproc.policy.decision import Admit, Queue, Reject
from extproc.policy.kv import footprint, kv_budget, kv_fits, kv_owed_above, pressure_scale
from extproc.policy.reasons import Cause, Reason
from extproc.policy.schema import build_policy, hash_key
from extproc.policy.slots import round_half_up
from extproc.policy.view import BackendSnapshot

PRIO = {"hi": 10, "mid": 5, "lo": 1}
BASE = BackendSnapshot(kv_capacity=1000, priorities=PRIO, slots_total=4)


def req(tier: str = "lo", kv: int = 100, *, tenant: str = "t", cap: int | None = None,
        may_queue: bool = True) -> SlotRequest:
    return SlotRequest(tier, tenant, cap, kv, may_queue)


def kind(d: Admit | Queue | Reject) -> tuple[str, str]:
    if isinstance(d, Admit):
        return ("admit", "")
    if isinstance(d, Queue):
        return ("queue", str(d.cause))
    return ("reject", str(d.reason))


# -- the table ---------------------------------------------------------------------------
CASES: list[tuple[str, BackendSnapshot, SlotRequest, tuple[str, str]]] = [
    ("idle, fits", BASE, req(), ("admit", "")),
    ("fills the cache exactly", replace(BASE, kv_in_use=900), req(kv=100), ("admit", "")),
    ("one token over the budget waits", replace(BASE, kv_in_use=901), req(kv=100), ("queue", "kv_exhausted")),
    ("no queue: refused", replace(BASE, kv_in_use=901), req(kv=100, may_queue=False), ("reject", "slots")),
    ("never fits any cache", BASE, req(kv=1001), ("reject", "too_large_for_backend")),
    ("a pool: the largest endpoint decides", replace(BASE, largest_capacity=500), req(kv=600),
     ("reject", "too_large_for_backend")),
    ("overcommit admits past the cache", replace(BASE, kv_in_use=1000, kv_overcommit=1.5), req(kv=500),
     ("admit", "")),
    ("the watermark shrinks the budget", replace(BASE, kv_in_use=500, watermark_scale=0.6), req(kv=200),
     ("queue", "kv_exhausted")),
    ("a lone request fits the scaled budget", replace(BASE, watermark_scale=0.6), req(kv=1000), ("admit", "")),
    ("a lone request is held to the lease", replace(BASE, kv_lease=400), req(kv=500), ("queue", "kv_exhausted")),
    ("the lease caps the budget", replace(BASE, kv_lease=400, kv_in_use=300), req(kv=200),
     ("queue", "kv_exhausted")),
    ("no KV capacity: slots alone", replace(BASE, kv_capacity=None), req(kv=10**9), ("admit", "")),
    ("slots full", replace(BASE, slots_in_use=4), req(), ("queue", "slots_exhausted")),
    ("the latency limit scales slots", replace(BASE, slots_in_use=2, latency_scale=0.5), req(),
     ("queue", "slots_exhausted")),
    ("the tenant's cap refuses at once", replace(BASE, tenant_held={"t": 2}), req(cap=2), ("reject", "slots")),
    ("under the tenant's cap", replace(BASE, tenant_held={"t": 1}), req(cap=2), ("admit", "")),
    ("FIFO within a tier", replace(BASE, waiters=(("lo", 10),)), req(), ("queue", "slots_exhausted")),
    ("another tier's waiter that fits is not owed", replace(BASE, waiters=(("hi", 10),)), req(), ("admit", "")),
    ("owed to a more important waiter", replace(BASE, kv_in_use=800, waiters=(("hi", 300),)), req(kv=100),
     ("queue", "kv_exhausted")),
    ("owed only upward", replace(BASE, kv_in_use=800, waiters=(("lo", 300),)), req("hi", kv=100),
     ("admit", "")),
    ("the most important waiter is owed", replace(BASE, kv_in_use=600, waiters=(("mid", 500), ("hi", 300))),
     req(kv=100), ("queue", "kv_exhausted")),
]


@pytest.mark.parametrize(("view", "request_", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_decide_table(view: BackendSnapshot, request_: SlotRequest, expected: tuple[str, str]) -> None:
    assert kind(decide(view, request_, 0.0)) == expected


def test_a_refusal_carries_what_the_client_is_told() -> None:
    big = decide(BASE, req(kv=1008), 0.0)
    assert big == Reject(
        Reason.TOO_LARGE_FOR_BACKEND,
        "The request may need 1008 tokens of KV cache; backend 'b' has 1000. Lower max_tokens or shorten the prompt.",
        code="context_length_exceeded",
        param="max_tokens",
    )
    capped = decide(replace(BASE, tenant_held={"t": 3}), req(cap=3), 0.0)
    assert isinstance(capped, Reject) and capped.retry_after_s == 1 and capped.code == "rate_limit_exceeded"
    assert capped.message == "Too many concurrent requests for this key (limit 3)."
    assert capped.cause == "slots_tenant_cap"
    wait = decide(replace(BASE, kv_in_use=950), req(kv=100), 0.0)
    assert wait == Queue(Cause.KV_EXHAUSTED, "KV budget: 950 + 100 > 1000")


def test_footprint_rounds_up_to_whole_blocks() -> None:
    assert [footprint(t, 16) for t in (0, 1, 16, 17, 32, 33)] == [0, 16, 16, 32, 32, 48]


def test_pressure_scale_table() -> None:
    assert pressure_scale(BASE, "lo", 0.0) == 1.0
    assert pressure_scale(replace(BASE, watermark_scale=0.8), "lo", 0.0) == 0.8
    waiting_hi = replace(BASE, waiters=(("hi", 10),))
    assert pressure_scale(waiting_hi, "lo", 0.0) == BASE.floor  # a more important tier waits
    assert pressure_scale(waiting_hi, "hi", 0.0) == 1.0  # not degraded by its own queue
    risk = replace(BASE, at_risk=frozenset({"mid"}))
    assert pressure_scale(risk, "lo", 0.0) == BASE.floor  # a more important tier misses its SLO
    assert pressure_scale(risk, "mid", 0.0) == 1.0 and pressure_scale(risk, "hi", 0.0) == 1.0
    assert pressure_scale(replace(risk, watermark_scale=0.3), "lo", 0.0) == 0.3  # never raised


def test_can_admit_asks_for_the_heads_kv_its_endpoint_and_a_slot() -> None:
    assert can_admit(BASE, "lo", None, 0.0)
    assert can_admit(BASE, "lo", 1000, 0.0)
    assert not can_admit(replace(BASE, kv_in_use=950), "lo", 100, 0.0)
    assert not can_admit(replace(BASE, endpoint_room=50), "lo", 100, 0.0)
    assert not can_admit(replace(BASE, slots_in_use=4), "lo", None, 0.0)
    assert can_admit(replace(BASE, tenant_held={"\x00probe": 99}), "lo", None, 0.0)  # the probe has no cap


# -- the context window ------------------------------------------------------------------
def test_completion_budget_table() -> None:
    assert completion_budget(100, 50, 1, 4096, 256) == 50
    assert completion_budget(100, None, 1, 4096, 256) == 256
    assert completion_budget(4000, None, 1, 4096, 256) == 96  # what fits; never refused for it
    assert completion_budget(10**6, 10, 0, 4096, 256) == 0  # embeddings: nothing generated
    over = completion_budget(4000, 100, 1, 4096, 256)
    assert isinstance(over, Reject) and over.reason == Reason.CONTEXT_LENGTH and over.param == "messages"
    assert "you requested 4100 tokens (4000 in the messages, 100 in the completion)" in over.message
    inexact = completion_budget(4097, None, 1, 4096, 256, exact=False, param="input")
    assert isinstance(inexact, Reject) and inexact.param == "input" and inexact.retry_after_s is None
    assert "resulted in more than 4096 tokens" in inexact.message
    assert isinstance(completion_budget(4096, None, 1, 4096, 256), Reject)


# -- properties ----------------------------------------------------------------------------
tiers = st.sampled_from(sorted(PRIO))
scales = st.floats(0.0, 1.0)


@st.composite
def views(draw: Any, max_waiters: int = 3) -> BackendSnapshot:
    cap = draw(st.one_of(st.none(), st.integers(1, 2000)))
    return BackendSnapshot(
        kv_in_use=draw(st.integers(0, 2500)), kv_capacity=cap, kv_overcommit=draw(st.sampled_from([1.0, 1.25, 2.0])),
        kv_lease=draw(st.one_of(st.none(), st.integers(0, 2000))), priorities=PRIO,
        watermark_scale=draw(scales), latency_scale=draw(scales),
        waiters=tuple(draw(st.lists(st.tuples(tiers, st.integers(1, 2000)), max_size=max_waiters))),
        slots_total=draw(st.integers(0, 6)), slots_in_use=draw(st.integers(0, 6)),
        tenant_held={"t": draw(st.integers(0, 4))})


requests = st.builds(SlotRequest, tiers, st.just("t"), st.one_of(st.none(), st.integers(1, 4)),
                     st.integers(1, 2000), st.booleans())


def lone_fits(v: BackendSnapshot, kv: int) -> bool:
    assert v.kv_capacity is not None
    limit = v.kv_capacity if v.kv_lease is None else min(v.kv_capacity, v.kv_lease)
    return v.kv_in_use == 0 and kv <= limit


def owed(v: BackendSnapshot, tier: str) -> int:
    """The owed-KV rule, restated: the most important waiter above ``tier`` that does not fit."""
    budget = kv_budget(v, 0.0)
    above = [(PRIO[t], kv) for t, kv in v.waiters if PRIO[t] > PRIO[tier] and v.kv_in_use + kv > budget]
    return max(above, key=lambda p: p[0])[1] if above else 0


@settings(max_examples=400, deadline=None)
@given(views(), requests)
def test_never_admits_beyond_the_kv_budget_the_slots_or_what_is_owed(v: BackendSnapshot, r: SlotRequest) -> None:
    d = decide(v, r, 0.0)
    if not isinstance(d, Admit):
        return
    assert r.tier not in {t for t, _ in v.waiters}  # FIFO within a tier
    if v.kv_capacity is not None:
        assert r.kv <= v.kv_capacity
        assert v.kv_in_use + r.kv + owed(v, r.tier) <= kv_budget(v, 0.0) or lone_fits(v, r.kv)
    assert v.slots_in_use < round_half_up(v.slots_total * v.slot_scale(0.0))
    assert r.tenant_cap is None or v.tenant_held["t"] < r.tenant_cap


@settings(max_examples=300, deadline=None)
@given(views(max_waiters=0), requests, scales, scales)
def test_monotone_in_scale_and_in_what_is_free(v: BackendSnapshot, r: SlotRequest, up_wm: float,
                                               up_lat: float) -> None:
    """More room (a higher watermark or latency scale, less KV in use) never turns an admit into a refusal."""
    if not isinstance(decide(v, r, 0.0), Admit):
        return
    roomier = replace(v, watermark_scale=v.watermark_scale + (1 - v.watermark_scale) * up_wm,
                      latency_scale=v.latency_scale + (1 - v.latency_scale) * up_lat,
                      kv_in_use=int(v.kv_in_use * up_wm))
    assert isinstance(decide(roomier, r, 0.0), Admit)


@settings(max_examples=300, deadline=None)
@given(views(), requests, scales)
def test_monotone_in_scale_with_one_waiter_above(v: BackendSnapshot, r: SlotRequest, up: float) -> None:
    # With two or more waiters above, a higher scale can make the most important one fit
    # and a larger one become the owed room: decide is monotone only up to one.
    if sum(1 for t, _ in v.waiters if PRIO[t] > PRIO[r.tier]) > 1 or not isinstance(decide(v, r, 0.0), Admit):
        return
    assert isinstance(decide(replace(v, watermark_scale=v.watermark_scale + (1 - v.watermark_scale) * up), r, 0.0),
                      Admit)


@settings(max_examples=300, deadline=None)
@given(views(), tiers, scales)
def test_pressure_scale_is_at_most_the_watermark_and_monotone(v: BackendSnapshot, tier: str, up: float) -> None:
    p = pressure_scale(v, tier, 0.0)
    assert p <= v.watermark_scale
    assert p in (v.watermark_scale, min(v.watermark_scale, v.floor))
    assert pressure_scale(replace(v, watermark_scale=v.watermark_scale + (1 - v.watermark_scale) * up), tier, 0.0) >= p


@settings(max_examples=200, deadline=None)
@given(views(), st.integers(1, 2000), tiers)
def test_kv_fits_is_the_budget_rule(v: BackendSnapshot, kv: int, tier: str) -> None:
    fits = kv_fits(v, kv, 0.0, tier)
    if v.kv_capacity is None:
        assert fits and kv_owed_above(v, tier, 0.0) == 0
        return
    assert kv_owed_above(v, tier, 0.0) == owed(v, tier)
    assert fits == (v.kv_in_use + kv + owed(v, tier) <= kv_budget(v, 0.0) or lone_fits(v, kv))


# -- the live BackendState reads the same --------------------------------------------------
def live() -> BackendState:
    p = build_policy({
        "backends": [{"name": "b", "address": "127.0.0.1:1", "max_concurrency": 4, "kv_capacity_tokens": 1000,
                      "kv_block_size": 10, "models": [{"name": "m", "context_window": 4096}]}],
        "tiers": {t: {"priority": pr, "tpm": 1000, "rpm": 10, "max_queue_depth": 3, "max_queue_wait_ms": 1000}
                  for t, pr in PRIO.items()},
        "tenants": [{"name": "t", "tier": "lo", "keys": [hash_key("t")]}],
    })
    be = BackendState.create(p.backends[0], p, 0.0)
    be.has_metrics = False
    return be


def snapshot_of(be: BackendState) -> BackendSnapshot:
    use = be.pool.in_use()
    return BackendSnapshot(name=be.name, kv_in_use=be.kv_in_use, kv_capacity=be.kv_capacity,
                           kv_overcommit=be.kv_overcommit, kv_lease=be.kv_lease, kv_block_size=be.kv_block_size,
                           floor=be.floor, watermark_scale=be.scale(0.0), latency_scale=be.slot_scale(0.0),
                           priorities=dict(be.priorities), waiters=tuple(be.waiting()),
                           slots_total=be.pool.total, slots_in_use=use.total, tenant_held=dict(use.by_tenant))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(requests, st.booleans()), max_size=12))
def test_the_live_state_decides_as_its_snapshot(seq: list[tuple[SlotRequest, bool]]) -> None:
    be = live()
    holds: list[Hold] = []
    for r, release in seq:
        expected = kind(decide(snapshot_of(be), r, 0.0))
        assert kind(decide(be, r, 0.0)) == expected
        got = be.acquire(r, 0.0)
        assert (kind(got) if not isinstance(got, Hold) else ("admit", "")) == expected
        if isinstance(got, Hold):
            holds.append(got)
        if release and holds:
            be.release(holds.pop(0), 0.0)
    for h in holds:
        be.release(h, 0.0)
    assert be.kv_in_use == 0 and be.pool.in_use().total == 0


def test_tick_hands_returned_capacity_to_waiters_and_status_reports_it() -> None:
    import asyncio

    async def run() -> None:
        be = live()
        first = be.acquire(req(kv=1000), 0.0)
        assert isinstance(first, Hold)
        w = be.queue.enqueue("lo", "t", None, 500, 0.0)
        assert not isinstance(w, str)
        assert be.status(0.0)["queue"]["depth"]["lo"] == 1
        be.give_back(first)  # capacity returns without a release's own pump (e.g. a lease grew)
        assert be.queue.tick(0.0) == 1 and w.future.done()
        st = be.status(0.0)
        assert st["queue"]["depth"]["lo"] == 0 and st["kv"]["reserved_tokens"] == 500
        assert st["slots"]["in_use"] == 1
        got = w.future.result()
        assert isinstance(got, Hold)
        be.release(got, 0.0)
        assert be.queue.tick(0.0) == 0

    asyncio.run(run())
