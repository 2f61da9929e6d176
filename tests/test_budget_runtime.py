"""Budgets in the runtime: the books beside the state, the status report's periods and
usage rows, the console's copy seeding a restarted replica, the monitor's gauges."""

from __future__ import annotations

from datetime import UTC, datetime

from extproc.policy.budget import Amount
from extproc.policy.budget_ledger import LocalBudgets
from extproc.policy.schema import build_policy, hash_key
from extproc.runtime.runtime import Runtime
from extproc.runtime.usage_history import KEEP_HOURS, UsageHistory
from extproc.service.console_client import ConsoleClient
from extproc.service.monitor import refresh_budgets

WALL = datetime(2025, 3, 10, 12, 30, tzinfo=UTC).timestamp()


def policy() -> dict:
    return {
        "gateway": {"currency": "eur"},
        "backends": [{"name": "b", "address": "127.0.0.1:1", "models": [
            {"name": "m", "context_window": 4096, "price": {"input": 1, "output": 2}}]}],
        "tiers": {"t": {"tpm": 100_000, "rpm": 1000, "budget": {"period": "day", "tokens": 1000, "cost": 0.002,
                                                                   "alerts": [0.5, 0.9]}}},
        "tenants": [{"name": "a", "tier": "t", "keys": [hash_key("a")]},
                    {"name": "free", "tier": "t", "keys": [hash_key("f")], "budget": False}],
    }


def runtime() -> Runtime:
    return Runtime(build_policy(policy()), clock=lambda: 0.0, wall=lambda: WALL)


def test_the_books_live_beside_the_state_and_report_their_periods() -> None:
    rt = runtime()
    try:
        assert isinstance(rt.budgets, LocalBudgets) and rt.budgets.currency == "EUR"
        p = rt.policy
        budget = p.budget(p.tenants["a"])
        assert budget is not None and p.budget(p.tenants["free"]) is None
        v = rt.budgets.admit("a", budget, Amount(600, 1_000_000), WALL)
        assert v.admitted and v.hold is not None
        rt.budgets.settle(v.hold, Amount(400, 600_000), WALL)
        st = rt.status()
        [row] = st["budgets"]["periods"]
        assert row["key"] == "day:UTC:2025-03-10" and (row["settled_tokens"], row["used_nanos"]) == (400, 600_000)
        assert st["budgets"]["ledgers"]["balanced"]
        assert st["usage"]["rows"] == [] and st["usage"]["run"]
    finally:
        rt.close()


def test_the_console_s_copy_seeds_periods_this_replica_has_not_opened() -> None:
    rt = runtime()
    try:
        client = ConsoleClient(rt, "http://console", "token", "r1")
        n = client.take_spend([{"tenant": "a", "key": "day:UTC:2025-03-10", "settled_tokens": 900,
                                "settled_nanos": 0}, {"tenant": "a"}, "junk"])
        assert n == 1
        budget = rt.policy.budget(rt.policy.tenants["a"])
        assert budget is not None
        assert not rt.budgets.admit("a", budget, Amount(101, 0), WALL).admitted
        assert rt.budgets.admit("a", budget, Amount(100, 0), WALL).admitted
    finally:
        rt.close()


def test_the_monitor_sets_each_budgeted_tenant_s_gauges() -> None:
    rt = runtime()
    try:
        budget = rt.policy.budget(rt.policy.tenants["a"])
        assert budget is not None
        rt.budgets.admit("a", budget, Amount(500, 1_900_000), WALL)
        refresh_budgets(rt)

        def value(name: str, **labels: str) -> float | None:
            return rt.metrics.registry.get_sample_value(name, labels)

        assert value("sluice_budget_limit", tenant="a", unit="tokens") == 1000
        assert value("sluice_budget_limit", tenant="a", unit="cost") == 0.002
        assert value("sluice_budget_used", tenant="a", unit="cost") == 0.0019
        assert value("sluice_budget_used_ratio", tenant="a") == 0.95
        assert value("sluice_budget_alert", tenant="a", threshold="0.5") == 1
        assert value("sluice_budget_alert", tenant="a", threshold="0.9") == 1
        assert value("sluice_budget_used_ratio", tenant="free") is None
    finally:
        rt.close()


def test_usage_history_keeps_the_last_hours_per_tenant_and_model() -> None:
    u = UsageHistory()
    u.settled("a", "m", 100, 20, 40, 3000, WALL)
    u.settled("a", "m", 10, 2, 0, 300, WALL + 60)
    u.refused("a", "-", "budget", WALL)
    u.refused("a", "m", "tpm", WALL + 3600)
    rows = {(r["model"], r["hour"]): r for r in u.report()["rows"]}
    hour = int(WALL // 3600) * 3600
    assert rows[("m", hour)] == {"tenant": "a", "model": "m", "hour": hour, "requests": 2, "prompt_tokens": 110,
                                 "completion_tokens": 22, "cached_tokens": 40, "spend_nanos": 3300, "refusals": {}}
    assert rows[("-", hour)]["refusals"] == {"budget": 1}
    assert rows[("m", hour + 3600)]["refusals"] == {"tpm": 1}
    u.settled("a", "m", 1, 1, 0, 0, WALL + KEEP_HOURS * 3600)
    assert min(r["hour"] for r in u.report()["rows"]) == hour + 3600, "hours past KEEP_HOURS are dropped"
