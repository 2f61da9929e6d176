from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.billing import Billing
from tests.e2e.harness import Stack, running


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):  # type: ignore[no-untyped-def]
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[Stack]:
    with running(Stack(tmp_path_factory.mktemp("stack"))) as s:
        yield s


@pytest.fixture(autouse=True)
def settled_and_balanced(request: pytest.FixtureRequest) -> Iterator[None]:
    """After every end-to-end test: nothing in flight, every pre-charged token accounted."""
    yield
    if "stack" not in request.fixturenames:
        return
    s: Stack = request.getfixturevalue("stack")
    failed = getattr(request.node, "rep_call", None) is not None and request.node.rep_call.failed
    if failed:
        print(s.logs())
        return
    st = s.wait_settled()
    ledger = st["ledger"]
    assert st["in_flight"] == 0, f"requests still in flight after the test: {st}\n{s.logs()}"
    assert ledger["outstanding"] == 0, ledger
    assert ledger["balanced"], ledger
    assert ledger["precharged"] + ledger["excess"] == ledger["charged"] + ledger["refunded"], ledger
    budgets = st["budgets"]["ledgers"]  # the budget reservations too (docs/budgets.md)
    assert budgets["balanced"] and budgets["tokens"]["outstanding"] == 0, budgets


@pytest.fixture
def billing(request: pytest.FixtureRequest, stack: Stack) -> Iterator[Billing]:
    """Charged == processed over one test (tests/e2e/billing.py): every request settled during
    it was charged what the engine's own record says it processed, within its basis' bound.
    A test may tighten the bounds (``billing.bounds = Bounds(...)``) or check early itself."""
    b = Billing.of(stack)
    yield b
    failed = getattr(request.node, "rep_call", None) is not None and request.node.rep_call.failed
    if not failed:
        b.check()
