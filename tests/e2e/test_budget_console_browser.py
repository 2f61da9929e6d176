"""A tenant's usage and budget in the console, in a real browser (Debian's chromium,
headless, through Playwright), over the real stack: simulated engine, console, extproc
as its replica, Envoy.

Traffic for a tenant with a small daily budget and priced models goes through Envoy
until it is refused with ``budget``; its page shows the 30-day chart with today's bar at
what the clients received and the budget line at the limit, the refusals by reason, and
the CSV it exports adds up to the usage the clients received.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from extproc.policy.schema import hash_key
from tests.e2e import harness
from tests.e2e.console_stack import ConsoleStack
from tests.e2e.harness import eventually, running
from tests.e2e.test_console_browser import browser, log_in, new_page  # noqa: F401 - the browser fixture

pytestmark = [pytest.mark.e2e, pytest.mark.browser]

KEY = "sk-test-budget-console"
BUDGET = 2500  # tokens per day: about 40 requests


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ConsoleStack]:
    s = ConsoleStack(tmp_path_factory.mktemp("budget-console"))
    doc = harness.test_policy(s.sim_port)
    doc["backends"][0]["models"][0]["price"] = {"input": 0.20, "output": 0.60}
    doc["tiers"]["budgeted"] = {"priority": 5, "tpm": 10_000_000, "rpm": 1_000_000,
                                "budget": {"period": "day", "tokens": BUDGET}}
    doc["tenants"].append({"name": "t-budget", "tier": "budgeted", "keys": [hash_key(KEY)]})
    s.policy_doc = doc
    with running(s) as started:
        assert isinstance(started, ConsoleStack)
        yield started


def spend_until_refused(stack: ConsoleStack) -> tuple[int, int, int, int]:
    """Requests until the budget refuses: the requests served, the prompt and completion
    tokens the clients received, the refusals."""
    served = prompt = completion = refused = 0
    with httpx.Client(timeout=20) as http:
        for i in range(200):
            r = http.post(f"{stack.url}/v1/chat/completions", headers={"authorization": f"Bearer {KEY}",
                                                                       "x-sim-tokens": str(20 + i % 30)},
                          json={"model": "sim-llama-8b", "max_tokens": 64,
                                "messages": [{"role": "user", "content": f"tell me about {i}"}]})
            if r.status_code == 200:
                u = r.json()["usage"]
                prompt, completion = prompt + u["prompt_tokens"], completion + u["completion_tokens"]
                served += 1
            else:
                assert (r.status_code, r.headers["x-sluice-reason"]) == (429, "budget"), r.text
                refused += 1
                if refused >= 3:
                    break
    return served, prompt, completion, refused


def test_the_tenant_page_charts_the_budget_and_the_csv_matches_the_clients(stack: ConsoleStack, browser: Any,  # noqa: F811
                                                                           tmp_path: Path) -> None:
    from playwright.sync_api import expect

    served, prompt, completion, refused = spend_until_refused(stack)
    assert refused == 3 and prompt + completion <= BUDGET + 64 + 20
    context, page, console_errors = new_page(browser)
    try:
        page.goto(stack.console_url + "/tenants")
        log_in(page)
        page.click("#tenant-t-budget th a")
        expect(page.locator("h1")).to_contain_text("t-budget")

        def reported() -> bool:
            page.reload()
            return page.locator("#usage-totals .prompt").inner_text().replace(",", "") == str(prompt)

        eventually(reported, 10, "the replica's report reached the console", interval=0.5)
        expect(page.locator("#usage-totals .completion")).to_have_text(f"{completion:,}")
        expect(page.locator("#usage-totals .refusals")).to_contain_text("budget 3")
        chart = page.locator("#usage-chart svg.usage-chart")
        expect(chart).to_be_visible()
        bars = chart.locator("rect.bar")
        expect(bars).to_have_count(30)
        assert float(bars.nth(29).get_attribute("data-value") or "nan") == prompt + completion
        line = chart.locator("line.budget-line")
        expect(line).to_have_count(1)
        assert float(line.get_attribute("data-limit") or "nan") == BUDGET
        # The line is drawn at the limit's height: above today's bar, which is under the budget.
        assert float(line.get_attribute("y1") or 0) < float(bars.nth(29).get_attribute("y") or 0)
        expect(page.locator("#budget .budget-tokens .share")).to_contain_text("%")
        expect(page.locator("#budget .alert[data-threshold='0.8']")).to_contain_text("reached")
        page.screenshot(path=str(tmp_path / "tenant-usage.png"), full_page=True)

        with page.expect_download() as dl:
            page.click("#usage-csv")
        rows = list(csv.DictReader(io.StringIO(Path(dl.value.path()).read_text())))
        mine = [r for r in rows if r["tenant"] == "t-budget"]
        assert sum(int(r["prompt_tokens"]) for r in mine) == prompt
        assert sum(int(r["completion_tokens"]) for r in mine) == completion
        assert sum(int(r["requests"]) for r in mine) == served
        spend = sum(float(r["spend"]) for r in mine)
        assert abs(spend - (prompt * 0.20 + completion * 0.60) / 1e6) < 1e-6 * len(mine)
        assert sum(int(r["refused"]) for r in mine) == 3
        assert not [e for e in console_errors if "Content Security Policy" in e], console_errors
    except Exception:
        page.screenshot(path=str(tmp_path / "failure.png"), full_page=True)
        print(f"screenshots in {tmp_path}")
        raise
    finally:
        context.close()
