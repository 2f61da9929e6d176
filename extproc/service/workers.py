"""``extproc serve --workers N``: N processes, each on its own gRPC port.

Each worker is a full ``extproc serve`` in its own process (its own event loop, GIL and
policy reloader). Worker ``i`` serves gRPC on the given port + ``i`` and its admin HTTP on
the admin port + ``i``: Envoy lists every worker as an endpoint of the ext_proc cluster
(``envoy-config --extproc-workers N``), because it multiplexes all the ext_proc streams of
one of its workers over one HTTP/2 connection per endpoint, so one shared port
(``SO_REUSEPORT``, before) spread connections, not streams: with one Envoy worker, one
Sluice worker got them all. Each worker is also its own access-log sink
(``response_processing: access_log``: entries come back to the worker that forwarded the
request). Each exposes its own ``/metrics`` and ``/healthz``, and Prometheus scrapes them
as separate targets, the same way it scrapes separate replicas.

N > 1 needs a store the workers share (``gateway.state`` or ``$SLUICE_REDIS_URL``
naming Redis): without one each process would keep its own token buckets, so a
tenant's TPM and RPM would be multiplied by N, and ``refusal`` says so. With one, TPM
and RPM hold across the workers (the Redis ``TokenState``); slots, KV reservations and
concurrency caps are still counted in each process, so each worker enforces
``floor(limit / N)`` of them (``extproc.policy.share``): together never more than the
limit. Worker ``i`` reports as ``<replica-id>-<i>``.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Sequence


def refusal(workers: int, shared_state: bool) -> str | None:
    """Why ``workers`` cannot start, or None when they can."""
    if workers < 1:
        return "--workers must be at least 1"
    if workers > 1 and not shared_state:
        return (f"--workers {workers} refused: token buckets, concurrency slots and admission queues are kept "
                "in each process, so every limit would be enforced per worker (TPM, RPM and slots multiplied by "
                f"{workers}). Configure a shared state store (gateway.state: redis://host:port, or "
                "$SLUICE_REDIS_URL), or run one worker per replica.")
    return None


GRPC_DEFAULT, ADMIN_DEFAULT = "127.0.0.1:50051", "127.0.0.1:9100"


def worker_argv(argv: Sequence[str], index: int, admin_port: int, workers: int = 1) -> list[str]:
    """The command line of worker ``index`` of ``workers``: the parent's, with its own admin
    port, gRPC port (+ ``index``) and, if the parent advertised one, advertised address."""
    out: list[str] = []
    skip = False
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in ("--workers", "--admin", "--worker-index", "--grpc", "--advertise"):
            skip = "=" not in a and i + 1 < len(argv)
            continue
        out.append(a)
    grpc = _shifted(_option(argv, "--grpc") or GRPC_DEFAULT, index)
    advertise = _option(argv, "--advertise")
    admin_host = (_option(argv, "--admin") or ADMIN_DEFAULT).rpartition(":")[0] or "127.0.0.1"
    return [*out, "--grpc", grpc, *(("--advertise", _shifted(advertise, index)) if advertise else ()),
            "--workers", str(workers), "--worker-index", str(index), "--admin", f"{admin_host}:{admin_port}"]


def _option(argv: Sequence[str], name: str) -> str | None:
    value = None
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith(name + "="):
            value = a.split("=", 1)[1]
    return value


def _shifted(address: str, index: int) -> str:
    """``host:port`` with the port moved up by ``index``: worker ``index``'s."""
    host, _, port = address.rpartition(":")
    return f"{host or '127.0.0.1'}:{int(port) + index}"


def supervise(argv: Sequence[str], workers: int, admin_port: int) -> int:
    """Run ``workers`` children of ``python -m extproc serve`` until a signal or a death.

    SIGINT/SIGTERM are passed on and the children given 5 s to finish; if one exits on
    its own, the rest are stopped too and its status returned (a supervisor such as
    systemd or Kubernetes restarts the whole set, which keeps the workers alike).
    """
    children = [subprocess.Popen([sys.executable, "-m", "extproc", *worker_argv(argv, i, admin_port + i, workers)])
                for i in range(workers)]
    stopping = False

    def stop(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        for c in children:
            if c.poll() is None:
                c.send_signal(signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)
    status = 0
    while not stopping:
        done = [c for c in children if c.poll() is not None]
        if done:
            status = done[0].returncode or 1
            stop(signal.SIGTERM, None)
        else:
            time.sleep(0.1)
    deadline = time.monotonic() + 5
    for c in children:
        try:
            c.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            c.kill()
            c.wait()
    return status
