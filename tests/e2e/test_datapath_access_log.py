"""test_datapath's tests again, with ``response_processing: access_log``: no response
message reaches extproc, and every forwarded request settles from Envoy's gRPC access log;
then what only this mode does: the settle's source and lag, a response that outlives its
extproc, and entries that never come."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from tests.e2e.harness import TEST_KEYS, Proc, Stack, envoy_binary, running, wait_http
from tests.e2e.test_datapath import *  # noqa: F403 - the same tests, collected again here
from tests.e2e.test_datapath import auth, chat_body, post
from tests.waiting import eventually

pytestmark = pytest.mark.e2e
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running(Stack(tmp_path_factory.mktemp("access_log"), gateway={"response_processing": "access_log"})) as s:
        yield s


def metric(stack: Stack, name: str, labels: str = "") -> float:
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", stack.metrics_text(), re.M)
    return float(m.group(1)) if m else 0.0


def test_no_response_message_reaches_extproc_and_settles_come_from_the_log(stack: Stack) -> None:
    # (the endpoints whose body Sluice reads, /v1/responses and /v1/embeddings, still send it
    # their responses: counted before, unchanged after)
    phases = ("response_headers", "response_body", "response_trailers")

    def responses_seen() -> list[float]:
        return [metric(stack, "sluice_extproc_phase_seconds_count", f'{{phase="{p}"}}') for p in phases]

    seen = responses_seen()
    before = metric(stack, "sluice_access_log_entries_total", '{outcome="settled"}')
    for stream in (False, True):
        r = post(stack, chat_body(max_tokens=20, stream=stream), {**auth(), "x-sim-tokens": "12"})
        assert r.status_code == 200
    st = stack.wait_settled()
    assert st["in_flight"] == 0 and st["ledger"]["balanced"]
    assert responses_seen() == seen
    assert metric(stack, "sluice_access_log_entries_total", '{outcome="settled"}') == before + 2
    assert metric(stack, "sluice_access_log_awaiting") == 0
    # From the response's end to the settle: the access log's flush (10 ms) and its trip.
    assert 0 < metric(stack, "sluice_settle_lag_seconds_sum") / metric(stack, "sluice_settle_lag_seconds_count") < 1


def test_the_refund_shows_in_remaining_tokens_within_the_settle_lag(stack: Stack) -> None:
    headers = {**auth("free"), "x-sim-tokens": "5"}
    first = post(stack, chat_body(max_tokens=500), headers)
    assert first.status_code == 200
    reserved_left = int(first.headers["x-ratelimit-remaining-tokens"])  # with the full reservation taken

    def refunded() -> bool:
        r = post(stack, chat_body(max_tokens=1), {**auth("free"), "x-sim-tokens": "1"})
        return int(r.headers["x-ratelimit-remaining-tokens"]) > reserved_left + 400

    eventually(refunded, 2, "the first request's unused reservation was not refunded", interval=0.05)


def test_a_response_outlives_a_dead_extproc_and_the_restarted_one_holds_nothing(stack: Stack) -> None:
    body = {"model": "sim-llama-8b", "max_tokens": 60, "stream": True,
            "messages": [{"role": "user", "content": "tell me"}]}
    headers = {"authorization": f"Bearer {TEST_KEYS['premium']}", "x-sim-tokens": "60", "x-sim-tps": "60"}
    with httpx.stream("POST", stack.url + CHAT, json=body, headers=headers, timeout=20) as r:
        assert r.status_code == 200
        chunks = r.iter_bytes()
        next(chunks)
        stack.procs["extproc"].stop()
        # The ext_proc stream ended once the request was answered: nothing of the response waits on it.
        assert b"data: [DONE]" in b"".join(chunks)
    stack.start_extproc()
    eventually(lambda: post(stack, chat_body(max_tokens=5), auth()).status_code == 200, 5,
               "traffic did not recover after the restart", interval=0.1)
    assert stack.wait_settled()["in_flight"] == 0


class LostLogStack(Stack):
    """Envoy's access log goes to a port where nothing listens: every entry is lost."""

    def start_envoy(self) -> None:
        super().start_envoy()
        cfg = self.workdir / "envoy.yaml"
        doc = yaml.safe_load(cfg.read_text())
        for c in doc["static_resources"]["clusters"]:
            if c["name"].startswith("sluice_access_log"):
                address = c["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
                address["socket_address"]["port_value"] = 1
        cfg.write_text(yaml.safe_dump(doc, sort_keys=False))
        self.procs["envoy"].stop()  # and again on the edited config
        p = Proc("envoy", [envoy_binary(), "-c", str(cfg), "--disable-hot-restart", "-l", "warning",
                           "--concurrency", "1"], self.workdir / "envoy.log")
        self.procs["envoy"] = p.start()
        wait_http(f"http://127.0.0.1:{self.envoy_admin_port}/ready", proc=p.popen)


def test_lost_entries_never_leak_a_hold_and_are_not_billed_twice(tmp_path: Path) -> None:
    timeout_s = 2.0  # expiry: the route's timeout + a 10 s margin
    with running(LostLogStack(tmp_path, gateway={"response_processing": "access_log",
                                                "response_timeout_s": timeout_s})) as s:
        r = post(s, chat_body(max_tokens=40), {**auth(), "x-sim-tokens": "3"})
        assert r.status_code == 200
        st = s.state()
        assert st["in_flight"] == 1, "it waits for an entry that will not come"
        started = time.monotonic()
        st = eventually(lambda: (x := s.state())["in_flight"] == 0 and x, 20, "the request never expired",
                        interval=0.2)
        assert time.monotonic() - started < 14
        ledger = st["ledger"]
        # Nothing says what it used: the pre-charge stands, nothing outstanding, nothing held.
        assert ledger["outstanding"] == 0 and ledger["balanced"] and ledger["refunded"] == 0, ledger
        assert st["backends"]["sim"]["slots"]["in_use"] == 0 and st["backends"]["sim"]["kv"]["reserved_tokens"] == 0
        assert metric(s, "sluice_access_log_expired_total") == 1
        assert metric(s, "sluice_settles_total", '{how="expired"}') == 1
