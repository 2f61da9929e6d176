"""What the pool's cluster costs per request, and what one re-pick adds (Envoy 1.40, loopback).

One Envoy with the router only (no ext_proc: the client sets ``x-sluice-endpoint`` itself,
so only the cluster differs), three routes chosen by a header:

- ``odst``: the ORIGINAL_DST cluster pools used before (``use_http_header``),
- ``eds``: the pool cluster of ``extproc.envoy.clusters.pool_cluster`` (EDS file +
  override_host), its route with the re-pick retry policy; header ``live,closed``,
- ``repick``: the same, header ``closed,live``: every request is refused by a port on
  loopback first and retried on the live one.

The backend is ``bench.fastbackend``. Requests are sequential on one keep-alive client
connection, the three cases interleaved in rounds so load drifts hit all alike.

    python -m bench.repick_latency --requests 200
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import betterproto2

from bench.metrics import pct
from bench.procs import ProcGroup, free_port
from extproc.envoy.clusters import pool_cluster
from extproc.envoy.eds import render, write_if_changed
from extproc.envoy.headers import ENDPOINT_HEADER

CASES = ("odst", "eds", "repick")


def config(eds_dir: Path, listen: int, admin: int) -> dict[str, Any]:
    eds = pool_cluster("eds", datetime.timedelta(seconds=1), str(eds_dir)).to_dict(casing=betterproto2.Casing.SNAKE)
    eds["typed_extension_protocol_options"] = {}
    odst = {"name": "odst", "type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED", "connect_timeout": "1s",
            "original_dst_lb_config": {"use_http_header": True, "http_header_name": ENDPOINT_HEADER}}
    retry = {"retry_on": "connect-failure", "num_retries": 1,
             "retry_back_off": {"base_interval": "0.001s", "max_interval": "0.001s"}}

    def route(case: str, cluster: str) -> dict[str, Any]:
        action: dict[str, Any] = {"cluster": cluster, "timeout": "0s"}
        if cluster == "eds":
            action["retry_policy"] = retry
        return {"match": {"prefix": "/", "headers": [{"name": "x-case", "string_match": {"exact": case}}]},
                "route": action}

    hcm = {"@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3."
                    "HttpConnectionManager",
           "stat_prefix": "bench", "route_config": {"virtual_hosts": [{"name": "v", "domains": ["*"], "routes": [
               route("odst", "odst"), route("eds", "eds"), route("repick", "eds")]}]},
           "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {
               "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}]}
    return {
        "node": {"id": "bench", "cluster": "bench"},
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin}}},
        "static_resources": {
            "listeners": [
                {
                    "name": "l",
                    "address": {"socket_address": {"address": "127.0.0.1", "port_value": listen}},
                    "filter_chains": [
                        {"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}
                    ],
                }
            ],
            "clusters": [odst, eds],
        },
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=200, help="per case")
    args = ap.parse_args(argv)
    backend, closed, listen, admin = free_port(), free_port(), free_port(), free_port()
    live, dead = f"127.0.0.1:{backend}", f"127.0.0.1:{closed}"
    headers = {"odst": live, "eds": f"{live},{dead}", "repick": f"{dead},{live}"}
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        write_if_changed(d / "eds.eds.yaml", render("eds", [live, dead]))
        group = ProcGroup(d)
        try:
            group.start_fast_backend(backend)
            group.start_envoy("envoy", config(d, listen, admin), admin, 1)
            conn = http.client.HTTPConnection("127.0.0.1", listen, timeout=10)
            times: dict[str, list[float]] = {c: [] for c in CASES}
            body = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'
            for i in range(args.requests + 20):  # the first 20 rounds warm up
                for case in CASES:
                    t0 = time.perf_counter()
                    conn.request("POST", "/v1/chat/completions", body=body,
                                 headers={"x-case": case, ENDPOINT_HEADER: headers[case],
                                          "content-type": "application/json"})
                    r = conn.getresponse()
                    r.read()
                    dt = time.perf_counter() - t0
                    assert r.status == 200, (case, r.status)
                    if i >= 20:
                        times[case].append(dt * 1000)
            conn.close()
            stats = http.client.HTTPConnection("127.0.0.1", admin, timeout=5)
            stats.request("GET", "/stats?filter=cluster.eds.upstream_(rq_retry|cx_connect_fail)$")
            counters = stats.getresponse().read().decode().strip().replace("\n", ", ")
        finally:
            group.stop()
    print(f"{args.requests} sequential requests per case, interleaved; ms")
    print("| case | p50 | p90 | p99 | mean |")
    print("| --- | --- | --- | --- | --- |")
    for case in CASES:
        xs = times[case]
        print(f"| {case} | {statistics.median(xs):.3f} | {pct(xs, 0.9):.3f} | {pct(xs, 0.99):.3f} | "
              f"{statistics.fmean(xs):.3f} |")
    print(f"Envoy: {counters}")
    print(
        "re-pick adds (p50 repick - p50 eds): "
        f"{statistics.median(times['repick']) - statistics.median(times['eds']):.3f} ms"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
