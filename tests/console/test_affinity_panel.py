"""Overview: a pool's prefix affinity counters (hit / spill / miss since start), from the
status a real BackendState reports, summed over the fresh replicas; no row while off."""

from __future__ import annotations

import html
import json
import re
from typing import Any

from extproc.backends.hold import Hold
from extproc.backends.state import BackendState
from extproc.policy.schema import build_policy
from tests.backend_ops import try_acquire
from tests.console.conftest import Console, text_of
from tests.console.test_status import post_status, report
from tests.test_pool import doc

A, B = "127.0.0.1:7001", "127.0.0.1:7002"
P, Q = (11, 12, 13), (21, 22)  # two prompts' prefix block keys (extproc.openai_api.prefix_key)


def sim_status(affinity: bool) -> dict[str, Any]:
    """What a replica reports for a pool named like the console's backend, after placing
    a miss, two hits and a spill (or the same requests with affinity off)."""
    d = doc([{"address": A, "kv_capacity_tokens": 1000, "max_concurrency": 8},
             {"address": B, "kv_capacity_tokens": 4000, "max_concurrency": 8}],
            placement={"prefix_affinity": affinity})
    d["backends"][0]["name"] = "sim"
    p = build_policy(d)
    be = BackendState.create(p.backends[0], p, 0.0)
    holds = [try_acquire(be, "t", "a", None, kv, 0.0, prefix) for kv, prefix in
             [(2500, P), (100, P), (100, P), (900, P), (50, Q)]]
    assert all(isinstance(h, Hold) for h in holds)
    status = json.loads(json.dumps(be.status(0.0)))  # as it crosses the wire
    for h in holds:
        be.release(h, 0.0)  # type: ignore[arg-type]
    return status


def with_backend(status: dict[str, Any]) -> dict[str, Any]:
    body = report(0.5)
    body["backends"]["sim"] = status
    return body


def affinity_row(c: Console) -> str | None:
    page = c.client.get("/overview/backends", headers={"HX-Request": "true"}).get_data(as_text=True)
    if 'id="affinity-sim"' not in page:
        return None
    return page.split('id="affinity-sim"', 1)[1].split("</tr>", 1)[0]


def visible(fragment: str) -> str:
    return html.unescape(" ".join(re.sub(r"<[^>]+>", " ", fragment).split()))


def test_a_pools_affinity_counters_show_summed_over_fresh_replicas(operator: Console) -> None:
    status = sim_status(affinity=True)
    counts = status["prefix_affinity"]
    assert (counts["hit"], counts["spill"], counts["miss"]) == (2, 1, 2)  # the counts the replica reports
    assert post_status(operator, with_backend(status), "r1").status_code == 200
    row = affinity_row(operator)
    assert row is not None
    text = visible(row)
    assert "hit 2 (40 %)" in text and "spill 1" in text and "miss 2" in text
    assert f"{counts['keys']} prefix keys" in text and "replicas" not in text
    # A second replica: its counters add up (each replica keeps its own map).
    operator.clock.t += 3
    post_status(operator, with_backend(status), "r2")
    text = visible(affinity_row(operator) or "")
    assert "sum of 2 replicas" in text and "hit 4 (40 %)" in text and "spill 2" in text and "miss 4" in text
    # r1 goes stale: only r2's counters are shown.
    operator.clock.t += 4
    text = visible(affinity_row(operator) or "")
    assert "hit 2 (40 %)" in text and "replicas" not in text
    # The full page carries the same row.
    assert "prefix affinity since start" in text_of(operator.client.get("/"))


def test_no_affinity_row_while_it_is_off_or_the_report_is_malformed(operator: Console) -> None:
    off = sim_status(affinity=False)
    assert off["prefix_affinity"] is None and off["endpoints"]  # a pool, affinity off
    post_status(operator, with_backend(off))
    assert affinity_row(operator) is None
    bad = with_backend(off)
    bad["backends"]["sim"]["prefix_affinity"] = "lots"
    assert post_status(operator, bad).status_code == 200
    assert affinity_row(operator) is None
    odd = with_backend(off)
    odd["backends"]["sim"]["prefix_affinity"] = {"hit": "x", "spill": None, "miss": 3}
    post_status(operator, odd)
    text = visible(affinity_row(operator) or "")
    assert "hit 0 (0 %)" in text and "spill 0" in text and "miss 3" in text  # no 500, unreadable counts as 0
