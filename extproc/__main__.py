"""Command line: ``python -m extproc {serve,validate,envoy-config,hash-key}``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any

from extproc.policy.schema import PolicyError, hash_key
from extproc.policyfile import load_policy

if TYPE_CHECKING:
    from extproc.envoy.eds import EdsWriter
    from extproc.runtime.runtime import Runtime
    from extproc.service.kube_pool import ClusterPool
    from extproc.service.picker_server import PickerServers


def _hostport(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    return host or "127.0.0.1", int(port)


EDS_DIR_ENV = "SLUICE_EDS_DIR"  # serve's --eds-dir when the option is not given


async def _serve(args: argparse.Namespace) -> int:
    from extproc.request.log_settle import LogSettles
    from extproc.runtime.runtime import Runtime
    from extproc.service.admin import start_admin
    from extproc.service.monitor import run_monitor
    from extproc.service.prober import run_prober
    from extproc.service.reloader import watch_policy_dir
    from extproc.service.server import run_log_expiry, serve
    from extproc.service.ticker import run_ticker
    from extproc.wire.health import Health

    policy = load_policy(args.policy)
    worker = args.worker_index is not None
    replica_id = f"{args.replica_id}-{args.worker_index}" if worker else args.replica_id
    runtime = Runtime(policy, replica_id=replica_id, share=args.workers if worker else 1)
    if worker and args.workers > 1 and not runtime.shared_state:
        from extproc.service.workers import refusal

        print(refusal(args.workers, shared_state=False), file=sys.stderr)
        runtime.close()
        return 2
    client = None
    if args.console_url:
        from extproc.service.console_client import ConsoleClient

        token = args.console_token or os.environ.get("SLUICE_CONSOLE_TOKEN", "")
        token_file = args.console_token_file or os.environ.get("SLUICE_CONSOLE_TOKEN_FILE")
        if not args.console_token and token_file:
            # A file (a container secret) beats the variable: it is the more deliberate choice.
            token = Path(token_file).read_text(encoding="utf-8").strip().splitlines()[0].strip()
        client = ConsoleClient(runtime, args.console_url, token, replica_id)
        try:
            # Start from the console's policy when it answers; the files are the fallback.
            await asyncio.wait_for(client.fetch_policy_once(), timeout=5)
        except Exception as exc:  # noqa: BLE001 - any failure: start from files, keep polling
            print(f"console not reachable at start ({exc}); using {args.policy} until it is", flush=True)
        else:
            try:
                await asyncio.wait_for(client.fetch_spend_once(), timeout=5)
            except Exception as exc:  # noqa: BLE001 - the status reports bring it later
                print(f"budget spend not read from the console at start ({exc})", flush=True)
    leases = None
    if runtime.slot_leases is not None:
        # A replica admits from its leased part of each backend's pool: lease before serving.
        await runtime.first_leases()
        leases = asyncio.create_task(runtime.run_leases())
    eds_writer = _eds_writer(runtime, args.eds_dir)
    ghost, gport = _hostport(args.grpc)
    ahost, aport = _hostport(args.admin)
    health = Health()
    # Envoy's access-log entries come back to the process that forwarded the request,
    # by the sink key in its metadata: this endpoint as Envoy's config names it.
    log_settles = LogSettles(args.advertise or f"{ghost}:{gport}", runtime.clock, runtime.metrics)
    server = await serve(runtime, ghost, gport, health=health, log_settles=log_settles, stack=args.grpc_stack)
    expiry = asyncio.create_task(run_log_expiry(log_settles, runtime.clock))
    admin = await start_admin(runtime, ahost, aport)
    cluster = _cluster_pool(runtime, args)
    picker = await _start_picker(runtime, args, cluster)
    if cluster is not None:
        if picker is not None:
            from extproc.wire.health import NOT_SERVING, SERVING

            picker.health.status = NOT_SERVING  # ready once the pool and its pods are listed
            cluster.on_ready = lambda: setattr(picker.health, "status", SERVING)
        cluster.start()
    if client is None:
        watcher = asyncio.create_task(watch_policy_dir(runtime, Path(args.policy), args.reload_interval))
    else:
        watcher = asyncio.create_task(client.run())
    monitor = asyncio.create_task(run_monitor(runtime))
    ticker = asyncio.create_task(run_ticker(runtime))  # queue deadlines and pumping
    # the breakers' verdicts without waiting on traffic
    prober = asyncio.create_task(run_prober(runtime))
    eds = asyncio.create_task(_keep_eds(runtime, eds_writer)) if eds_writer is not None else None
    if os.environ.get("SLUICE_GC_FREEZE", "1") == "1":
        import gc

        gc.collect()
        gc.freeze()
    print(f"sluice extproc: gRPC {ghost}:{gport} ({args.grpc_stack}), admin http://{ahost}:{aport}/metrics",
          flush=True)
    if picker is not None:
        print(f"sluice picker: ext_proc {args.picker} ({'plaintext' if args.picker_plaintext else 'TLS'}), "
              f"health {args.picker_health}, metrics {args.picker_metrics}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    # NOT_SERVING first, still serving: Envoy moves new streams to the other replicas
    # before this one stops accepting them (at most (threshold + 1) health intervals).
    gw = runtime.policy.gateway
    drains = [health.drain(gw.extproc_health_interval_s, gw.extproc_unhealthy_threshold)]
    if picker is not None:
        drains.append(picker.health.drain(gw.extproc_health_interval_s, gw.extproc_unhealthy_threshold))
    waited = max(await asyncio.gather(*drains))
    logging.getLogger("sluice.server").info("draining: NOT_SERVING seen by the health checkers after %.2f s",
                                            waited)
    watcher.cancel()
    monitor.cancel()
    ticker.cancel()
    prober.cancel()
    expiry.cancel()
    if eds is not None:
        eds.cancel()
    if leases is not None:
        leases.cancel()
    # Let in-flight streams finish their current message; Envoy retries nothing, so be brief.
    await server.stop(grace=2)
    if cluster is not None:
        cluster.stop()
    if picker is not None:
        await picker.stop(grace=2)
    await admin.cleanup()
    runtime.close()
    return 0


def _off_or_hostport(value: str) -> tuple[str, int] | None:
    return None if value in ("", "off") else _hostport(value)


def _cluster_pool(runtime: Runtime, args: argparse.Namespace) -> ClusterPool | None:
    """``--inference-pool``: a pool's endpoints from the cluster (extproc.service.kube_pool)."""
    if not args.inference_pool:
        return None
    from extproc.service.kube_pool import ClusterPool, PoolRef, api_client

    ref = PoolRef.parse(args.inference_pool, os.environ.get("POD_NAMESPACE", "default"))
    if ref.backend not in {b.name for b in runtime.policy.backends if b.is_pool}:
        raise SystemExit(f"--inference-pool: {ref.backend!r} is not a pool of the policy (a backend with endpoints:)")
    return ClusterPool(runtime, ref, api_client(args.kubeconfig), on_ready=lambda: None)


async def _start_picker(runtime: Runtime, args: argparse.Namespace,
                        cluster: ClusterPool | None = None) -> PickerServers | None:
    """``--picker``: the Inference Extension endpoint picker's ports (extproc.service.picker_server)."""
    if not args.picker:
        return None
    from extproc.request.picker import PickerOptions
    from extproc.service.picker_server import PickerPorts, start_picker

    ports = PickerPorts(grpc=_hostport(args.picker), health=_off_or_hostport(args.picker_health),
                        metrics=_off_or_hostport(args.picker_metrics), plaintext=args.picker_plaintext,
                        cert_file=args.picker_cert, key_file=args.picker_key, stack=args.picker_stack,
                        options=PickerOptions(fallback_list=args.picker_fallback_list,
                                              objective_tier=cluster.objective_tier if cluster else None))
    return await start_picker(runtime, ports)


def _run(main: Coroutine[Any, Any, int]) -> int:
    """The process's event loop: uvloop's. Measured on an ext_proc stream of three messages
    each way, it cut the server's CPU per stream by 13 % (647 -> 560 µs, median of 9 rounds,
    bench notes in docs/round-trips.md); grpc.aio runs on it unchanged. asyncio's own loop
    where uvloop is not installed."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def _eds_writer(runtime: Runtime, directory: str | None) -> EdsWriter | None:
    """``--eds-dir`` (or ``$SLUICE_EDS_DIR``): Envoy's pool endpoint files, written now
    (before the replica reports healthy) and again after every policy swap (extproc.envoy.eds)."""
    directory = directory or os.environ.get(EDS_DIR_ENV)
    if not directory:
        return None
    from extproc.envoy.eds import EdsWriter  # not imported (nor envoy_data_plane) without it

    writer = EdsWriter(directory)
    writer.sync(runtime.backends)
    runtime.on_swap.append(lambda: writer.sync(runtime.backends))
    return writer


async def _keep_eds(runtime: Runtime, writer: EdsWriter, interval_s: float = 0.2) -> None:
    """Between swaps: a name that resolved later, a drained endpoint forgotten."""
    while True:
        await asyncio.sleep(interval_s)
        writer.sync(runtime.backends)


def _shared_store(policy_dir: str) -> bool:
    """Whether gateway.state (or $SLUICE_REDIS_URL) names a store the workers share.

    Read from the policy files (with ``--console-url`` they are the fallback policy);
    each worker checks again with the policy it starts from.
    """
    from extproc.store import ENV_URL, state_url

    try:
        return state_url(load_policy(policy_dir).gateway) != "memory"
    except (PolicyError, OSError):
        return bool(os.environ.get(ENV_URL))


def _validate(args: argparse.Namespace) -> int:
    try:
        policy = load_policy(args.policy)
    except PolicyError as exc:
        for p in exc.problems:
            print(p, file=sys.stderr)
        return 1
    print(f"ok: {len(policy.backends)} backends, {len(policy.tiers)} tiers, {len(policy.tenants)} tenants")
    return 0


def _envoy_config(args: argparse.Namespace) -> int:
    from extproc.envoy.bootstrap import BackendRoute, EnvoyOptions, policy_options, write_config

    policy = load_policy(args.policy)
    lhost, lport = _hostport(args.listen)
    (ehost, eport), *more = [(h, p + i) for h, p in (_hostport(a) for a in args.extproc.split(","))
                             for i in range(max(1, args.extproc_workers))]
    dhost, dport = _hostport(args.extproc_admin)
    from extproc.envoy.eds import write_policy

    eds_dir = args.eds_dir or str(Path(args.output).parent)
    opts = EnvoyOptions(listen_host=lhost, listen_port=lport, admin_port=args.admin_port,
                        extproc_host=ehost, extproc_port=eport, extproc_more=tuple(more),
                        drain_host=dhost, drain_port=dport, eds_dir=eds_dir,
                        **policy_options(policy))  # type: ignore[arg-type]
    routes = [
        BackendRoute(b.name, b.host, b.port, tuple(m.name for m in b.models), pool=b.is_pool) for b in policy.backends
    ]
    if args.pieces:
        from extproc.envoy.pieces import render_pieces_yaml

        out = Path(args.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(render_pieces_yaml(routes, opts))
        print(f"wrote {args.output}")
        return 0
    write_config(args.output, routes, opts)
    print(f"wrote {args.output}")
    if not args.no_eds_files:
        for path in write_policy(eds_dir, policy):
            print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m extproc", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="run the ext_proc gRPC server")
    s.add_argument("--policy", default="policies", help="directory of policy YAML files")
    s.add_argument("--grpc", default="127.0.0.1:50051")
    s.add_argument("--admin", default="127.0.0.1:9100")
    s.add_argument("--grpc-stack", choices=("h2", "grpcio"), default="h2",
                   help="what serves the ext_proc port: Sluice's HTTP/2 server on the event loop (h2) or "
                   "grpc.aio (grpcio); see docs/round-trips.md")
    s.add_argument("--reload-interval", type=float, default=1.0)
    s.add_argument("--log-level", default="INFO")
    s.add_argument("--console-url", help="take the policy from the console and report status to it")
    s.add_argument("--console-token", help="API token for the console (visible in ps: prefer "
                   "--console-token-file or $SLUICE_CONSOLE_TOKEN)")
    s.add_argument("--console-token-file", help="read the console's API token from this file "
                   "(or $SLUICE_CONSOLE_TOKEN_FILE)")
    s.add_argument("--replica-id", default=socket.gethostname(), help="this replica's name in the console")
    s.add_argument("--workers", type=int, default=1,
                   help="processes, worker i on the gRPC port + i (Envoy's cluster lists each: envoy-config "
                   "--extproc-workers N) and its admin on the admin port + i, reporting as <replica-id>-<i>; "
                   "N > 1 needs a shared store (gateway.state or $SLUICE_REDIS_URL) and gives each worker "
                   "floor(limit / N) of the slots, KV and concurrency caps")
    s.add_argument("--advertise", help="this process's gRPC address as Envoy's config names it (host:port; "
                   "default: --grpc), the key by which Envoy's access log comes back to it "
                   "(response_processing: access_log, with several ext_proc endpoints)")
    s.add_argument("--eds-dir", help="write each pool's endpoint set for Envoy's EDS cluster to "
                   f"DIR/<pool>.eds.yaml on every reload (or ${EDS_DIR_ENV}); without it nothing is "
                   "written and Envoy's endpoint set must come from elsewhere")
    s.add_argument("--picker", metavar="HOST:PORT", help="also serve as a Gateway API Inference Extension "
                   "endpoint picker on this address (GIE's port: 9002); see docs/picker.md")
    s.add_argument("--picker-health", default="0.0.0.0:9003", metavar="HOST:PORT|off",
                   help="the picker's plaintext gRPC health port (liveness, readiness, ext_proc)")
    s.add_argument("--picker-metrics", default="0.0.0.0:9090", metavar="HOST:PORT|off",
                   help="the picker's Prometheus port (the admin port's /metrics, again)")
    s.add_argument("--picker-plaintext", action="store_true",
                   help="serve the picker without TLS (gateways' reference configs expect TLS)")
    s.add_argument("--picker-stack", choices=("h2", "grpcio"), default="h2",
                   help="what serves the picker's ext_proc port: Sluice's HTTP/2 server on the event loop "
                   "(h2, ~4x less CPU per streamed chunk) or grpc.aio (grpcio); see docs/picker.md")
    s.add_argument("--picker-cert", help="the picker's TLS certificate (PEM); without it one is generated")
    s.add_argument("--picker-key", help="the key of --picker-cert (PEM)")
    s.add_argument("--picker-fallback-list", action="store_true",
                   help="name the second choice after the pick (ip:port,ip:port): only for a gateway "
                   "whose pool honours a list (Istio's override_host); ORIGINAL_DST pools answer 503 to one")
    s.add_argument("--inference-pool", metavar="BACKEND=[NAMESPACE/]NAME",
                   help="take the pool BACKEND's endpoints from this InferencePool's ready pods, watched with "
                   "the Kubernetes API (in a pod: its service account; NAMESPACE defaults to $POD_NAMESPACE)")
    s.add_argument("--kubeconfig", help="the Kubernetes client's config outside a cluster (else $KUBECONFIG)")
    s.add_argument("--worker-index", type=int, help="set by --workers for each child: serve as worker i of N")
    v = sub.add_parser("validate", help="check policy files; prints file:line: message per problem")
    v.add_argument("policy")
    e = sub.add_parser("envoy-config", help="render the Envoy bootstrap from the policy's backends")
    e.add_argument("policy")
    e.add_argument("-o", "--output", required=True)
    e.add_argument("--listen", default="127.0.0.1:10000")
    e.add_argument("--admin-port", type=int, default=9901)
    e.add_argument("--extproc", default="127.0.0.1:50051",
                   help="extproc's gRPC address; several replicas comma-separated (Envoy balances the streams)")
    e.add_argument("--extproc-workers", type=int, default=1,
                   help="each extproc address runs serve --workers N: N endpoints, on its port to its port + N - 1")
    e.add_argument("--extproc-admin", default="127.0.0.1:9100",
                   help="extproc's --admin address, where Envoy drains oversized uploads")
    e.add_argument("--eds-dir", help="where Envoy reads the pools' endpoint files (default: the output's "
                   "directory; a relative DIR is relative to Envoy's working directory too); the first "
                   "files are written there, serve --eds-dir keeps them current")
    e.add_argument("--pieces", action="store_true", help="write only what to add to an Envoy config of your "
                   "own (the filters, Sluice's clusters, the response headers, the usage filter for the "
                   "model servers' clusters) instead of a whole bootstrap; see docs/deploying.md")
    e.add_argument("--no-eds-files", action="store_true", help="write no endpoint files (names that "
                   "resolve only where Envoy runs, e.g. compose: serve --eds-dir writes them there)")
    k = sub.add_parser("hash-key", help="print the sha256 form of an API key for the policy")
    k.add_argument("key")
    args = ap.parse_args(argv)
    if args.cmd == "serve" and args.workers != 1 and args.worker_index is None:
        from extproc.service.workers import refusal, supervise

        why = refusal(args.workers, shared_state=_shared_store(args.policy))
        if why:
            print(why, file=sys.stderr)
            return 2
        return supervise(sys.argv[1:] if argv is None else argv, args.workers, _hostport(args.admin)[1])
    if args.cmd == "serve":
        logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        with contextlib.suppress(KeyboardInterrupt):
            return _run(_serve(args))
        return 0
    if args.cmd == "validate":
        return _validate(args)
    if args.cmd == "envoy-config":
        return _envoy_config(args)
    print(hash_key(args.key))
    return 0


if __name__ == "__main__":
    sys.exit(main())
