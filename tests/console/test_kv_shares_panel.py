"""Overview: a backend's KV shares per tier and its revocations, from the status a real
BackendState reports; no row while no tier sets a share."""

from __future__ import annotations

import json
from typing import Any

from extproc.backends.hold import Hold
from extproc.backends.state import BackendState
from extproc.policy.admit import SlotRequest
from extproc.policy.schema import build_policy, hash_key
from tests.console.conftest import Console
from tests.console.test_affinity_panel import visible, with_backend
from tests.console.test_status import post_status


def sim_status(shares: bool) -> dict[str, Any]:
    premium: dict[str, Any] = {"priority": 100, "tpm": 10**6, "rpm": 10**4}
    if shares:
        premium["kv_guaranteed"] = 0.25
    p = build_policy(
        {
            "backends": [
                {
                    "name": "sim",
                    "address": "127.0.0.1:1",
                    "max_concurrency": 8,
                    "kv_capacity_tokens": 8000,
                    "models": [{"name": "m", "context_window": 4096}],
                }
            ],
            "tiers": {
                "premium": premium,
                "batch": {"priority": 0, "tpm": 10**6, "rpm": 10**4, "revocable": True},
            },
            "tenants": [
                {"name": n, "tier": n, "keys": [hash_key(n)]} for n in ("premium", "batch")
            ],
        }
    )
    be = BackendState.create(p.backends[0], p, 0.0)
    be.has_metrics = False
    h = be.acquire(SlotRequest("batch", "batch", None, 3000), 0.0)
    assert isinstance(h, Hold)
    be.shares.revocations.counts[("batch", "streaming")] += 2  # as if two were revoked earlier
    be.shares.revocations.wasted["batch"] += 12_345
    status = json.loads(json.dumps(be.status(0.0)))
    be.release(h, 0.0)
    return status


def shares_row(c: Console) -> str | None:
    page = c.client.get("/overview/backends", headers={"HX-Request": "true"}).get_data(as_text=True)
    if 'id="kv-shares-sim"' not in page:
        return None
    return page.split('id="kv-shares-sim"', 1)[1].split("</tr>", 1)[0]


def test_each_tiers_kv_share_and_the_revocations_show(operator: Console) -> None:
    assert post_status(operator, with_backend(sim_status(True)), "r1").status_code == 200
    text = visible(shares_row(operator) or "")
    assert "premium 0 reserved, 2,000 guaranteed (lent)" in text
    assert "batch 3,000 reserved revocable" in text
    assert "2 revoked (12,345 tokens of work thrown away)" in text


def test_no_row_without_shares(operator: Console) -> None:
    post_status(operator, with_backend(sim_status(False)))
    assert shares_row(operator) is None
