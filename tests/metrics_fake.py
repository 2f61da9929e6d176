"""A recording ``Metrics``: every intent call (``extproc.runtime.metrics.INTENTS``) is kept as an
``Event`` with its arguments by name, so a test asserts "one rejection with reason X"
without scraping Prometheus. It still counts into its registry, so a runtime built with
it (``Runtime(policy, metrics=RecordingMetrics())``) behaves and renders as usual.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from extproc.runtime.metrics import INTENTS, Metrics


@dataclass(frozen=True)
class Event:
    name: str
    args: dict[str, Any]

    def matches(self, name: str, want: dict[str, Any]) -> bool:
        return self.name == name and all(self.args.get(k) == v for k, v in want.items())


class RecordingMetrics(Metrics):
    def __init__(self) -> None:
        super().__init__()
        self.events: list[Event] = []
        for name in INTENTS:
            setattr(self, name, self._recorder(name, getattr(self, name)))

    def _recorder(self, name: str, real: Callable[..., None]) -> Callable[..., None]:
        sig = inspect.signature(real)

        def record(*args: Any, **kwargs: Any) -> None:
            bound = sig.bind(*args, **kwargs)
            bound.apply_defaults()
            args_by_name = dict(bound.arguments)
            if "degraded" in args_by_name:  # an iterable: kept as a tuple, comparable
                args_by_name["degraded"] = tuple(args_by_name["degraded"])
            self.events.append(Event(name, args_by_name))
            real(*args, **kwargs)

        return record

    # -- assertion helpers ---------------------------------------------------------
    def calls(self, name: str, **want: Any) -> list[Event]:
        """The ``name`` events whose arguments include ``want``."""
        assert name in INTENTS, f"{name!r} is not an intent of extproc.runtime.metrics"
        return [e for e in self.events if e.matches(name, want)]

    def count(self, name: str, **want: Any) -> int:
        return len(self.calls(name, **want))

    def one(self, name: str, **want: Any) -> Event:
        """The single ``name`` event (matching ``want``); fails listing what was recorded."""
        found = self.calls(name, **want)
        assert len(found) == 1, f"expected one {name} {want}, got {len(found)}: {self.calls(name)}"
        return found[0]

    def names(self) -> list[str]:
        return [e.name for e in self.events]

    def clear(self) -> None:
        self.events.clear()
