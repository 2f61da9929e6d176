"""The Breakers page lists every breaker Sluice keeps: backends', each pool endpoint's and
each tenant's own (per replica), and their transitions in the history."""

from __future__ import annotations

import copy
import re
from typing import Any

from tests.console.conftest import Console
from tests.console.test_pool_overview import A, B, endpoint, pool, pool_report  # noqa: F401 - pool: the fixture
from tests.console.test_status import post_status


def with_breakers(
    endpoint_b: str = "closed",
    tenants: dict[str, dict[str, Any]] | None = None,
    route_tenants: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    body = pool_report(endpoint(A, 0.2, 1, 0, 0, 32768), endpoint(B, 0.1, 1, 0, 0, 16384))
    b = body["backends"]["sim"]
    b["endpoints"][1]["breaker"] = {
        "state": endpoint_b,
        "trips": 1 if endpoint_b != "closed" else 0,
        "retry_after_s": 25.0 if endpoint_b == "open" else 0.0,
    }
    b["tenant_breakers"] = {
        "tracked_tenants": 3,
        "failing_tenants": len(tenants or {}),
        "breakers": len(tenants or {}),
        "by_state": {},
        "tripped": tenants or {},
    }
    b["route_breakers"] = {
        "sim-llama-8b": {
            "state": "closed",
            "trips": 0,
            "tenant_breakers": {
                "tracked_tenants": 1,
                "failing_tenants": 0,
                "breakers": len(route_tenants or {}),
                "by_state": {},
                "tripped": route_tenants or {},
            },
        }
    }
    return body


def page(c: Console) -> str:
    return c.client.get("/breakers").get_data(as_text=True)


def row_text(html: str, rid: str) -> str:
    part = html.split(f'id="{rid}"', 1)[1].split("</tr>", 1)[0]
    return " ".join(re.sub(r"<[^>]+>", " ", part).split())


def history(c: Console) -> list[str]:
    html = c.client.get("/breakers/history", headers={"HX-Request": "true"}).get_data(as_text=True)
    return [
        " ".join(re.sub(r"<[^>]+>", " ", r).split())
        for r in re.findall(r'<tr class="history-\w+">(.*?)</tr>', html, re.S)
    ]


def test_endpoint_and_tenant_breakers_are_listed_per_replica(pool: Console) -> None:  # noqa: F811
    open_tenant = {
        "hobbyist": {"state": "open", "retry_after_s": 12.0, "trips": 1, "last_cause": "errors"}
    }
    post_status(pool, with_breakers("open", open_tenant), "r1")
    post_status(pool, with_breakers("closed"), "r2")
    html = page(pool)
    ep = row_text(html, "endpoint-breaker-sim-127-0-0-1-8002")
    assert "open r1, retry in 25 s, 1 trip(s)" in ep and "closed r2" in ep
    assert "closed r1" in row_text(html, "endpoint-breaker-sim-127-0-0-1-8000")
    tenant = row_text(html, "tenant-breaker-sim-hobbyist")
    assert "open r1, retry in 12 s, 1 trip(s), last cause: errors" in tenant and "r2" not in tenant
    assert "sim: 6 tenant(s) judged, 1 failing, 1 breaker(s)" in " ".join(
        re.sub(r"<[^>]+>", " ", html).split()
    )
    # The state region polls itself and carries both tables.
    region = pool.client.get("/breakers/state", headers={"HX-Request": "true"}).get_data(
        as_text=True
    )
    assert 'id="endpoint-breakers"' in region and 'id="tenant-breakers"' in region


def test_no_open_tenant_breaker_says_so(pool: Console) -> None:  # noqa: F811
    post_status(pool, with_breakers())
    assert "No tenant breaker is open" in page(pool)


def test_transitions_of_endpoint_and_tenant_breakers_become_history(pool: Console) -> None:  # noqa: F811
    post_status(pool, with_breakers())
    pool.clock.t += 1
    half = {"hobbyist": {"state": "half_open", "trips": 1}}
    post_status(
        pool,
        with_breakers(
            "open", {"hobbyist": {"state": "open", "trips": 1}}, route_tenants=copy.deepcopy(half)
        ),
    )
    pool.clock.t += 1
    post_status(pool, with_breakers("half_open", half))
    pool.clock.t += 1
    post_status(pool, with_breakers("closed"))
    rows = history(pool)
    assert any("sim endpoint 127.0.0.1:8002 replica r1 closed → open" in r for r in rows), rows
    assert any("sim endpoint 127.0.0.1:8002 replica r1 half_open → closed" in r for r in rows), rows
    assert any("sim tenant hobbyist replica r1 closed → open" in r for r in rows), rows
    assert any("sim tenant hobbyist replica r1 open → half_open" in r for r in rows), rows
    assert any("sim tenant hobbyist replica r1 half_open → closed" in r for r in rows), rows
    assert any(
        "sim/sim-llama-8b tenant hobbyist replica r1 closed → half_open" in r for r in rows
    ), rows
    assert any(
        "sim/sim-llama-8b tenant hobbyist replica r1 half_open → closed" in r for r in rows
    ), rows
    kinds = pool.sluice.store.query(
        "SELECT endpoint, tenant FROM breaker_events WHERE endpoint IS NOT NULL "
        "OR tenant IS NOT NULL"
    )
    assert {r["endpoint"] for r in kinds} >= {B} and {r["tenant"] for r in kinds} >= {"hobbyist"}


def test_a_manual_endpoint_trip_shows_in_the_endpoint_table_and_history(pool: Console) -> None:  # noqa: F811
    post_status(pool, with_breakers())
    r = pool.post(
        f"/overview/endpoints/sim/{B}/breaker", {"action": "trip", "reason": "ECC errors"}
    )
    assert r.status_code == 200, r.get_data(as_text=True)
    html = page(pool)
    assert "forced open by olga" in row_text(html, "endpoint-breaker-sim-127-0-0-1-8002")
    assert any(f"sim endpoint {B} olga" in h and "ECC errors" in h for h in history(pool))
