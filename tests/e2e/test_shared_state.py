"""Two complete stacks (Envoy, extproc, backend) sharing one redis-server: one budget.

The tenant's TPM bucket lives in Redis (``gateway.state``), so what it spends through
one extproc process the other sees: a request the second replica would admit on its
own is refused there.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from bench.redis_server import RedisServer
from tests.e2e.harness import Stack, running
from tests.e2e.test_datapath import assert_error, auth, chat_body, post

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def stacks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Stack]]:
    redis = RedisServer(tmp_path_factory.mktemp("redis")).start()  # Debian's redis-server
    try:
        a = Stack(tmp_path_factory.mktemp("a"), gateway={"state": redis.url})
        b = Stack(tmp_path_factory.mktemp("b"), gateway={"state": redis.url})
        with running(a), running(b):
            yield [a, b]
    finally:
        redis.stop()


def test_a_tenants_budget_is_shared_by_two_replicas(stacks: list[Stack]) -> None:
    a, b = stacks
    headers = {**auth("tiny"), "x-sim-tokens": "250"}  # the tiny tier: 600 tokens, 10 per second
    for _ in range(2):
        r = post(a, chat_body(max_tokens=250), headers)
        assert r.status_code == 200, r.text
    # ~520 of 600 spent through replica a: replica b, which never saw this tenant, refuses.
    r = post(b, chat_body(max_tokens=250), headers)
    assert_error(r, 429, "tpm")
    for s in stacks:
        st = s.wait_settled()
        assert st["in_flight"] == 0 and st["ledger"]["balanced"], st
        assert st["store"]["up"] and st["store"]["replicas"] == 2, st["store"]
        assert "sluice_state_store_up 1.0" in s.metrics_text()
