"""``extproc serve --workers N``: refused until limits are shared; the machinery under it."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from bench.procs import ROOT, free_port, http_ok, tcp_open
from extproc.workers import refusal, worker_argv

POLICY = str(ROOT / "policies")


def _up(check: object, *args: object) -> bool:
    try:
        return bool(check(*args))  # type: ignore[operator]
    except OSError:
        return False


def test_more_than_one_worker_is_refused_with_the_reason() -> None:
    grpc_port, admin_port = free_port(), free_port()
    done = subprocess.run([sys.executable, "-m", "extproc", "serve", "--workers", "2", "--policy", POLICY,
                           "--grpc", f"127.0.0.1:{grpc_port}", "--admin", f"127.0.0.1:{admin_port}"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "--workers 2 refused" in done.stderr
    assert "per worker" in done.stderr and "shared state store" in done.stderr
    assert not _up(tcp_open, grpc_port), "nothing may be listening after a refusal"


def test_the_refusal_lifts_only_with_shared_state() -> None:
    assert refusal(1, shared_state=False) is None
    assert refusal(4, shared_state=False) is not None
    assert refusal(4, shared_state=True) is None
    assert refusal(0, shared_state=True) == "--workers must be at least 1"


def test_each_worker_gets_one_worker_and_its_own_admin_port() -> None:
    argv = ["serve", "--policy", "p", "--workers", "3", "--admin", "0.0.0.0:9100", "--grpc", "127.0.0.1:50051"]
    assert worker_argv(argv, 2, 9102) == ["serve", "--policy", "p", "--grpc", "127.0.0.1:50051", "--workers", "1",
                                          "--worker-index", "2", "--admin", "0.0.0.0:9102"]
    assert worker_argv(["serve", "--workers=2"], 0, 9100)[-2:] == ["--admin", "127.0.0.1:9100"]


def _listeners(port: int) -> int:
    """Sockets listening on ``port`` (state 0A; grpc binds v4-mapped IPv6 sockets)."""
    rows = [r for t in ("tcp", "tcp6") for r in Path(f"/proc/net/{t}").read_text().splitlines()[1:]]
    return sum(1 for r in rows if r.split()[1].endswith(f":{port:04X}") and r.split()[3] == "0A")


def test_workers_share_one_grpc_port_and_stop_together() -> None:
    # The machinery the refusal guards, driven directly: two workers, one port.
    grpc_port, admin_port = free_port(), free_port()
    argv = ["serve", "--policy", POLICY, "--grpc", f"127.0.0.1:{grpc_port}", "--admin", f"127.0.0.1:{admin_port}"]
    code = f"import sys; from extproc.workers import supervise; sys.exit(supervise({argv!r}, 2, {admin_port}))"
    parent = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not (_up(http_ok, f"http://127.0.0.1:{admin_port}/healthz")
                   and _up(http_ok, f"http://127.0.0.1:{admin_port + 1}/healthz")):
            assert parent.poll() is None, "the supervisor exited"
            assert time.monotonic() < deadline, "the workers did not come up"
            time.sleep(0.1)
        assert _listeners(grpc_port) == 2, "both workers listen on the gRPC port (SO_REUSEPORT)"
        parent.send_signal(signal.SIGTERM)
        assert parent.wait(15) == 0
        assert _listeners(grpc_port) == 0
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
