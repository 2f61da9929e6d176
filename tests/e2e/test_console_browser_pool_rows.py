"""The Overview's pool row in a real browser (Debian's chromium) over the real stack, two
simulated engines as one pool: no failure badge while both endpoints are healthy, the
pool's numbers equal the sums of its endpoint rows, and with one engine killed the pool row
says "1 of 2 endpoints unreadable" and that endpoint's row says why.
"""

from __future__ import annotations

import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.e2e.harness import TEST_KEYS, eventually
from tests.e2e.test_console_browser import browser, log_in, new_page  # noqa: F401 - browser: the shared fixture
from tests.e2e.test_console_browser_pool import PoolConsoleStack
from tests.e2e.test_console_browser_pool import stack as stack  # noqa: F401 - a module-scoped stack of its own

pytestmark = [pytest.mark.e2e, pytest.mark.browser]
FIELDS = ("used", "reserved", "capacity", "running", "waiting")
# Read in one go, between two swaps of the polled region: every number of one report.
READ_ROWS = """() => {
  const read = (row) => Object.fromEntries(FIELDS.map(f => {
    const el = row.querySelector('.' + f + '[data-value]');
    return [f, el && el.dataset.value !== '' ? Number(el.dataset.value) : null];
  }));
  const pool = document.querySelector('#backend-sim');
  const eps = [...document.querySelectorAll('tr.endpoint[id^="endpoint-sim-"]')];
  return {pool: read(pool), badge: pool.querySelector('th').innerText, endpoints: eps.map(read)};
}""".replace("FIELDS", json.dumps(list(FIELDS)))


def sim_config(url: str, **update: Any) -> None:
    req = urllib.request.Request(
        f"{url}/admin/config",
        data=json.dumps(update).encode(),
        headers={"content-type": "application/json"},
        method="POST",
    )
    urllib.request.urlopen(req, timeout=5).read()


def stream(stack: PoolConsoleStack) -> int:
    body = {
        "model": "sim-llama-8b",
        "max_tokens": 400,
        "stream": True,
        "messages": [{"role": "user", "content": "a long answer please"}],
    }
    with httpx.stream(
        "POST",
        f"{stack.url}/v1/chat/completions",
        json=body,
        timeout=60,
        headers={"authorization": f"Bearer {TEST_KEYS['premium']}", "x-sim-tokens": "300"},
    ) as r:
        for _ in r.iter_bytes():
            pass
        return r.status_code


def test_the_pool_row_is_the_sum_of_its_endpoints_and_names_an_unreadable_one(
    stack: PoolConsoleStack,
    browser: Any,  # noqa: F811 - the shared fixture
) -> None:
    from playwright.sync_api import expect

    sim_config(stack.sim_url, kv_usage_override=0.3)
    sim_config(stack.big_url, kv_usage_override=0.5)
    context, page, console_errors = new_page(browser)
    pool_row = page.locator("#backend-sim")
    try:
        page.goto(stack.console_url + "/")
        log_in(page)
        expect(pool_row).to_contain_text("tokens")  # the pool's line, from the replica's report
        with ThreadPoolExecutor(4) as ex:
            streams = [ex.submit(stream, stack) for _ in range(4)]

            def busy() -> dict[str, Any] | None:
                rows = page.evaluate(READ_ROWS)
                return (
                    rows
                    if (rows["pool"]["running"] or 0) >= 1 and (rows["pool"]["reserved"] or 0) > 0
                    else None
                )

            rows = eventually(busy, 20, "the pool row showing the streams running")
            assert [f.result() for f in streams] == [200] * 4
        assert "unreadable" not in rows["badge"] and "scrape failing" not in rows["badge"]
        assert len(rows["endpoints"]) == 2
        for f in FIELDS:
            parts = [e[f] for e in rows["endpoints"]]
            assert rows["pool"][f] == sum(p for p in parts if p is not None), (f, rows)
        assert rows["pool"]["capacity"] == 8192 + 65536
        assert rows["pool"]["used"] == round(0.3 * 8192) + round(0.5 * 65536)

        # -- one engine dies: its metrics with it ----------------------------------------
        stack.procs["sim-big"].stop()
        big = page.locator("#endpoint-sim-127-0-0-1-" + str(stack.big_port))
        small = page.locator("#endpoint-sim-127-0-0-1-" + str(stack.sim_port))
        expect(pool_row.locator("th")).to_contain_text(
            "1 of 2 endpoints unreadable", timeout=15_000
        )
        expect(big).to_contain_text("metrics unreadable")
        expect(big).to_contain_text("unreachable")
        expect(small).not_to_contain_text("unreadable")
        expect(pool_row.locator("th")).not_to_contain_text("scrape failing")
        rows = page.evaluate(READ_ROWS)
        assert rows["pool"]["used"] == round(0.3 * 8192)  # what can still be read
        assert not [e for e in console_errors if "Content Security Policy" in e], console_errors
    finally:
        context.close()
        sim_config(stack.sim_url, kv_usage_override=None)
