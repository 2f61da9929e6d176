"""The console in a real browser (Debian's chromium, headless, driven by Playwright) over
the real stack: simulated backend, console, extproc as its replica, Envoy.

An operator logs in, watches the backend's KV watermark change without reloading,
moves a tenant to another tier and trips a breaker by hand; requests through Envoy
follow within seconds. No browser is downloaded: CI installs Debian's ``chromium``,
and a missing one fails this test rather than skipping it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.console_stack import OPERATOR, ConsoleStack
from tests.e2e.harness import ROOT, TEST_KEYS, eventually, running

pytestmark = [pytest.mark.e2e, pytest.mark.browser]

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
README_SCREENSHOT = ROOT / "docs" / "console.png"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ConsoleStack]:
    # Named like the harness fixture so tests/e2e/conftest.py checks the ledger and prints logs.
    with running(ConsoleStack(tmp_path_factory.mktemp("console-stack"))) as s:
        assert isinstance(s, ConsoleStack)
        yield s


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    assert Path(CHROMIUM).exists(), f"{CHROMIUM} is missing: apt-get install -y chromium"
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


def new_page(browser: Any) -> tuple[Any, Any, list[str]]:
    """A 1400x900 browser context and its page (10 s default timeout), and the console errors it logs."""
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    page = context.new_page()
    page.set_default_timeout(10_000)
    console_errors: list[str] = []
    page.on("console", lambda m: console_errors.append(m.text) if m.type == "error" else None)
    return context, page, console_errors


def log_in(page: Any) -> None:
    """Fill and submit the login form the page shows, as the operator."""
    page.fill("input[name=name]", OPERATOR[0])
    page.fill("input[name=password]", OPERATOR[1])
    page.click("form.login button[type=submit]")


def sim_config(stack: ConsoleStack, **update: Any) -> None:
    req = urllib.request.Request(f"{stack.sim_url}/admin/config", data=json.dumps(update).encode(),
                                 headers={"content-type": "application/json"}, method="POST")
    urllib.request.urlopen(req, timeout=5).read()


def chat(stack: ConsoleStack, key: str, max_tokens: int = 8) -> httpx.Response:
    body = {"model": "sim-llama-8b", "max_tokens": max_tokens, "messages": [{"role": "user", "content": "hi"}]}
    return httpx.post(f"{stack.url}/v1/chat/completions", json=body, timeout=20,
                      headers={"authorization": f"Bearer {key}", "x-sim-tokens": "3"})



def test_operator_steers_the_gateway_from_the_browser(stack: ConsoleStack, browser: Any,
                                                      tmp_path: Path) -> None:
    from playwright.sync_api import expect

    context, page, console_errors = new_page(browser)
    try:
        # -- log in -------------------------------------------------------------
        page.goto(stack.console_url + "/")
        expect(page.locator("form.login")).to_be_visible()
        log_in(page)
        expect(page.locator("h1")).to_have_text("Backends")
        expect(page.locator("#replica-r1 .is-live")).to_have_text("live", timeout=10_000)

        # -- move a tenant to another tier: its requests get the new tier's limits
        # (first, while the KV watermark is low: pressure shrinks every budget for a while)
        # t-other is on "tiny" (600 TPM): a request reserving 1000 tokens cannot fit its bucket.
        assert chat(stack, TEST_KEYS["other"], max_tokens=1000).status_code == 429
        page.click("nav >> text=Tenants")
        row = page.locator("#tenant-t-other")
        row.locator("text=Edit").click()
        form = page.locator("#tenant-t-other form")
        form.locator("select[name=tier]").select_option("free")
        form.locator("input[name=reason]").fill("customer upgraded to free")
        form.locator("button[type=submit]").click()
        expect(page.locator("#tenant-t-other .tier")).to_contain_text("free")
        expect(page.locator("#tenant-t-other .saved")).to_be_visible()
        page.screenshot(path=str(tmp_path / "tenants.png"), full_page=True)
        r = eventually(lambda: (x := chat(stack, TEST_KEYS["other"], max_tokens=1000)).status_code == 200 and x,
                       2.0, "t-other admitted with the free tier's budget")
        assert r.status_code == 200

        # -- trip the breaker by hand -------------------------------------------
        page.click("nav >> text=Breakers")
        card = page.locator("#breaker-form-sim")
        card.locator("input[name=reason]").fill("GPU node draining for maintenance")
        card.locator("input[name=minutes]").fill("15")
        card.locator("button[value=trip]").click()
        expect(page.locator("#breaker-form-sim .done")).to_have_text("breaker tripped")
        expect(page.locator("#breaker-sim .manual")).to_contain_text("forced open")
        expect(page.locator("#breaker-history")).to_contain_text("GPU node draining", timeout=5_000)

        # -- the next request through Envoy is refused --------------------------
        refused = eventually(lambda: (x := chat(stack, TEST_KEYS["premium"])).status_code == 503 and x,
                             2.0, "503 breaker_open through Envoy after the manual trip")
        assert refused.headers["x-sluice-reason"] == "breaker_open"
        # the replica reports its breaker forced open on the next status report
        expect(page.locator("#breaker-sim td.reported")).to_contain_text("open", timeout=5_000)
        page.screenshot(path=str(tmp_path / "breakers.png"), full_page=True)

        # -- the KV watermark changes on the overview, no reload ----------------
        page.click("nav >> text=Overview")
        expect(page.locator("#backend-sim")).to_contain_text("manual open")
        page.evaluate("window.sluiceNoReload = 42")
        sim_config(stack, kv_usage_override=0.93)
        expect(page.locator("#backend-sim .kv-value")).to_have_text("93 %", timeout=10_000)
        assert page.evaluate("window.sluiceNoReload") == 42, "the page was reloaded"
        # t-other's request as a free tenant: the free tier's 15-minute TTFT, with its sparkline.
        expect(page.locator("#ttft-sim-free")).to_contain_text(" ms", timeout=5_000)
        expect(page.locator("#ttft-sim-free svg.sparkline")).to_have_count(1)
        page.wait_for_timeout(1500)  # one more poll: the sparkline's newest point
        page.screenshot(path=str(tmp_path / "overview.png"), full_page=True)
        if os.environ.get("SLUICE_UPDATE_SCREENSHOT") or not README_SCREENSHOT.exists():
            README_SCREENSHOT.parent.mkdir(exist_ok=True)
            shutil.copy(tmp_path / "overview.png", README_SCREENSHOT)
        sim_config(stack, kv_usage_override=None)

        # -- reset (forced closed): traffic flows again; then clear: automatic ----
        page.click("nav >> text=Breakers")
        card = page.locator("#breaker-form-sim")
        card.locator("input[name=reason]").fill("maintenance done")
        card.locator("button[value=reset]").click()
        expect(page.locator("#breaker-form-sim .done")).to_have_text("breaker reset")
        eventually(lambda: chat(stack, TEST_KEYS["premium"]).status_code == 200, 3.0, "200 after the reset")
        card = page.locator("#breaker-form-sim")
        card.locator("input[name=reason]").fill("back to automatic")
        card.locator("button[value=clear]").click()
        expect(page.locator("#breaker-form-sim .done")).to_have_text("breaker cleared")
        expect(page.locator("#breaker-sim .manual")).to_contain_text("the automatic breaker decides")
        assert not [e for e in console_errors if "Content Security Policy" in e], console_errors
    except Exception:
        page.screenshot(path=str(tmp_path / "failure.png"), full_page=True)
        print(f"screenshots in {tmp_path}")
        raise
    finally:
        context.close()



def test_a_key_issued_in_the_console_is_accepted_by_envoy(stack: ConsoleStack, browser: Any,
                                                           tmp_path: Path) -> None:
    """An operator creates a tenant in the browser and reads its key off the page (shown
    once); Envoy accepts it within 2 s. Rotating it there: the old key is refused, the new
    one works, each within 2 s."""
    from playwright.sync_api import expect

    context, page, _ = new_page(browser)
    try:
        page.goto(stack.console_url + "/tenants")
        log_in(page)
        expect(page.locator("h1")).to_have_text("Tenants")
        page.click("#tenant-new summary")
        form = page.locator("#tenant-new form")
        form.locator("input[name=name]").fill("e2e-newco")
        form.locator("select[name=tier]").select_option("free")
        form.locator("input[name=reason]").fill("e2e signup")
        form.locator("button[type=submit]").click()
        first = page.locator("#tenant-keys .new-key-value").inner_text(timeout=10_000)
        assert re.fullmatch(r"sk-sluice-[A-Za-z0-9_-]{43}", first), first
        expect(page.locator("#tenant-e2e-newco")).to_be_visible()  # the table refreshed itself
        r = eventually(lambda: (x := chat(stack, first)).status_code == 200 and x, 2.0,
                       "a key created in the console accepted by Envoy")
        assert r.status_code == 200
        page.screenshot(path=str(tmp_path / "new-tenant.png"), full_page=True)

        digest = hashlib.sha256(first.encode()).hexdigest()
        row = page.locator(f"#key-{digest[:12]}")
        row.locator("input[name=reason]").fill("e2e rotation")
        row.locator("button[value=rotate]").click()
        expect(page.locator(f"#key-{digest[:12]}")).to_have_count(0)
        second = page.locator("#tenant-keys .new-key-value").inner_text()
        assert second != first and second.startswith("sk-sluice-")
        eventually(lambda: chat(stack, first).status_code == 401, 2.0, "the rotated-out key refused")
        eventually(lambda: chat(stack, second).status_code == 200, 2.0, "the new key accepted")
        page.goto(stack.console_url + "/audit?kind=key")
        expect(page.locator("#audit-rows")).to_contain_text("key.rotate")
    except Exception:
        page.screenshot(path=str(tmp_path / "failure.png"), full_page=True)
        print(f"screenshots in {tmp_path}")
        raise
    finally:
        context.close()
