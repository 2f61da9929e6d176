"""The demo's processes, watched: each one that exits is named, with what that means for the
rest, and the others keep running (an operator can watch the fleet survive a failure).

Only Envoy's exit ends the demo: without it no client reaches anything. A process the
demo stops itself (Ctrl-C) is not reported.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Component:
    """One process of the demo: its name in messages, what its exit means, where its output is."""

    name: str
    popen: subprocess.Popen[bytes]
    consequence: str
    log: Path | None = None
    essential: bool = False  # its exit ends the demo


def how_it_ended(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def exit_message(c: Component, code: int, root: Path) -> str:
    where = ""
    if c.log is not None:
        shown = c.log.relative_to(root) if c.log.is_relative_to(root) else c.log
        where = f" Its output: {shown}."
    then = "stopping the demo" if c.essential else "the rest keep running"
    ended = how_it_ended(code)
    return f"demo: {c.name} (pid {c.popen.pid}) exited, {ended}: {c.consequence}; {then}.{where}"


@dataclass
class Watch:
    root: Path
    components: list[Component] = field(default_factory=list)
    say: Callable[[str], None] = field(
        default=lambda line: print(line, file=sys.stderr, flush=True)
    )
    _reported: set[int] = field(default_factory=set)

    def add(self, c: Component) -> Component:
        self.components.append(c)
        return c

    def check(self) -> bool:
        """Report every newly exited component; False once the demo should stop."""
        for c in self.components:
            code = c.popen.poll()
            if code is None or c.popen.pid in self._reported:
                continue
            self._reported.add(c.popen.pid)
            self.say(exit_message(c, code, self.root))
            if c.essential:
                return False
        if self.components and len(self._reported) == len(self.components):
            self.say("demo: every process has exited; stopping the demo.")
            return False
        return True

    def run(self, interval_s: float = 0.5) -> None:
        while self.check():
            time.sleep(interval_s)

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM in reverse start order, then SIGKILL for what is still up after ``timeout_s``."""
        for c in reversed(self.components):
            if c.popen.poll() is None:
                c.popen.send_signal(signal.SIGTERM)
        for c in self.components:
            try:
                c.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                c.popen.kill()
                c.popen.wait()
