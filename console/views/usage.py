"""Usage and spend: a tenant's page (30 days, its budget line, CSV) and the top spenders."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from flask import Blueprint, Response, abort, request

from console import usage, usage_chart
from console.views.common import region, sluice, snapshot

bp = Blueprint("usage", __name__)
TOP_WINDOW_S = 24 * 3600


def _tenant_context(name: str) -> dict[str, Any]:
    s = sluice()
    now = s.now()
    snap = snapshot()
    if snap is None or name not in snap.policy.tenants:
        abort(404, f"no tenant {name!r} in the policy")
    policy = snap.policy
    tenant = policy.tenants[name]
    budget = policy.budget(tenant)
    unit = "cost" if budget is not None and budget.cost_nanos is not None else "tokens"
    currency = policy.gateway.currency
    unit_label = currency if unit == "cost" else "tokens"
    zone = usage_chart.zone_of(budget)
    since = now - (usage_chart.DAYS + 1) * 86400
    series = usage_chart.days(usage.hourly(s.store, name, since), now, zone, budget, unit)
    limit = None
    if budget is not None:
        limit = budget.cost_nanos / 1e9 if unit == "cost" and budget.cost_nanos is not None else budget.tokens
    cumulative = budget is not None and budget.period in ("week", "month")
    chart_limit = limit if budget is not None and budget.period in ("day", "week", "month") else None
    standing = usage.standing(s.store, name, now) if budget is not None else None
    fraction = None
    if budget is not None and standing is not None:
        from extproc.policy.budget import Amount

        fraction = budget.used_fraction(Amount(standing.used_tokens, standing.used_nanos))
    return {
        "name": name, "tenant": tenant, "budget": budget, "currency": currency, "unit": unit,
        "unit_label": unit_label, "zone": str(zone), "standing": standing, "fraction": fraction,
        "alerts": [a for a in budget.alerts if fraction is not None and fraction >= a] if budget else [],
        "chart": usage_chart.svg(series, limit=chart_limit, cumulative=cumulative, unit_label=unit_label),
        "series": series, "totals": usage.totals(s.store, name, now - usage_chart.DAYS * 86400),
        "money": usage.money, "period_end": datetime.fromtimestamp(standing.end, zone).strftime("%Y-%m-%d %H:%M")
        if standing is not None else None,
    }


@bp.get("/tenants/<name>/usage")
def tenant(name: str) -> tuple[str, int]:
    return region("tenant_usage.html", "tenant_usage.html", **_tenant_context(name))


@bp.get("/tenants/<name>/usage.csv")
def tenant_csv(name: str) -> Response:
    s = sluice()
    snap = snapshot()
    if snap is None or name not in snap.policy.tenants:
        abort(404, f"no tenant {name!r} in the policy")
    try:
        days = min(max(int(request.args.get("days", usage_chart.DAYS)), 1), 3660)
    except ValueError:
        abort(400, "days: a whole number of days")
    now = s.now()
    body = usage.csv_text(s.store, name, (now // 3600 - days * 24 + 1) * 3600)
    return Response(body, mimetype="text/csv",
                    headers={"Content-Disposition": f'attachment; filename="usage-{name}.csv"'})


def spenders_context() -> dict[str, Any]:
    """The overview's top spenders over the last 24 hours, and each backend's cost per
    million tokens served when the policy says what its GPUs cost."""
    s = sluice()
    now = s.now()
    snap = snapshot()
    since = now - TOP_WINDOW_S
    rows = usage.top_spenders(s.store, since)
    budgets: dict[str, Any] = {}
    if snap is not None:
        from extproc.policy.budget import Amount

        for r in rows:
            t = snap.policy.tenants.get(r["tenant"])
            b = snap.policy.budget(t) if t is not None else None
            st = usage.standing(s.store, r["tenant"], now) if b is not None else None
            if b is not None and st is not None:
                budgets[r["tenant"]] = b.used_fraction(Amount(st.used_tokens, st.used_nanos))
    return {"spenders": rows, "spender_budgets": budgets, "money": usage.money,
            "currency": snap.policy.gateway.currency if snap else "USD",
            "gpu_costs": _gpu_costs(snap, s.store, since, now) if snap else []}


def _gpu_costs(snap: Any, store: Any, since: float, now: float) -> list[dict[str, Any]]:
    """GPU cost over the window the console has usage for (from its first hour in the last
    24 h: before it, the console cannot tell what was served), divided by the tokens served."""
    by_model = usage.tokens_by_model(store, since)
    first = usage.first_hour(store, since)
    since = max(since, first) if first is not None else now
    out = []
    for b in snap.policy.backends:
        if b.gpu_hour_cost_nanos is None:
            continue
        tokens = sum(by_model.get(m.name, 0) for m in b.models)
        gpus = max(1, len(b.endpoints))
        cost = b.gpu_hour_cost_nanos * gpus * (now - since) / 3600
        out.append({"backend": b.name, "gpus": gpus, "hours": (now - since) / 3600, "tokens": tokens,
                    "cost_nanos": int(cost),
                    "per_million_nanos": int(cost * 1_000_000 / tokens) if tokens else None})
    return out


@bp.get("/overview/spend")
def spenders() -> tuple[str, int]:
    return region("overview.html", "_top_spenders.html", **spenders_context())
