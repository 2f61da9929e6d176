"""Usage history and budget spend from the replicas' reports (console.usage): increments
stored once whatever reports are repeated or lost, a restarted replica counted from zero,
the budget periods' durable copy handed back to the replicas, the tenant page and CSV."""

from __future__ import annotations

import csv
import io
import re
from typing import Any

from tests.console.conftest import POLICY_FILES, Console, MakeConsole, text_of

HOUR = 1_699_999_200  # the start of the console clock's hour (Clock(): 1_700_000_000)
TIERS_WITH_BUDGET = POLICY_FILES["tiers.yaml"].replace("""    rpm: 60
    max_concurrency: 8
""", """    rpm: 60
    max_concurrency: 8
    budget: {period: day, tokens: 5000, cost: 0.50}
""")
PRICED = POLICY_FILES["backends.yaml"].replace("        context_window: 4096\n", """        context_window: 4096
        price: {input: 0.15, output: 0.60}
    gpu_hour_cost: 2.00
""")


def row(tenant: str = "hobbyist", hour: int = HOUR, requests: int = 1, prompt: int = 100, completion: int = 20,
        spend: int = 27_000, refusals: dict[str, int] | None = None, model: str = "sim-llama-8b") -> dict[str, Any]:
    return {"tenant": tenant, "model": model, "hour": hour, "requests": requests, "prompt_tokens": prompt,
            "completion_tokens": completion, "cached_tokens": 0, "spend_nanos": spend,
            "refusals": refusals or {}}


def report(rows: list[dict[str, Any]], run: str = "run-1", periods: list[dict[str, Any]] | None = None
           ) -> dict[str, Any]:
    return {"replica": "r1", "usage": {"run": run, "rows": rows}, "budgets": {"periods": periods or []}}


def period(settled: int, used: int | None = None, tenant: str = "hobbyist") -> dict[str, Any]:
    return {"tenant": tenant, "key": "day:UTC:2023-11-14", "start": 1_699_920_000.0, "end": 1_700_006_400.0,
            "settled_tokens": settled, "settled_nanos": settled * 10, "used_tokens": used or settled,
            "used_nanos": (used or settled) * 10}


def post(c: Console, body: dict[str, Any], replica: str = "r1") -> Any:
    r = c.api("POST", f"/api/v1/replicas/{replica}/status", json=body)
    assert r.status_code == 200, r.get_data(as_text=True)
    return r.get_json()


def stored(c: Console, tenant: str = "hobbyist") -> list[dict[str, Any]]:
    return c.sluice.store.query("SELECT * FROM usage_hourly WHERE tenant = ? ORDER BY hour, model", [tenant])


def test_reports_store_increments_once_across_replicas_and_restarts(console: Console) -> None:
    post(console, report([row(requests=2, prompt=200, completion=40)]))
    post(console, report([row(requests=2, prompt=200, completion=40)]))  # nothing new
    post(console, report([row(requests=5, prompt=500, completion=100, refusals={"budget": 3})]))
    post(console, report([row(requests=1, prompt=50, completion=5)]), replica="r2")
    # r1 restarted (a new run): its counts start from zero, even where they happen to be higher
    post(console, report([row(requests=7, prompt=700, completion=70)], run="run-2"))
    [r] = stored(console)
    assert (r["requests"], r["prompt_tokens"], r["completion_tokens"], r["refused"]) == (13, 1250, 175, 3)
    refusals = console.sluice.store.query("SELECT reason, count FROM usage_refusals")
    assert refusals == [{"reason": "budget", "count": 3}]


def test_a_tenant_not_in_the_policy_is_not_stored(console: Console) -> None:
    post(console, report([row(tenant="made-up")]))
    assert stored(console, "made-up") == []


def test_the_budget_copy_keeps_the_highest_settled_total_and_goes_back_to_the_replicas(console: Console) -> None:
    answer = post(console, report([], periods=[period(3000)]))
    assert answer["budget_spend"] == [{"tenant": "hobbyist", "key": "day:UTC:2023-11-14",
                                       "settled_tokens": 3000, "settled_nanos": 30_000}]
    post(console, report([], periods=[period(1000, used=1200)]), replica="r2")  # an older view: never lowers it
    got = console.api("GET", "/api/v1/budgets").get_json()["budget_spend"]
    assert got[0]["settled_tokens"] == 3000
    console.clock.t = 1_700_006_400.0  # the day is over: not a current period any more
    assert console.api("GET", "/api/v1/budgets").get_json()["budget_spend"] == []


def test_the_tenant_page_shows_the_budget_line_and_the_csv_matches(make_console: MakeConsole) -> None:
    c = make_console(policy_files={**POLICY_FILES, "tiers.yaml": TIERS_WITH_BUDGET, "backends.yaml": PRICED})
    c.login("vic")
    rows = [row(hour=HOUR - 24 * 3600 * d, prompt=1000 * d, completion=100, spend=1_000_000 * d,
                refusals={"budget": 2} if d == 0 else None) for d in range(3)]
    post(c, report(rows, periods=[period(2400, used=4100)]))
    page = c.client.get("/tenants/hobbyist/usage")
    assert page.status_code == 200
    html = page.get_data(as_text=True)
    bars = re.findall(r'<rect class="bar" data-day="([0-9-]+)" data-value="([0-9.e+-]+)"', html)
    assert len(bars) == 30 and bars[-1][0] == "2023-11-14"
    assert [float(v) for _, v in bars[-3:]] == [0.002, 0.001, 0.0], "spend per day in USD (a cost budget)"
    line = re.search(r'<line class="budget-line" data-limit="([0-9.]+)"', html)
    assert line and float(line.group(1)) == 0.5
    text = text_of(page)
    assert "4,100" in text and "5,000" in text and "82 %" in text, "used = spent + reserved, of the token limit"
    assert re.search(r'data-threshold="0.5">50 % reached', html) and re.search(r'data-threshold="0.8">80 % reached',
                                                                                 html)
    assert 'data-threshold="1.0">100 %</span>' in html
    assert "budget 2" in text
    got = c.client.get("/tenants/hobbyist/usage.csv?days=30")
    assert got.status_code == 200 and got.mimetype == "text/csv"
    table = list(csv.DictReader(io.StringIO(got.get_data(as_text=True))))
    assert sum(int(r["prompt_tokens"]) for r in table) == 3000
    assert sum(int(r["completion_tokens"]) for r in table) == 300
    assert [r["spend"] for r in table][-1] == "0.000000" and table[0]["spend"] == "0.002000"
    assert table[-1]["refusals"] == "budget=2" and table[-1]["hour_utc"] == "2023-11-14T22:00Z"
    assert c.client.get("/tenants/nobody/usage").status_code == 404


def test_the_overview_lists_top_spenders_and_the_cost_per_million_tokens(make_console: MakeConsole) -> None:
    c = make_console(policy_files={**POLICY_FILES, "tiers.yaml": TIERS_WITH_BUDGET, "backends.yaml": PRICED})
    c.login("vic")
    post(c, report([row(tenant="acme", prompt=900_000, completion=100_000, spend=195_000_000),
                    row(tenant="hobbyist", prompt=1000, completion=100, spend=210_000)],
                   periods=[period(1100)]))
    page = c.client.get("/")
    text = text_of(page)
    assert page.status_code == 200
    spenders = re.findall(r'<tr id="spender-([a-z-]+)">', page.get_data(as_text=True))
    assert spenders == ["acme", "hobbyist"]
    assert "0.195000 USD" in text and "22 %" in text, "hobbyist's budget: 1100 of 5000 tokens"
    # The console has usage from this hour's start on, 800 s ago: 2.00 USD x 800 / 3600 for
    # 1,001,100 tokens, 0.443956 per million (idle GPU time costs too).
    assert "0.444444 USD" in text and "0.2 h" in text and "0.443956 USD" in text


def test_the_tenants_page_shows_each_budget_s_share_and_its_alerts(make_console: MakeConsole) -> None:
    c = make_console(policy_files={**POLICY_FILES, "tiers.yaml": TIERS_WITH_BUDGET})
    c.login("vic")
    post(c, report([], periods=[period(2000, used=4200)]))
    body = c.client.get("/tenants/live", headers={"HX-Request": "true"}).get_data(as_text=True)
    cell = re.search(r'<tr id="live-hobbyist">.*?<td class="num budget">(.*?)</td>', body, re.S)
    assert cell and "84 %" in cell.group(1) and "80 % reached" in cell.group(1)
    acme = re.search(r'<tr id="live-acme">.*?<td class="num budget">(.*?)</td>', body, re.S)
    assert acme and acme.group(1).strip() == "—", "acme's tier has no budget"
