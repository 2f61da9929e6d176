"""`make demo` as a newcomer sees it: a healthy start prints one line and the banner, and
nothing else (an allow-list: a new warning fails here). The banner holds the console's
login, not the replicas' token. The demo's engines accept the context windows the demo's
policy declares. With three replicas, killing one replica and one engine leaves the rest
serving, and the demo names what died.
"""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.demo_run import DemoRun
from tests.e2e.harness import eventually

pytestmark = pytest.mark.e2e

# Every line a healthy start may print before the banner; anything else is noise to remove
# (or, if it must be there, to add here with the reason).
EXPECTED_BEFORE_BANNER = [
    re.compile(
        r"starting the Sluice demo: 3 simulated engines, the console, 1 extproc replica and Envoy "
        r"\(output in \S+/log/\)"
    ),
    re.compile(
        r"starting the Sluice demo: 3 simulated engines, the console, 3 extproc replicas sharing a "
        r"redis-server and Envoy \(output in \S+/log/\)"
    ),
    re.compile(r""),  # the blank line that opens the banner
]
PREMIUM = {"authorization": "Bearer sk-demo-premium"}


def unexpected(lines: list[str]) -> list[str]:
    return [ln for ln in lines if not any(rx.fullmatch(ln) for rx in EXPECTED_BEFORE_BANNER)]


def chat(
    demo: DemoRun, model: str = "sim-llama-8b", content: str = "hello", max_tokens: int = 8
) -> httpx.Response:
    body = {
        "model": model,
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": content}],
    }
    return httpx.post(
        f"{demo.client_url}/v1/chat/completions", json=body, headers=PREMIUM, timeout=60
    )


def log_in(demo: DemoRun) -> httpx.Client:
    c = httpx.Client(base_url=demo.console_url, timeout=10)
    token = re.search(r'name="csrf_token" value="([^"]+)"', c.get("/login").text)
    assert token
    name, password = demo.login
    r = c.post("/login", data={"name": name, "password": password, "csrf_token": token.group(1)})
    assert r.status_code == 303, r.text
    return c


@pytest.fixture
def demo(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[DemoRun]:
    run = DemoRun(tmp_path / "var", replicas=getattr(request, "param", 1)).start()
    try:
        run.wait_banner()
        yield run
    finally:
        code = run.stop()
        assert code == 0, run.output


def test_a_healthy_start_prints_one_line_then_the_banner_with_the_login(demo: DemoRun) -> None:
    before = demo.before_banner()
    assert unexpected(before) == [], "\n".join(before)
    assert len(before) == 2 and before[0].startswith("starting the Sluice demo")
    token = (demo.workdir / "console-token").read_text().strip()
    assert token and token not in demo.output, "the replica token reached the terminal"
    assert oct(os.stat(demo.workdir / "console-token").st_mode & 0o777) == "0o600"
    console = log_in(demo)  # the banner's login works
    assert console.get("/").status_code == 200
    console.close()
    assert chat(demo).status_code == 200


def test_the_long_context_model_is_served_as_long_as_the_policy_declares(demo: DemoRun) -> None:
    # sim-llama-8b-long: 32k in the policy; a 20k-token prompt passes Sluice and the engine.
    long = chat(demo, "sim-llama-8b-long", "hello " * 20_000)
    assert long.status_code == 200, long.text
    assert long.json()["usage"]["prompt_tokens"] > 16_384  # more than the smaller engine could hold
    # sim-llama-8b keeps its 8k window: Sluice refuses before any engine sees it.
    short = chat(demo, "sim-llama-8b", "hello " * 9_000)
    assert short.status_code == 400 and short.headers["x-sluice-reason"] == "context_length", (
        short.text
    )


@pytest.mark.parametrize("demo", [3], indirect=True)
def test_three_replicas_keep_serving_when_a_replica_and_an_engine_die(demo: DemoRun) -> None:
    before = demo.before_banner()
    assert unexpected(before) == [], "\n".join(before)
    assert chat(demo).status_code == 200
    replica = demo.child("--replica-id", "demo-2")
    engine = demo.child("bench.simbackend", "--port", str(demo.engine_port(2)))
    os.kill(replica, signal.SIGKILL)
    os.kill(engine, signal.SIGKILL)
    demo.wait_line(
        rf"^demo: extproc replica demo-2 \(pid {replica}\) exited, killed by SIGKILL: "
        r"Envoy sends its streams to the other replicas; the rest keep running\."
    )
    demo.wait_line(
        rf"^demo: engine 2 of the sim pool \(127\.0\.0\.1:{demo.engine_port(2)}\) \(pid {engine}\) "
        r"exited, killed by SIGKILL: Sluice ejects it from the pool"
    )
    assert demo.proc is not None and demo.proc.poll() is None, "the demo stopped"

    def all_served() -> bool:
        return [chat(demo).status_code for _ in range(10)] == [200] * 10

    eventually(all_served, 60, "ten requests in a row served by the surviving replicas and engine")
    ep = f"127.0.0.1:{demo.engine_port(2)}"

    def ejected() -> bool:
        state = httpx.get(f"{demo.admin_url(1)}/debug/state", timeout=5).json()
        return any(
            e["address"] == ep and not e["usable"] for e in state["backends"]["sim"]["endpoints"]
        )

    eventually(ejected, 30, f"{ep} ejected from the pool on demo-1")
