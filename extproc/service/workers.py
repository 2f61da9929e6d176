"""``extproc serve --workers N``: N processes answering on one gRPC port.

Each worker is a full ``extproc serve`` in its own process (its own event loop, GIL and
policy reloader) bound to the same gRPC port with ``SO_REUSEPORT``: the kernel spreads
Envoy's HTTP/2 connections over them, so one host uses all its cores. Worker ``i``
serves its admin HTTP on the admin port + ``i`` (worker 0 on the port given): each
exposes its own ``/metrics`` and ``/healthz``, and Prometheus scrapes them as separate
targets, the same way it scrapes separate replicas. (A shared admin would have to
merge the workers' registries, and ``/debug/state`` would have to pick one.)

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


def worker_argv(argv: Sequence[str], index: int, admin_port: int, workers: int = 1) -> list[str]:
    """The command line of worker ``index`` of ``workers``: the parent's, with its own admin port."""
    out: list[str] = []
    skip = False
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in ("--workers", "--admin", "--worker-index"):
            skip = "=" not in a and i + 1 < len(argv)
            continue
        out.append(a)
    return [*out, "--workers", str(workers), "--worker-index", str(index), "--admin", f"{_admin_host(argv)}:{admin_port}"]


def _admin_host(argv: Sequence[str]) -> str:
    host = "127.0.0.1"
    for i, a in enumerate(argv):
        if a == "--admin" and i + 1 < len(argv):
            host = argv[i + 1].rpartition(":")[0] or host
        elif a.startswith("--admin="):
            host = a.split("=", 1)[1].rpartition(":")[0] or host
    return host


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
