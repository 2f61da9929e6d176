"""``python -m bench.demo`` as a newcomer runs it, on random ports in a scratch directory:
its terminal output collected line by line, its banner read for the addresses, its child
processes found through /proc (to kill one as a failure would)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.e2e.harness import ROOT
from tests.waiting import eventually

BANNER = "Sluice demo is up (Ctrl-C stops everything):"


@dataclass
class DemoRun:
    workdir: Path
    replicas: int = 1
    lines: list[str] = field(default_factory=list)
    proc: subprocess.Popen[str] | None = None

    def start(self) -> DemoRun:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bench.demo",
                "--free-ports",
                "--workdir",
                str(self.workdir),
                "--replicas",
                str(self.replicas),
                "--time-scale",
                "4",
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
        )
        threading.Thread(target=self._read, daemon=True).start()
        return self

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_banner(self, timeout: float = 180) -> None:
        def up() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"the demo exited with {self.proc.returncode}:\n{self.output}")
            return BANNER in self.lines

        eventually(
            up, timeout, lambda: f"the demo's banner; printed so far:\n{self.output}", interval=0.2
        )

    def wait_line(self, pattern: str, timeout: float = 30) -> str:
        rx = re.compile(pattern)
        return eventually(
            lambda: next((ln for ln in self.lines if rx.search(ln)), None),
            timeout,
            lambda: f"a line matching {pattern!r}; printed:\n{self.output}",
            interval=0.1,
        )

    def before_banner(self) -> list[str]:
        return self.lines[: self.lines.index(BANNER)]

    def banner_value(self, pattern: str) -> str:
        m = re.search(pattern, self.output[self.output.index(BANNER) :])
        assert m, f"{pattern!r} not in the banner:\n{self.output}"
        return m.group(1)

    @property
    def client_url(self) -> str:
        return self.banner_value(r"clients\s+-> (http://127\.0\.0\.1:\d+)/v1/chat/completions")

    @property
    def console_url(self) -> str:
        return self.banner_value(r"console\s+-> (http://127\.0\.0\.1:\d+)/")

    @property
    def login(self) -> tuple[str, str]:
        return (
            self.banner_value(r"log in as (\S+) / "),
            self.banner_value(r"log in as \S+ / (\S+)"),
        )

    def admin_url(self, replica: int) -> str:
        return self.banner_value(rf"demo-{replica}: gRPC \S+, (http://127\.0\.0\.1:\d+)/metrics")

    def engine_port(self, endpoint: int) -> int:
        return int(self.banner_value(rf"http://127\.0\.0\.1:(\d+)/metrics  \(endpoint {endpoint}:"))

    def children(self) -> dict[int, str]:
        """The demo's child processes: pid -> command line."""
        assert self.proc is not None
        out = {}
        for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
            for pid in (task / "children").read_text().split():
                try:
                    out[int(pid)] = (
                        Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                    )
                except FileNotFoundError:
                    continue
        return out

    def child(self, *words: str) -> int:
        found = [
            pid
            for pid, cmd in self.children().items()
            if all(f" {w} " in f" {cmd} " for w in words)
        ]
        assert len(found) == 1, (words, self.children())
        return found[0]

    def stop(self, timeout: float = 30) -> int:
        """Ctrl-C, as a user stops it; then every child must be gone."""
        assert self.proc is not None
        kids = list(self.children()) if self.proc.poll() is None else []
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            code = self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
        deadline = time.monotonic() + 10
        left = [pid for pid in kids if _alive(pid)]
        while left and time.monotonic() < deadline:
            time.sleep(0.1)
            left = [pid for pid in kids if _alive(pid)]
        for pid in left:  # never leave a process behind, even when the test fails
            os.kill(pid, signal.SIGKILL)
        assert not left, f"still running after the demo stopped: {left}"
        return code


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"
