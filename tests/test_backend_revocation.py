"""BackendState with KV shares: guarantees in placement and the queue, and revocation for a
waiter."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from extproc.backends.hold import Hold
from extproc.backends.revocation import Progress
from extproc.backends.state import BackendState
from extproc.policy.admit import SlotRequest
from extproc.policy.decision import Queue
from extproc.policy.kv_shares import DEMAND_HOLD_S
from extproc.policy.schema import build_policy, hash_key


def make_policy(endpoints: bool = False) -> Any:
    be: dict[str, Any] = {
        "name": "b",
        "max_concurrency": 64,
        "kv_block_size": 10,
        "models": [{"name": "m", "context_window": 4096}],
    }
    if endpoints:
        be["endpoints"] = [
            {"address": "127.0.0.1:1", "kv_capacity_tokens": 1000},
            {"address": "127.0.0.2:1", "kv_capacity_tokens": 1000},
        ]
    else:
        be.update(address="127.0.0.1:1", kv_capacity_tokens=1000)
    queue = {"max_queue_depth": 8, "max_queue_wait_ms": 5000}
    return build_policy(
        {
            "backends": [be],
            "tiers": {
                "premium": {
                    "priority": 100,
                    "tpm": 10**6,
                    "rpm": 1000,
                    "kv_guaranteed": 0.4,
                    **queue,
                },
                "free": {"priority": 10, "tpm": 10**6, "rpm": 1000, **queue},
                "batch": {"priority": 0, "tpm": 10**6, "rpm": 1000, "revocable": True, **queue},
            },
            "tenants": [
                {"name": n, "tier": n, "keys": [hash_key(n)]} for n in ("premium", "free", "batch")
            ],
        }
    )


@dataclass
class Handle:
    """A stream as revocation sees it; ``revoke`` records instead of answering Envoy."""

    request_id: str
    answered: bool = False
    waste: int = 100
    revoked: list[str] = field(default_factory=list)

    def progress(self, now: float) -> Progress:
        return Progress(self.answered, self.waste)

    def revoke(self, message: str, retry_after_s: float) -> None:
        self.revoked.append(message)


def backend(endpoints: bool = False) -> BackendState:
    p = make_policy(endpoints)
    be = BackendState.create(p.backends[0], p, 0.0)
    be.has_metrics = False
    for st in be.endpoints.by_key.values() if be.endpoints else ():
        st.spec = st.spec.__class__(**{**st.spec.__dict__, "metrics_url": None})
        st.ip = st.spec.host
    return be


def take(
    be: BackendState, tier: str, kv: int, now: float, handle: Handle | None = None
) -> Hold | Queue:
    got = be.acquire(SlotRequest(tier, tier, None, kv), now)
    if isinstance(got, Hold) and handle is not None:
        be.shares.revocations.track(got.grant.id, tier, got.kv, got.endpoint, now, handle)
    assert isinstance(got, Hold | Queue), got
    return got


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_an_idle_tier_lends_its_guarantee_and_an_active_one_keeps_it() -> None:
    be = backend()
    assert isinstance(take(be, "batch", 900, 0.0), Hold)  # premium never seen: its 400 are lent
    be2 = backend()
    assert isinstance(take(be2, "premium", 10, 0.0), Hold)
    assert isinstance(
        take(be2, "batch", 610, 0.0), Queue
    )  # 10 + 610 + the 390 premium keeps > 1000
    assert isinstance(take(be2, "batch", 600, 0.0), Hold)
    status = be2.status(0.0)["kv_shares"]["tiers"]["premium"]
    assert status == {
        "guaranteed_tokens": 400,
        "burst_tokens": None,
        "reserved_tokens": 10,
        "active": True,
        "revocable": False,
    }


def test_the_guarantee_is_held_for_a_while_after_the_tiers_last_request() -> None:
    be = backend()
    h = take(be, "premium", 10, 0.0)
    assert isinstance(h, Hold)
    be.release(h, 1.0)
    assert isinstance(take(be, "batch", 700, 1.0 + DEMAND_HOLD_S - 0.1), Queue)
    assert isinstance(take(be, "batch", 700, 1.0 + DEMAND_HOLD_S), Hold)


def test_a_premium_waiter_within_its_guarantee_revokes_a_batch_request_that_borrowed_it() -> None:
    async def go() -> None:
        be = backend()
        docs = [Handle("doc-1", waste=5000), Handle("doc-2", waste=100)]
        holds = [take(be, "batch", 450, 0.0, docs[0]), take(be, "batch", 450, 0.0, docs[1])]
        assert all(isinstance(h, Hold) for h in holds)
        assert isinstance(take(be, "premium", 300, 1.0), Queue)  # 900 + 300 > 1000
        w = be.queue.enqueue("premium", "premium", None, 300, 1.0)
        assert not isinstance(w, str)
        # 200 missing: the batch request with less work to lose goes, once; the room is freeing.
        assert docs[1].revoked and not docs[0].revoked
        assert be.shares.revocations.freeing() == 450
        be.queue.tick(1.1)
        assert (
            len(docs[1].revoked) == 1 and not docs[0].revoked
        )  # not revoked twice for the same room
        h1 = holds[1]
        assert isinstance(h1, Hold)
        be.release(h1, 1.2)  # its stream ended and settled
        assert w.future.done() and isinstance(w.future.result(), Hold)
        st = be.status(1.2)["kv_shares"]["revocation"]
        assert st["revoked"] == {"batch/unanswered": 1} and st["wasted_tokens"] == {"batch": 100}
        assert st["decision_to_release_ms"]["n"] == 1 and st["freeing_tokens"] == 0
        assert st["recent"][0]["request_id"] == "doc-2"

    run(go())


def test_above_its_guarantee_a_tier_revokes_only_while_its_slo_is_at_risk() -> None:
    async def go() -> None:
        be = backend()
        doc = Handle("doc")
        assert isinstance(take(be, "premium", 400, 0.0), Hold)  # premium's guarantee, in use
        assert isinstance(take(be, "batch", 500, 0.0, doc), Hold)
        assert isinstance(take(be, "premium", 200, 1.0), Queue)
        be.queue.enqueue("premium", "premium", None, 200, 1.0)
        assert not doc.revoked  # premium would be at 600 of its 400: burst room, no SLO at risk
        be.slo_at_risk = lambda tier, now: tier == "premium"  # type: ignore[method-assign]
        be.queue.tick(1.1)
        assert doc.revoked

    run(go())


def test_answered_requests_of_a_tier_that_is_not_revocable_are_left_alone() -> None:
    async def go() -> None:
        be = backend()
        chat = Handle("chat", answered=True)
        stream = Handle("doc-stream", answered=True)
        assert isinstance(take(be, "free", 500, 0.0, chat), Hold)
        assert isinstance(take(be, "batch", 400, 0.0, stream), Hold)
        assert isinstance(take(be, "premium", 300, 1.0), Queue)
        be.queue.enqueue("premium", "premium", None, 300, 1.0)
        assert stream.revoked and not chat.revoked  # the batch stream is revocable

    run(go())


def test_on_a_pool_the_room_comes_from_the_endpoint_the_waiter_would_fit_on() -> None:
    async def go() -> None:
        be = backend(endpoints=True)
        a, b = Handle("on-a", waste=10), Handle("on-b", waste=10)
        ha = take(be, "batch", 900, 0.0, a)
        hb = take(be, "batch", 700, 0.0, b)
        assert isinstance(ha, Hold) and isinstance(hb, Hold) and ha.endpoint != hb.endpoint
        assert isinstance(take(be, "premium", 350, 1.0), Queue)
        be.queue.enqueue("premium", "premium", None, 350, 1.0)
        # It fits soonest where less must be freed: the endpoint with 700 reserved.
        assert b.revoked and not a.revoked

    run(go())


def test_a_waiter_that_waited_a_quarter_of_its_ttft_slo_revokes_above_its_guarantee() -> None:
    async def go() -> None:
        be = backend()
        be.shares.ttft_slos["premium"] = 1000
        doc = Handle("doc")
        assert isinstance(take(be, "premium", 400, 0.0), Hold)
        assert isinstance(take(be, "batch", 500, 0.0, doc), Hold)
        assert isinstance(take(be, "premium", 200, 1.0), Queue)
        be.queue.enqueue("premium", "premium", None, 200, 1.0)
        be.queue.tick(1.2)
        assert not doc.revoked  # waited 200 ms of 1,000: not yet
        be.queue.tick(1.25)
        assert doc.revoked

    run(go())
