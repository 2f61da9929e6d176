"""Budgets on the request path, in process: the pre-charge beside TPM's, the refusal and
its Retry-After, the headers on every answer, the settle priced from the usage, shadow
mode, and the usage history, each through StreamProcessor's messages."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime
from typing import Any

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.policy.schema import build_policy, hash_key
from extproc.runtime.runtime import Runtime
from tests.metrics_fake import RecordingMetrics
from tests.test_stream import Clock, exchange, headers

WALL = datetime(2025, 3, 10, 23, 0, tzinfo=UTC).timestamp()  # an hour before midnight UTC
CHAT = {"_path": "/v1/chat/completions", "_method": "POST", "authorization": "Bearer k"}


def policy(budget: dict[str, Any] | bool | None = None, *, shadow: bool = False, tpm: int = 100_000,
           free_model: bool = False) -> Any:
    models = [{"name": "m", "context_window": 4096,
               "price": {"input": 1.0, "output": 2.0, "cached_input": 0.5}}]  # nanos/token: 1000, 2000, 500
    if free_model:
        models.append({"name": "free", "context_window": 4096})
    tier: dict[str, Any] = {"tpm": tpm, "rpm": 1000}
    if budget is not False:  # False: a tier without a budget
        tier["budget"] = budget or {"period": "day", "tokens": 100, "cost": 0.0001}
    if shadow:
        tier["shadow"] = ["budget"]
    return build_policy({"backends": [{"name": "b", "address": "127.0.0.1:1", "max_concurrency": 8,
                                       "models": models}],
                         "tiers": {"t": tier}, "tenants": [{"name": "a", "tier": "t", "keys": [hash_key("k")]}]})


def runtime(p: Any) -> tuple[Runtime, RecordingMetrics]:
    rec = RecordingMetrics()
    rt = Runtime(p, clock=Clock(), wall=lambda: WALL, metrics=rec)
    rt.backends["b"].has_metrics = False
    return rt, rec


def chat(max_tokens: int, model: str = "m") -> pb.ProcessingRequest:
    raw = json.dumps({"model": model, "max_tokens": max_tokens, "messages": [{"role": "user", "content": "hi"}]})
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=raw.encode(), end_of_stream=True))


def answer(prompt: int, completion: int, cached: int = 0) -> pb.ProcessingRequest:
    usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion}
    if cached:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    r = pb.ProcessingRequest(response_body=pb.HttpBody(body=json.dumps({"choices": [], "usage": usage}).encode(),
                                                       end_of_stream=True))
    r.attributes["envoy.filters.http.ext_proc"].fields["response.code"].number_value = 200
    return r


def metadata_headers(out: list[pb.ProcessingResponse]) -> dict[str, str]:
    """The response headers decided at admission (the request body's answer's metadata)."""
    [r] = [r for r in out if "sluice" in r.dynamic_metadata.fields]
    return {k: v.string_value for k, v in r.dynamic_metadata.fields["sluice"].struct_value.fields.items()}


def immediate(out: list[pb.ProcessingResponse]) -> tuple[int, dict[str, str], dict[str, Any]]:
    ir = out[-1].immediate_response
    hdrs = {h.header.key: h.header.raw_value.decode() for h in ir.headers.set_headers}
    return ir.status.code, hdrs, json.loads(ir.body)


def test_an_admitted_request_carries_its_budget_and_settles_priced() -> None:
    rt, rec = runtime(policy())
    out = asyncio.run(exchange(rt, headers(**CHAT), chat(20), answer(9, 4, cached=5)))
    h = metadata_headers(out)
    prompt = rt.usage.report()["rows"][0]["prompt_tokens"]
    assert prompt == 9
    # Reserved at admission: the counted prompt + 20, of 100 tokens and 100,000 nanos.
    assert h["x-ratelimit-limit-budget-tokens"] == "100" and h["x-ratelimit-limit-budget-cost"] == "0.000100"
    reserved = int(100 - int(h["x-ratelimit-remaining-budget-tokens"]))
    assert reserved >= 20
    assert h["x-ratelimit-reset-budget"] == "60m0s" and h["x-sluice-budget-period"] == "day:UTC:2025-03-10"
    # Settled from the usage: 4 prompt tokens at 1000, 5 cached at 500, 4 completion at 2000 nanos.
    budget = rt.policy.budget(rt.policy.tenants["a"])
    assert budget is not None
    view = rt.budgets.view("a", budget, WALL)
    assert (view.used.tokens, view.used.nanos) == (13, 4 * 1000 + 5 * 500 + 4 * 2000)
    assert rt.budgets.ledgers.balanced() and rt.budgets.ledgers.outstanding_t == 0
    row = rt.usage.report()["rows"][0]
    assert (row["requests"], row["completion_tokens"], row["cached_tokens"], row["spend_nanos"]) == (1, 4, 5, 14_500)
    assert rec.one("spent").args == {"tenant": "a", "model": "m", "prompt": 9, "completion": 4, "cached": 5,
                                     "nanos": 14_500}
    assert rec.registry.get_sample_value("sluice_spend_total", {"tenant": "a", "model": "m"}) == 14_500 / 1e9
    rt.close()


def test_a_request_past_the_budget_is_refused_until_the_next_period() -> None:
    rt, rec = runtime(policy({"period": "day", "tokens": 100}))
    asyncio.run(exchange(rt, headers(**CHAT), chat(60), answer(9, 50)))  # 59 of 100 used
    tpm_before = rt.status()["ledger"]["precharged"]
    out = asyncio.run(exchange(rt, headers(**CHAT), chat(60)))  # needs the prompt + 60
    status, h, body = immediate(out)
    assert (status, h["x-sluice-reason"]) == (429, "budget")
    assert body["error"]["type"] == "rate_limit_exceeded" and "100 tokens per day (UTC)" in body["error"]["message"]
    assert 3600 <= int(h["retry-after-ms"]) / 1000 <= 3601, "the next day starts in an hour"
    assert h["x-ratelimit-remaining-budget-tokens"] == "41" and h["x-sluice-budget-period"] == "day:UTC:2025-03-10"
    # Refused before the TPM pre-charge: nothing taken there, nothing held anywhere.
    st = rt.status()
    assert st["in_flight"] == 0 and st["ledger"]["outstanding"] == 0 and st["ledger"]["precharged"] == tpm_before
    assert rt.budgets.ledgers.outstanding_t == 0
    assert rec.one("rejected").args == {"reason": "budget", "status": 429, "tenant": "a"}
    refused = [r for r in rt.usage.report()["rows"] if r["refusals"]]
    assert refused and refused[0]["refusals"] == {"budget": 1} and refused[0]["model"] == "m"
    # A small request still fits; a spent budget is then refused at the headers.
    assert not asyncio.run(exchange(rt, headers(**CHAT), chat(30), answer(9, 32)))[-1].HasField(
        "immediate_response")
    out = asyncio.run(exchange(rt, headers(**CHAT)))
    status, h, _ = immediate(out)
    assert (status, h["x-sluice-reason"], h["x-ratelimit-remaining-budget-tokens"]) == (429, "budget", "0")
    rt.close()


def test_a_request_larger_than_the_whole_budget_gets_no_retry_after() -> None:
    rt, _ = runtime(policy({"period": "day", "tokens": 50}))
    status, h, body = immediate(asyncio.run(exchange(rt, headers(**CHAT), chat(60))))
    assert (status, h["x-sluice-reason"]) == (429, "budget_request_too_large")
    assert "retry-after" not in h and "whole day budget" in body["error"]["message"]
    rt.close()


def test_a_tpm_refusal_after_the_budget_admitted_gives_the_reservation_back() -> None:
    rt, _ = runtime(policy({"period": "day", "tokens": 10_000}, tpm=30))
    status, h, _ = immediate(asyncio.run(exchange(rt, headers(**CHAT), chat(60))))
    assert (status, h["x-sluice-reason"]) == (429, "tpm_request_too_large")
    budget = rt.policy.budget(rt.policy.tenants["a"])
    assert budget is not None
    assert rt.budgets.view("a", budget, WALL).used.tokens == 0
    assert rt.budgets.ledgers.outstanding_t == 0 and rt.budgets.ledgers.reserved_t > 0
    rt.close()


def test_shadow_mode_admits_past_the_budget_and_counts_it() -> None:
    rt, rec = runtime(policy({"period": "day", "tokens": 30}, shadow=True))
    for _ in range(3):
        out = asyncio.run(exchange(rt, headers(**CHAT), chat(20), answer(9, 20)))
        assert not out[-1].HasField("immediate_response")
    assert rec.count("shadowed", rule="budget", tier="t") == 2
    budget = rt.policy.budget(rt.policy.tenants["a"])
    assert budget is not None and rt.budgets.view("a", budget, WALL).used.tokens == 87, "honest books"
    rt.close()


def test_the_models_list_and_a_tenant_without_budget() -> None:
    rt, _ = runtime(policy())
    out = asyncio.run(exchange(rt, headers(_path="/v1/models", _method="GET", authorization="Bearer k")))
    _, h, _ = immediate(out)
    assert h["x-ratelimit-limit-budget-tokens"] == "100"
    rt.close()
    rt, _ = runtime(policy(False))
    out = asyncio.run(exchange(rt, headers(**CHAT), chat(20), answer(9, 4)))
    assert "x-sluice-budget-period" not in metadata_headers(out)
    row = rt.usage.report()["rows"][0]
    assert row["spend_nanos"] == 9 * 1000 + 4 * 2000, "spend is kept without a budget too"
    rt.close()


@pytest.mark.parametrize("free_model", [False, True])
def test_a_spent_cost_budget_is_refused_at_the_headers_unless_a_model_is_free(free_model: bool) -> None:
    rt, _ = runtime(policy({"period": "day", "cost": 0.000025}, free_model=free_model))  # 25,000 nanos
    # Reserved 18,000 (8 prompt tokens + 5 completion); used 9 x 1000 + 8 x 2000: all of it.
    asyncio.run(exchange(rt, headers(**CHAT), chat(5), answer(9, 8)))
    out = asyncio.run(exchange(rt, headers(**CHAT)))
    if free_model:
        assert not out[-1].HasField("immediate_response"), "a free model's request may still fit"
        out = asyncio.run(exchange(rt, headers(**CHAT), chat(5, model="free"), answer(9, 5)))
        assert not out[-1].HasField("immediate_response")
    else:
        assert immediate(out)[1]["x-sluice-reason"] == "budget"
    rt.close()


def failed(status: int) -> pb.ProcessingRequest:
    raw = json.dumps({"error": {"message": "out of memory", "type": "server_error"}}).encode()
    r = pb.ProcessingRequest(response_body=pb.HttpBody(body=raw, end_of_stream=True))
    r.attributes["envoy.filters.http.ext_proc"].fields["response.code"].number_value = status
    return r


@pytest.mark.parametrize("ending", ["reported", "estimated", "failed"])
def test_the_budget_is_charged_what_tpm_charged(ending: str) -> None:
    """One charge for both books (extproc.policy.charge): a tenant's spend is what its
    TPM settle says the engine processed, on every basis, not a second estimate."""
    rt, _ = runtime(policy({"period": "day", "tokens": 10_000}))
    tail = {"reported": [answer(9, 4)], "estimated": [], "failed": [failed(500)]}[ending]
    asyncio.run(exchange(rt, headers(**CHAT), chat(20), *tail))  # "estimated": cut before any answer
    [record] = rt.settle_log.report()["requests"]
    assert record["basis"] == ending
    budget = rt.policy.budget(rt.policy.tenants["a"])
    assert budget is not None
    used = rt.budgets.view("a", budget, WALL).used
    assert used.tokens == record["charged"]
    assert used.tokens == {"reported": 13, "estimated": record["reserved"], "failed": 0}[ending]
    # Priced by the engine's own split when it reported one; else the counted prompt at the
    # input price and the rest at the output price.
    prompt = 9 if ending == "reported" else min(record["prompt"], record["charged"])
    assert used.nanos == prompt * 1000 + (record["charged"] - prompt) * 2000
    assert rt.budgets.ledgers.balanced() and rt.budgets.ledgers.outstanding_t == 0
    rt.close()
