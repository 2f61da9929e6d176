"""Envoy stops sending ext_proc streams to a dead or draining replica (three behind one Envoy).

Before the ext_proc cluster was health-checked, a SIGKILLed replica kept its third of
the streams, each answered 503, until it came back. Now Envoy's gRPC health checks
(extproc/wire/health.py) and outlier detection take it out: steady traffic, one replica
SIGKILLed, and no request that starts 3 s after the kill fails. A replica sent SIGTERM
answers NOT_SERVING first and exits only once Envoy has moved away: nothing fails.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.e2e import harness
from tests.e2e.fleet import ClientThreads, Fleet, start_fleet, stop_fleet
from tests.e2e.harness import eventually, get_json
from tests.e2e.test_datapath import auth, chat_body

pytestmark = pytest.mark.e2e

REPLICAS = 3
CLIENTS = 6


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    f = start_fleet(tmp_path_factory.mktemp("health"), REPLICAS, harness.test_policy)
    eventually(lambda: all(healthy(f).values()) and len(healthy(f)) == REPLICAS, 10, "Envoy sees 3 healthy replicas")
    yield f
    stop_fleet(f)


def healthy(f: Fleet) -> dict[int, bool]:
    """Envoy's view of the ext_proc cluster: replica port -> healthy (no failure flag set)."""
    doc = get_json(f"http://127.0.0.1:{f.envoy_admin_port}/clusters?format=json")
    (cluster,) = [c for c in doc["cluster_statuses"] if c["name"] == "sluice_extproc"]
    out = {}
    for h in cluster["host_statuses"]:
        flags = {k for k, v in h["health_status"].items() if v is True}
        out[h["address"]["socket_address"]["port_value"]] = h["health_status"].get("eds_health_status") == "HEALTHY" \
            and not flags
    return out


class Traffic(ClientThreads):
    """Short requests (~0.1 s) from ``CLIENTS`` threads; keeps (start, end, outcome) per request."""

    def __init__(self, f: Fleet) -> None:
        super().__init__(CLIENTS)
        self.f = f
        self.done: list[tuple[float, float, str]] = []

    def _run(self) -> None:
        headers = {"content-type": "application/json", **auth("premium"), "x-sim-tokens": "8", "x-sim-tps": "80"}
        with httpx.Client(timeout=20) as c:
            while not self._stop.is_set():
                t0 = time.monotonic()
                try:
                    r = c.post(f"{self.f.url}/v1/chat/completions", json=chat_body(max_tokens=8), headers=headers)
                    outcome = str(r.status_code) + (
                        "" if r.status_code == 200 else f" {r.headers.get('x-sluice-reason')}"
                    )
                except httpx.HTTPError as exc:
                    outcome = type(exc).__name__
                self.done.append((t0, time.monotonic(), outcome))
                time.sleep(0.01)

    def failed(self, after: float, before: float = float("inf")) -> list[tuple[float, float, str]]:
        return [d for d in self.done if after <= d[0] < before and d[2] != "200"]


def _settled(f: Fleet) -> None:
    def idle() -> Any:
        sts = f.states()
        return sts if all(st["in_flight"] == 0 for st in sts) else None

    for st in eventually(idle, 30, "every replica settled"):
        assert st["ledger"]["outstanding"] == 0 and st["ledger"]["balanced"], st["ledger"]


def _signal(f: Fleet, victim: int, sig: signal.Signals, what: str) -> tuple[float, float]:
    """Send ``sig`` to replica ``victim`` (reaping it if killed); wait until Envoy takes it out of balancing.

    Returns (when it was signalled, seconds until Envoy had it out)."""
    f.procs[f.name(victim)].send_signal(sig)
    at = time.monotonic()
    if sig == signal.SIGKILL:
        f.procs[f.name(victim)].reap()
    eventually(lambda: not healthy(f)[f.grpc_ports[victim]], 5, f"Envoy took the {what} replica out", interval=0.05)
    return at, time.monotonic() - at


def _restart(f: Fleet, victim: int) -> None:
    f.start_replica(victim)
    eventually(lambda: healthy(f)[f.grpc_ports[victim]], 10, "the restarted replica is healthy again in Envoy",
               interval=0.1)


def test_a_killed_replica_gets_no_new_streams_within_3_s(fleet: Fleet) -> None:
    f = fleet
    victim = 2
    port = f.grpc_ports[victim]
    with Traffic(f) as traffic:
        time.sleep(2.0)
        assert not traffic.failed(0), traffic.failed(0)  # all well before
        killed, out_after = _signal(f, victim, signal.SIGKILL, "dead")
        time.sleep(5.0)
        stopped = time.monotonic()
    in_flight = [d for d in traffic.done if d[0] < killed < d[1] and d[2] != "200"]
    gap = traffic.failed(killed)
    late = traffic.failed(killed + 3.0)
    started_after = [d for d in traffic.done if killed <= d[0] < stopped]
    last = max((d[0] - killed for d in gap), default=0.0)
    outcomes: dict[str, int] = {}
    for d in gap:
        outcomes[d[2]] = outcomes.get(d[2], 0) + 1
    print(f"\nreplica on :{port} SIGKILLed: out of Envoy's balancing after {out_after:.2f} s; of "
          f"{len(started_after)} requests started after the kill {len(gap)} failed ({outcomes}), the last one "
          f"started {last * 1e3:.0f} ms after the kill; {len(in_flight)} in flight on it at the kill failed")
    assert not late, late
    assert len(started_after) >= 100, len(started_after)  # the survivors kept serving
    _restart(f, victim)
    precharged = get_json(f"{f.admin(victim)}/debug/state")["ledger"]["precharged"]
    with Traffic(f) as traffic:
        eventually(lambda: get_json(f"{f.admin(victim)}/debug/state")["ledger"]["precharged"] > precharged, 10,
                   "the restarted replica gets streams again")
    assert not traffic.failed(0), traffic.failed(0)
    _settled(f)


def test_a_replica_sent_sigterm_drains_without_a_failed_request(fleet: Fleet) -> None:
    f = fleet
    victim = 1
    port = f.grpc_ports[victim]
    with Traffic(f) as traffic:
        time.sleep(1.5)
        termed, out_after = _signal(f, victim, signal.SIGTERM, "draining")
        f.procs[f.name(victim)].reap(10)
        exited = time.monotonic() - termed
        time.sleep(1.0)
    log = f.procs[f.name(victim)].log.read_text()
    started_after = [d for d in traffic.done if d[0] >= termed]
    print(f"\nreplica on :{port} SIGTERMed: out of Envoy's balancing after {out_after:.2f} s, exited after "
          f"{exited:.2f} s; {len(started_after)} requests started after, failed: {traffic.failed(0)}")
    assert f.procs[f.name(victim)].popen.returncode == 0
    assert "NOT_SERVING seen by the health checkers" in log
    assert not traffic.failed(0), traffic.failed(0)
    assert exited < 5.0, exited
    _restart(f, victim)
    _settled(f)
