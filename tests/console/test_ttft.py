"""TTFT percentiles per tier on the Overview: bucket increments stored per report, summed per window."""

from __future__ import annotations

import re
from typing import Any

import pytest

from console import live, ttft
from console.views.overview import _ttft_rows
from tests.console.conftest import Console, text_of

BOUNDS = [100, 500, 1000, 2000]


def report(counts: dict[str, list[int]], bounds: list[int] = BOUNDS) -> dict[str, Any]:
    return {"replica": "r1", "at": 1.0, "ttft_bounds_ms": bounds,
            "backends": {"sim": {"kv_usage": 0.5, "ttft_counts": counts}}}


def post(c: Console, body: Any, replica: str = "r1") -> None:
    assert c.api("POST", f"/api/v1/replicas/{replica}/status", json=body).status_code == 200


def stored(c: Console) -> list[tuple[str, str, list[int]]]:
    import json
    return [(r["replica"], r["tier"], json.loads(r["counts"]))
            for r in c.sluice.store.query("SELECT * FROM ttft_samples ORDER BY rowid")]


def test_quantile_interpolates_within_a_bucket() -> None:
    assert ttft.quantile(BOUNDS, [0, 0, 0, 0, 0], 0.5) is None
    assert ttft.quantile(BOUNDS, [0, 10, 0, 0, 0], 0.5) == pytest.approx(300)  # half way through 100-500
    assert ttft.quantile(BOUNDS, [10, 0, 0, 0, 0], 0.99) == pytest.approx(99)
    assert ttft.quantile(BOUNDS, [1, 0, 0, 0, 99], 0.99) == 2000  # overflow: the last bound


def test_increments_summed_across_reports_and_replicas(operator: Console) -> None:
    post(operator, report({"premium": [10, 80, 8, 2, 0], "free": [0, 0, 0, 0, 0]}))
    operator.clock.t += 1
    post(operator, report({"premium": [10, 80, 8, 2, 0]}))  # nothing new: no row
    operator.clock.t += 1
    post(operator, report({"premium": [10, 80, 8, 52, 0]}))
    post(operator, report({"premium": [0, 0, 0, 50, 0]}), "r2")
    assert stored(operator) == [("r1", "premium", [10, 80, 8, 2, 0]), ("r1", "premium", [0, 0, 0, 50, 0]),
                                ("r2", "premium", [0, 0, 0, 50, 0])]
    operator.clock.t += 1
    post(operator, report({"premium": [1, 0, 0, 0, 0]}))  # r1 restarted: its counts start again
    assert stored(operator)[-1] == ("r1", "premium", [1, 0, 0, 0, 0])
    # 201 requests: p50 at rank 100.5 and p99 at 199 fall in the 1000-2000 bucket (98 below it).
    [prem] = ttft.summary(operator.sluice.store, "sim", operator.clock.t - 900)
    assert prem.tier == "premium" and prem.n == 201
    assert prem.p50_ms == pytest.approx(1000 + 1000 * (100.5 - 99) / 102)
    assert prem.p99_ms == pytest.approx(1000 + 1000 * (0.99 * 201 - 99) / 102)
    text = text_of(operator.client.get("/overview/backends", headers={"HX-Request": "true"}))
    assert re.search(r"premium\s+1015 / 1980 ms\s+\(201\)", text), text


def test_overview_shows_p99_sparkline_with_the_slo(operator: Console) -> None:
    start = operator.clock.t
    total = [0, 0, 0, 0, 0]
    for minute in range(5):
        operator.clock.t = start + minute * 60
        total[minute % 4] += 20  # each minute slower than the last (until the 4th bucket)
        post(operator, report({"premium": list(total)}))
    body = operator.client.get("/overview/backends", headers={"HX-Request": "true"}).get_data(as_text=True)
    cell = re.search(r'<div id="ttft-sim-premium">.*?</div>', body, re.S)
    assert cell is not None and "<svg" in cell.group(0) and "<script" not in cell.group(0)
    [row] = _ttft_rows(operator.sluice.store, "sim", operator.clock.t, {"premium": 2500})
    assert row["slo"] == 2500 and row["over"] is False
    svg = str(row["spark"])
    assert svg.count('class="watermark"') == 1  # the SLO line
    points = re.search(r'<polyline points="([^"]+)"', svg)
    assert points is not None and len(points.group(1).split()) >= 4  # one p99 per minute
    [tight] = _ttft_rows(operator.sluice.store, "sim", operator.clock.t, {"premium": 200})
    assert tight["over"] is True


def test_bad_counts_are_ignored_and_old_rows_pruned(operator: Console) -> None:
    post(operator, report({"premium": [1, 2]}))  # wrong length for the bounds
    post(operator, report({"premium": [1, 2, 3, 4, 5]}, bounds=[5, 3, 9, 10]))  # bounds not increasing
    post(operator, report({"premium": ["x", 1, 1, 1, 1], "free": [-1, 0, 0, 0, 0]}))
    assert stored(operator) == []
    post(operator, report({"premium": [1, 0, 0, 0, 0]}))
    assert len(stored(operator)) == 1
    live.prune(operator.sluice.store, operator.clock.t + 3601)
    assert stored(operator) == []
