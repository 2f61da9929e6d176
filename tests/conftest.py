"""How ``make test`` hands the suite to its pytest-xdist workers (``--dist loadfile``).

Each module is one unit: its fixtures start one stack (Envoy, extproc, engines, Redis) for
all its tests. The load tests (``LOAD_MODULES``: many concurrent streams or clients for tens
of seconds, checked against timing contracts such as tokens per window, a p99, a steady
rate) are one unit together, sent out first: they run one after another on one worker
while the other modules run beside them, so no two of them share the two cores.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

LOAD_MODULES = (
    "tests/e2e/test_fleet_redis_down.py",
    "tests/e2e/test_fleet_long.py",
    "tests/e2e/test_tokenizer_flood.py",
    "tests/test_state_redis_outage.py",
)
_ROOT = Path(__file__).resolve().parents[1]
_missing = [m for m in LOAD_MODULES if not (_ROOT / m).is_file()]
assert not _missing, f"tests/conftest.py LOAD_MODULES names modules that do not exist: {_missing}"


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile``, with the load modules as one unit (any other --dist: xdist's own)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class ModulesAndTheLoadTests(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return "load tests" if module in LOAD_MODULES else module

    return ModulesAndTheLoadTests(config, log)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Collection order is the order units go out: the load tests first (the longest unit).
    items.sort(key=lambda item: item.nodeid.split("::", 1)[0] not in LOAD_MODULES)
