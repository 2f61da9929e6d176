"""Login throttling: per account name and per client address, exponential backoff.

Each key ("name:<n>", "addr:<a>") may fail ``free`` times within ``window_s``; after
that every further failure doubles the wait before the next attempt (1 s, 2 s, 4 s, ...
up to ``max_delay_s``), counted from the last failure. An attempt during the wait is
refused before its password is hashed and does not count as a failure, so a flood costs
the console no scrypt work and cannot lengthen the wait itself. A successful login
clears its account's failures (not its address's: one good password must not buy an
address more guesses at other accounts). Failures live in SQLite, so a restart does
not reset them.

Password checks themselves are bounded too: at most ``concurrency`` run at once
(``hashing``), others get 429 at once instead of queueing on the cores the pages need.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

from console.store import Store


@dataclass(frozen=True)
class Throttle:
    free: int = 5  # failures per account name within the window before waits begin
    addr_free: int = 20  # the same per address (several operators may share one)
    window_s: float = 900.0
    base_delay_s: float = 1.0
    max_delay_s: float = 900.0


def delay(failures: int, free: int, base_s: float, max_s: float) -> float:
    """Seconds to wait after the last of ``failures`` failures (pure)."""
    if failures < free:
        return 0.0
    return min(max_s, base_s * 2.0 ** min(failures - free, 60))


def wait_for(failures: int, last: float | None, free: int, t: Throttle, now: float) -> float:
    if last is None:
        return 0.0
    return max(0.0, last + delay(failures, free, t.base_delay_s, t.max_delay_s) - now)


def keys(name: str, addr: str) -> tuple[str, str]:
    return f"name:{name.lower()}", f"addr:{addr}"


def retry_after(store: Store, t: Throttle, name: str, addr: str, now: float) -> float:
    """Seconds before this name from this address may try again (0: now)."""
    name_key, addr_key = keys(name, addr)
    waits = []
    for key, free in ((name_key, t.free), (addr_key, t.addr_free)):
        row = store.one("SELECT COUNT(*) AS n, MAX(at) AS last FROM login_failures WHERE key = ? AND at >= ?",
                        [key, now - t.window_s])
        waits.append(wait_for(row["n"] if row else 0, row["last"] if row else None, free, t, now))
    return max(waits)


def record_failure(store: Store, t: Throttle, name: str, addr: str, now: float) -> None:
    with store.write() as db:
        for key in keys(name, addr):
            db.execute("DELETE FROM login_failures WHERE key = ? AND at < ?", [key, now - t.window_s])
            db.execute("INSERT INTO login_failures (key, at) VALUES (?, ?)", [key, now])


def clear(store: Store, name: str) -> None:
    with store.write() as db:
        db.execute("DELETE FROM login_failures WHERE key = ?", [keys(name, "")[0]])


def header_value(seconds: float) -> str:
    return str(max(1, math.ceil(seconds)))


class Hashing:
    """At most ``n`` password checks at once; ``try_enter`` never blocks."""

    def __init__(self, n: int):
        self._sem = threading.BoundedSemaphore(max(1, n))

    def try_enter(self) -> bool:
        return self._sem.acquire(blocking=False)

    def leave(self) -> None:
        self._sem.release()
