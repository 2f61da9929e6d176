"""Sluice's own work per request, in process and without gRPC: what the handlers cost.

    python -m bench.handler_cost [--n 3000] [--rounds 5] [--policy minimal|demo] [--idle-ms MS] [--profile]

Runs ``n`` small chat completions through ``StreamProcessor`` exactly as the server would
hand them over under ``response_processing: access_log`` (the request headers, the body
and its end-of-stream chunk, then the settle from an access-log entry), and prints the
median over rounds of the microseconds per request each phase took, timed around the
handler calls. ``--policy demo`` uses the example policy of ``make demo`` (a pool with
placement and prefix affinity, three tiers) with its backends' metrics taken as fresh;
``--idle-ms`` sleeps that long before each request (not timed), as the demo's one client
does between its requests: on a VM whose idle vCPU halts, the same work then costs about
twice as much (caches and predictors cold at each wake);
``--profile`` prints the 25 most expensive functions of one more round (cProfile).

Nothing here is a target: it is the part of ``bench.overhead``'s Sluice CPU that is
Sluice's own code, measured without the noise of the rest of the stack, for comparing
changes to the handlers.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import pstats
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from bench.overhead import bench_policy
from bench.overhead_load import BODY, KEY, MODEL
from extproc.envoy import usage_record
from extproc.envoy.headers import SETTLE_KEY
from extproc.policy.schema import Policy, build_policy, hash_key
from extproc.policyfile import load_policy
from extproc.request.log_settle import LogSettles
from extproc.request.stream import StreamProcessor
from extproc.runtime.runtime import Runtime
from extproc.wire.messages import METADATA_NAMESPACE

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("request_headers", "request_body", "settle")


def _policy(name: str) -> tuple[Policy, str, str]:
    """The policy, a key it knows, and the model to ask for."""
    if name == "minimal":
        doc = bench_policy(1)
        doc["gateway"]["response_processing"] = "access_log"
        return build_policy(doc), KEY, MODEL
    p = load_policy(str(ROOT / "policies"))
    gw = p.gateway.__class__(**{**p.gateway.__dict__, "response_processing": "access_log"})
    p = p.__class__(**{**p.__dict__, "gateway": gw})
    top = max(x.priority for x in p.tiers.values())
    tenant = next(t for t in p.tenants.values() if p.tiers[t.tier].priority == top)
    key = "sk-bench-handler"
    # Its budgets lifted: thousands of requests a second would spend any real tier's.
    big = 10 ** 12
    tiers = {name: replace(t, tpm=big, rpm=big, burst_tokens=big) for name, t in p.tiers.items()}
    tenant = replace(tenant, tpm=None, rpm=None)
    p = p.__class__(**{**p.__dict__, "tiers": tiers, "tenants": {**p.tenants, tenant.name: tenant},
                       "by_key": {**p.by_key, hash_key(key): tenant.name}, "_limits": {}})
    return p, key, p.backends[0].models[0].name


def _messages(key: str, model: str) -> list[pb.ProcessingRequest]:
    hm = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in (
        (":path", "/v1/chat/completions"), (":method", "POST"), ("authorization", f"Bearer {key}"),
        ("content-type", "application/json"), ("content-length", str(len(BODY))), ("x-request-id", "0" * 36))])
    head = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=hm))
    head.protocol_config.request_body_mode = processing_mode_pb2.ProcessingMode.STREAMED
    head.protocol_config.send_body_without_waiting_for_header_response = True
    body = json.loads(BODY)
    body["model"] = model
    raw = json.dumps(body, separators=(",", ":")).encode()
    return [head, pb.ProcessingRequest(request_body=pb.HttpBody(body=raw)),
            pb.ProcessingRequest(request_body=pb.HttpBody(end_of_stream=True))]


def _entry(settle: str) -> accesslog_pb2.HTTPAccessLogEntry:
    e = accesslog_pb2.HTTPAccessLogEntry()
    c = e.common_properties
    c.metadata.filter_metadata[METADATA_NAMESPACE].fields[SETTLE_KEY].string_value = settle
    e.response.response_code.value = 200
    c.time_to_first_upstream_rx_byte.FromNanoseconds(300_000)
    c.time_to_last_downstream_tx_byte.FromNanoseconds(400_000)
    c.upstream_remote_address.socket_address.address = "127.0.0.1"
    c.upstream_remote_address.socket_address.port_value = 8000
    e.response.response_headers["content-type"] = "application/json"
    u = usage_record.TokenUsage()
    u.input_tokens.value, u.output_tokens.value, u.total_tokens.value = 31, 7, 38
    packed = c.metadata.typed_filter_metadata[usage_record.USAGE_NAMESPACE]
    packed.type_url, packed.value = "type.googleapis.com/" + usage_record.TOKEN_USAGE, u.SerializeToString()
    return e


async def _one(rt: Runtime, settles: LogSettles, messages: list[pb.ProcessingRequest],
               took: dict[str, float]) -> None:
    clock = time.perf_counter
    sp = StreamProcessor(rt, peer=None, log_settles=settles)  # type: ignore[arg-type]
    t0 = clock()
    sp.handle("request_headers", messages[0])
    t1 = clock()
    for m in messages[1:]:
        async for _ in sp.handle_body(m):
            pass
    t2 = clock()
    sp.end("disconnect")
    assert sp.awaiting_log is not None, "not forwarded"
    settles.consume([_entry(sp.awaiting_log)])
    t3 = clock()
    took["request_headers"] += t1 - t0
    took["request_body"] += t2 - t1
    took["settle"] += t3 - t2


def _fresh(rt: Runtime) -> None:
    """Every engine scraped just now, idle (what the monitor's scrapes would say)."""
    now = rt.clock()
    for be in rt.backends.values():
        be.wm.observe(0.0, 0.0, now)
        if be.endpoints is not None:
            for st in be.endpoints.by_key.values():
                st.wm.observe(0.0, 0.0, now)


class _Clock:
    """The runtime's clock: 1 ms per request, whatever the wall clock does (under valgrind or
    a profiler the work is the same as without; the engines' metrics stay fresh)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def measure(policy: str, n: int, rounds: int, profile: bool = False, idle_s: float = 0.0) -> dict[str, list[float]]:
    p, key, model = _policy(policy)
    clock = _Clock()
    rt = Runtime(p, clock=clock)
    settles = LogSettles("bench", rt.clock, rt.metrics)
    messages = _messages(key, model)

    async def batch(count: int) -> dict[str, float]:
        took = dict.fromkeys(PHASES, 0.0)
        for i in range(count):
            clock.now += 0.001
            if i % 200 == 0:
                _fresh(rt)
            if idle_s:
                await asyncio.sleep(idle_s)
            await _one(rt, settles, messages, took)
        return took

    asyncio.run(batch(200))  # warm: tokenizer, caches
    out: dict[str, list[float]] = {k: [] for k in PHASES}
    for _ in range(rounds):
        took = asyncio.run(batch(n))
        for k, v in took.items():
            out[k].append(v / n * 1e6)
    if profile:
        prof = cProfile.Profile()
        prof.enable()
        asyncio.run(batch(n))
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    assert rt.status()["ledger"]["balanced"]
    rt.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.handler_cost", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--policy", choices=["minimal", "demo"], default="minimal")
    ap.add_argument("--idle-ms", type=float, default=0.0, help="idle before each request (not timed)")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args(argv)
    got = measure(args.policy, args.n, args.rounds, args.profile, args.idle_ms / 1000)
    rows: list[Any] = [(k, statistics.median(v), min(v)) for k, v in got.items()]
    idle = f", {args.idle_ms:g} ms idle before each" if args.idle_ms else ""
    print(f"| phase ({args.policy} policy{idle}) | median µs / request | best round |\n|---|---|---|")
    for k, med, best in rows:
        print(f"| {k} | {med:.1f} | {best:.1f} |")
    print(f"| total | {sum(r[1] for r in rows):.1f} | {sum(r[2] for r in rows):.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
