"""The usage chunk straddling two network chunks, through Envoy's Lua filter
(response_processing usage_trailers), against bench.pacedbackend's split mode."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from bench.procs import (
    Proc,
    envoy_binary,
    free_port,
    get_json,
    tails,
    wait_http,
    wait_idle,
    wait_until,
)
from bench.response_cost import KEY, MODEL, policy
from extproc.envoy.bootstrap import BackendRoute, EnvoyOptions, write_config

pytestmark = pytest.mark.e2e


class Paced:
    def __init__(self, workdir: Path) -> None:
        self.dir = workdir
        self.backend, self.grpc, self.admin = free_port(), free_port(), free_port()
        self.envoy, self.envoy_admin = free_port(), free_port()
        self.procs: list[Proc] = []

    def start(self) -> None:
        import socket

        def tcp() -> bool:
            with socket.create_connection(("127.0.0.1", self.backend), timeout=1):
                return True

        p = Proc("paced", [sys.executable, "-m", "bench.pacedbackend", "--port", str(self.backend)],
                 self.dir / "paced.log").start()
        self.procs.append(p)
        wait_until(tcp, "paced backend", p.popen, log=p.log)
        pol = self.dir / "policies"
        pol.mkdir()
        (pol / "policy.yaml").write_text(yaml.safe_dump(policy(self.backend), sort_keys=False))
        p = Proc("extproc", [sys.executable, "-m", "extproc", "serve", "--policy", str(pol), "--grpc",
                             f"127.0.0.1:{self.grpc}", "--admin", f"127.0.0.1:{self.admin}"], self.dir / "extproc.log")
        self.procs.append(p.start())
        wait_http(f"http://127.0.0.1:{self.admin}/healthz", proc=p.popen)
        cfg = write_config(self.dir / "envoy.yaml", [BackendRoute("paced", "127.0.0.1", self.backend)],
                           EnvoyOptions(listen_port=self.envoy, admin_port=self.envoy_admin, extproc_port=self.grpc,
                                        message_timeout_ms=5000))
        p = Proc("envoy", [envoy_binary(), "-c", str(cfg), "--disable-hot-restart", "-l", "warning",
                           "--concurrency", "1"], self.dir / "envoy.log")
        self.procs.append(p.start())
        wait_http(f"http://127.0.0.1:{self.envoy_admin}/ready", proc=p.popen)

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()

    def ledger(self) -> dict[str, Any]:
        return get_json(f"http://127.0.0.1:{self.admin}/debug/state")["ledger"]

    def ask(self, usage: bool) -> httpx.Response:
        body: dict[str, Any] = {"model": MODEL, "stream": True, "max_tokens": 50,
                                "messages": [{"role": "user", "content": "hi"}]}
        if usage:
            body["stream_options"] = {"include_usage": True}
        return httpx.post(f"http://127.0.0.1:{self.envoy}/v1/chat/completions", content=json.dumps(body),
                          headers={"authorization": f"Bearer {KEY}", "content-type": "application/json",
                                   "x-paced-events": "5", "x-paced-interval-ms": "5", "x-paced-split-usage": "1"},
                          timeout=20)


@pytest.fixture(scope="module")
def paced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Paced]:
    p = Paced(tmp_path_factory.mktemp("paced"))
    try:
        p.start()
        yield p
    except Exception:
        print(tails(p.procs))
        raise
    finally:
        p.stop()


def _events(text: str) -> list[Any]:
    return [json.loads(x[6:]) for x in text.split("\n\n") if x.startswith("data: {")]


@pytest.mark.parametrize("asked", [False, True])
def test_a_usage_chunk_split_across_chunks_is_removed_whole_and_still_billed(paced: Paced, asked: bool) -> None:
    before = paced.ledger()
    r = paced.ask(usage=asked)
    assert r.status_code == 200, r.text
    assert r.text.endswith("data: [DONE]\n\n")
    events = _events(r.text)
    usage = [e for e in events if e.get("usage")]
    assert len([e for e in events if e["choices"]]) == 6  # 5 tokens + the one glued to the usage event
    assert len(usage) == (1 if asked else 0), r.text
    st = wait_idle(f"http://127.0.0.1:{paced.admin}/debug/state", 3.0, interval=0.02)
    assert st["in_flight"] == 0 and st["ledger"]["balanced"]
    # Envoy read the usage (10 prompt + 6 completion from the backend) despite the split.
    assert st["ledger"]["charged"] - before["charged"] == 10 + 5
