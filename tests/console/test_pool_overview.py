"""The Overview's pool row tells the truth: its endpoints' sums, no failure while they are
healthy, "1 of 2 endpoints unreadable" when one is not; each endpoint row with its own
sparkline, its numbers in their own columns."""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests.console.conftest import POLICY_FILES, Console, MakeConsole, text_of
from tests.console.test_endpoint_breakers import POOL
from tests.console.test_status import post_status, report

A, B = "127.0.0.1:8000", "127.0.0.1:8002"
COLUMNS = [
    "Backend",
    "KV watermark",
    "Last 15 min",
    "TTFT p50 / p99, 15 min",
    "Running",
    "Waiting",
    "Scale",
    "Breaker",
    "Slots in use",
]


@pytest.fixture
def pool(make_console: MakeConsole) -> Console:
    c = make_console(policy_files={**POLICY_FILES, "backends.yaml": POOL})
    c.login("olga")
    return c


def endpoint(
    address: str,
    kv: float | None,
    running: float | None,
    waiting: float | None,
    reserved: int,
    cap: int,
    unreadable: bool = False,
) -> dict[str, Any]:
    return {
        "address": address,
        "usable": not unreadable,
        "draining": False,
        "unreadable": unreadable,
        "kv_usage": kv,
        "kv_source": "saturated" if unreadable else "engine",
        "metrics_reason": "unreachable" if unreadable else "ok",
        "running": running,
        "waiting": waiting,
        "scale": 1.0,
        "breaker": {"state": "closed", "trips": 0},
        "slots": {"total": 32, "in_use": 2},
        "kv": {
            "capacity_tokens": cap,
            "reserved_tokens": reserved,
            "used_tokens": None if kv is None else round(kv * cap),
        },
    }


def pool_report(*eps: dict[str, Any]) -> dict[str, Any]:
    """What extproc.backends.pool_report sends for these endpoints."""
    body = report(None)
    b = body["backends"]["sim"]
    used = [e["kv"]["used_tokens"] for e in eps if e["kv"]["used_tokens"] is not None]
    covered = sum(e["kv"]["capacity_tokens"] for e in eps if e["kv"]["used_tokens"] is not None)
    known = [e for e in eps if not e["unreadable"]]
    bad = [e["address"] for e in eps if e["unreadable"]]
    fullest = max(known, key=lambda e: e["kv_usage"]) if known else None
    b.update(
        {
            "endpoints": list(eps),
            "kv_usage": sum(used) / covered if covered else None,
            "kv_source": "endpoints",
            "scrape_ok": not bad,
            "metrics_state": "partial" if bad else "ok",
            "running": sum(e["running"] for e in known),
            "waiting": sum(e["waiting"] for e in known),
            "pool": {
                "endpoints": len(eps),
                "usable": len(known),
                "unreadable": len(bad),
                "unreadable_endpoints": bad,
                "kv_used_tokens": sum(used),
                "kv_reserved_tokens": sum(e["kv"]["reserved_tokens"] for e in eps),
                "kv_capacity_tokens": sum(e["kv"]["capacity_tokens"] for e in eps),
                "kv_usage": sum(used) / covered if covered else None,
                "kv_usage_max": fullest["kv_usage"] if fullest else None,
                "kv_usage_max_endpoint": fullest["address"] if fullest else None,
                "running": sum(e["running"] for e in known),
                "waiting": sum(e["waiting"] for e in known),
            },
        }
    )
    return body


def backends(c: Console) -> str:
    return c.client.get("/overview/backends", headers={"HX-Request": "true"}).get_data(as_text=True)


def row(page: str, rid: str) -> str:
    return page.split(f'id="{rid}"', 1)[1].split("</tr>", 1)[0]


def cells(fragment: str) -> list[str]:
    return [
        " ".join(re.sub(r"<[^>]+>", " ", c).split())
        for c in re.findall(r"<t[dh][^>]*>(.*?)</t[dh]>", fragment, re.S)
    ]


def value(fragment: str, cls: str) -> float:
    m = re.search(rf'class="[^"]*\b{cls}\b[^"]*" data-value="([^"]*)"', fragment)
    assert m and m.group(1), (cls, fragment[:400])
    return float(m.group(1))


def test_a_healthy_pool_shows_its_sums_and_no_failure(pool: Console) -> None:
    assert (
        post_status(
            pool,
            pool_report(endpoint(A, 0.5, 3, 1, 1024, 32768), endpoint(B, 0.75, 2, 4, 2048, 16384)),
        ).status_code
        == 200
    )
    page = backends(pool)
    sim, a, b = (
        row(page, "backend-sim"),
        row(page, "endpoint-sim-127-0-0-1-8000"),
        row(page, "endpoint-sim-127-0-0-1-8002"),
    )
    text = " ".join(re.sub(r"<[^>]+>", " ", sim).split())
    assert "scrape failing" not in text and "unreadable" not in text
    for cls in ("used", "reserved", "capacity", "running", "waiting"):
        assert value(sim, cls) == value(a, cls) + value(b, cls), cls
    assert "28,672 used · 3,072 reserved (6 %) / 49,152 tokens" in text
    assert "58 %" in text  # 28,672 / 49,152
    assert "highest endpoint 75 % (127.0.0.1:8002)" in text
    # Each endpoint row has a cell under every column, its running and waiting under theirs.
    assert len(cells(a)) == len(COLUMNS)
    assert cells(a)[COLUMNS.index("Running")] == "3" and cells(a)[COLUMNS.index("Waiting")] == "1"
    assert (
        cells(sim)[COLUMNS.index("Running")] == "5" and cells(sim)[COLUMNS.index("Waiting")] == "5"
    )


def test_one_unreadable_endpoint_is_named_on_the_pool_row_and_its_own(pool: Console) -> None:
    post_status(
        pool,
        pool_report(
            endpoint(A, 0.25, 1, 0, 0, 32768),
            endpoint(B, None, None, None, 0, 16384, unreadable=True),
        ),
    )
    page = backends(pool)
    sim = " ".join(re.sub(r"<[^>]+>", " ", row(page, "backend-sim")).split())
    assert "1 of 2 endpoints unreadable" in sim and "scrape failing" not in sim
    b = " ".join(re.sub(r"<[^>]+>", " ", row(page, "endpoint-sim-127-0-0-1-8002")).split())
    assert "metrics unreadable" in b and "ejected" in b and "metrics unreachable" in b
    a = " ".join(re.sub(r"<[^>]+>", " ", row(page, "endpoint-sim-127-0-0-1-8000")).split())
    assert "unreadable" not in a


def test_the_pool_and_each_endpoint_get_a_sparkline(pool: Console) -> None:
    for kv in (0.2, 0.4, 0.6):
        pool.clock.t += 10
        post_status(
            pool, pool_report(endpoint(A, kv, 1, 0, 0, 32768), endpoint(B, kv / 2, 1, 0, 0, 16384))
        )
    rows = pool.sluice.store.query(
        "SELECT backend, COUNT(*) AS n FROM kv_samples GROUP BY backend ORDER BY backend"
    )
    assert {r["backend"]: r["n"] for r in rows} == {"sim": 3, f"sim@{A}": 3, f"sim@{B}": 3}
    page = pool.client.get("/").get_data(as_text=True)
    for rid in ("endpoint-sim-127-0-0-1-8000", "endpoint-sim-127-0-0-1-8002"):
        spark = row(page, rid)
        assert "<svg" in spark and "no samples" not in spark and "polyline" in spark
    assert "the pool&#39;s KV used over its capacity of sim" in row(page, "backend-sim")


def test_a_single_engine_backend_still_says_scrape_failing(operator: Console) -> None:
    body = report(None)
    body["backends"]["sim"]["scrape_ok"] = False
    post_status(operator, body)
    assert "scrape failing" in text_of(
        operator.client.get("/overview/backends", headers={"HX-Request": "true"})
    )
