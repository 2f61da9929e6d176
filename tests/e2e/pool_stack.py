"""One more simulated engine beside the harness's: the second endpoint of a pool, or a second backend.

The e2e stacks that need two engines subclass the harness's Stack and start the extra one
in ``start_sim`` with :func:`start_engine`, and stop it in ``stop`` with :func:`stop_engine`.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from tests.e2e.harness import Proc, Stack, wait_http


def engine_url(port: int) -> str:
    return f"http://127.0.0.1:{port}"


def start_engine(s: Stack, name: str, port: int, args: Sequence[str], log: str) -> None:
    """Start bench.simbackend on ``port`` as ``s.procs[name]``, logging to ``s.workdir/log``; wait for /health."""
    p = Proc(f"simbackend-{name.removeprefix('sim-')}",
             [sys.executable, "-m", "bench.simbackend", "--host", "127.0.0.1", "--port", str(port), *args],
             s.workdir / log)
    s.procs[name] = p.start()
    wait_http(f"{engine_url(port)}/health", proc=p.popen)


def stop_engine(s: Stack, name: str) -> None:
    if name in s.procs:
        s.procs[name].stop()


class ExtraEngines:
    """Put before a Stack class in the bases: ``stop`` also stops the engines named in ``engines``."""

    engines: tuple[str, ...] = ()

    def stop(self) -> None:
        super().stop()  # type: ignore[misc]
        for name in self.engines:
            stop_engine(self, name)  # type: ignore[arg-type]
