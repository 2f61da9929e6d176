"""One pool endpoint tripped and reset by hand from the console's Overview, in a real browser
(Debian's chromium via Playwright), over the real stack: two simulated engines as one pool,
console, extproc as its replica, Envoy. The trip goes browser -> SQLite -> policy API ->
replica, and Envoy's traffic follows: none to the tripped endpoint, back after the reset.
With prefix affinity on, the pool's affinity row counts a shared system prompt's placements.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.e2e import harness
from tests.e2e.console_stack import ConsoleStack
from tests.e2e.harness import TEST_KEYS, eventually, free_port, get_json, running
from tests.e2e.pool_stack import ExtraEngines, engine_url, start_engine
from tests.e2e.test_console_browser import browser, log_in, new_page  # noqa: F401 - browser: the shared fixture

pytestmark = [pytest.mark.e2e, pytest.mark.browser]
CHAT = "/v1/chat/completions"


class PoolConsoleStack(ExtraEngines, ConsoleStack):
    """The console stack whose backend is a pool: the harness's engine plus a bigger second one."""

    engines = ("sim-big",)
    big_port: int = 0

    def start_sim(self) -> None:
        super().start_sim()
        start_engine(self, "sim-big", self.big_port, ["--kv-blocks", "4096"], f"sim-big-{time.monotonic_ns()}.log")

    @property
    def big_url(self) -> str:
        return engine_url(self.big_port)


def pool_policy(small: int, big: int) -> dict[str, Any]:
    doc = copy.deepcopy(harness.test_policy(small))
    b = doc["backends"][0]
    del b["address"], b["metrics_url"]
    # The big one has the most headroom: every request goes there while it is usable.
    b["endpoints"] = [{"address": f"127.0.0.1:{port}", "metrics_url": f"http://127.0.0.1:{port}/metrics",
                       "kv_capacity_tokens": cap} for port, cap in ((small, 8192), (big, 65536))]
    # Only prompts of a full prefix block (1 KiB) or more are keyed: "hi" is placed by the score.
    b["placement"] = {"prefix_affinity": True}
    return doc


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PoolConsoleStack]:
    # Named like the harness fixture so tests/e2e/conftest.py checks the ledger and prints logs.
    s = PoolConsoleStack(tmp_path_factory.mktemp("console-pool-stack"))
    s.big_port = free_port()
    s.policy_doc = pool_policy(s.sim_port, s.big_port)
    with running(s) as started:
        assert isinstance(started, PoolConsoleStack)
        yield started


def served(url: str) -> int:
    return sum(1 for x in get_json(f"{url}/admin/requests") if x["path"] == CHAT)


SYSTEM = "You are the support assistant of a large shop. " * 60  # ~2.9 kB: two prefix blocks


def chat(stack: ConsoleStack, system: str | None = None) -> httpx.Response:
    messages = [{"role": "user", "content": "hi"}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    body = {"model": "sim-llama-8b", "max_tokens": 8, "messages": messages}
    return httpx.post(f"{stack.url}{CHAT}", json=body, timeout=20,
                      headers={"authorization": f"Bearer {TEST_KEYS['premium']}", "x-sim-tokens": "3"})


def test_operator_trips_and_resets_one_pool_endpoint_from_the_overview(stack: PoolConsoleStack,
                                                                       browser: Any) -> None:  # noqa: F811
    from playwright.sync_api import expect

    big = f"127.0.0.1:{stack.big_port}"
    row_id = "#endpoint-sim-" + big.replace(":", "-").replace(".", "-")
    context, page, console_errors = new_page(browser)
    try:
        page.goto(stack.console_url + "/")
        log_in(page)
        expect(page.locator("h1")).to_have_text("Backends")
        expect(page.locator(row_id)).to_be_visible()
        eventually(lambda: chat(stack).status_code == 200 and served(stack.big_url) > 0, 10,
                   "the big endpoint takes traffic while it is usable")

        # -- trip the big endpoint from its row ---------------------------------
        page.locator(f"{row_id} a", has_text="trip / reset").click()
        form = page.locator("#endpoint-breaker-form")
        expect(form).to_contain_text(big)
        form.locator("input[name=reason]").fill("ECC errors on this GPU")
        form.locator("button[value=trip]").click()
        expect(page.locator("#endpoint-breaker-form .done")).to_have_text("endpoint breaker tripped")
        expect(page.locator(row_id)).to_contain_text("manual open")
        expect(page.locator(row_id)).to_contain_text("ejected", timeout=10_000)  # the replica applied it
        httpx.delete(f"{stack.big_url}/admin/requests", timeout=5)
        codes = [chat(stack).status_code for _ in range(5)]
        assert codes == [200] * 5 and served(stack.big_url) == 0, "no traffic to the tripped endpoint"

        # -- reset (forced closed): traffic comes back ----------------------------
        form = page.locator("#endpoint-breaker-form")
        form.locator("input[name=reason]").fill("GPU replaced")
        form.locator("button[value=reset]").click()
        expect(page.locator("#endpoint-breaker-form .done")).to_have_text("endpoint breaker reset")
        expect(page.locator(row_id)).to_contain_text("manual closed")
        eventually(lambda: chat(stack).status_code == 200 and served(stack.big_url) > 0, 10,
                   "the reset endpoint is picked again")

        # -- clear: automatic again ----------------------------------------------
        form = page.locator("#endpoint-breaker-form")
        form.locator("input[name=reason]").fill("back to automatic")
        form.locator("button[value=clear]").click()
        expect(page.locator("#endpoint-breaker-form .done")).to_have_text("endpoint breaker cleared")
        expect(page.locator(row_id)).not_to_contain_text("manual")

        # -- prefix affinity: the pool's row counts where a shared prompt went -----------
        affinity = page.locator("#affinity-sim")
        expect(affinity).to_contain_text("miss 0")  # on, and the short prompts so far had no prefix block
        codes = [chat(stack, SYSTEM).status_code for _ in range(3)]
        assert codes == [200] * 3
        expect(affinity).to_contain_text("hit 2 (67 %)", timeout=10_000)  # polled in with the next report
        expect(affinity).to_contain_text("miss 1")
        expect(affinity).to_contain_text("spill 0")
        assert not [e for e in console_errors if "Content Security Policy" in e], console_errors
    finally:
        context.close()
