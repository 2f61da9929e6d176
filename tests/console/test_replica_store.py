"""The overview's replica table shows each replica's state store as the replica reports it."""

from __future__ import annotations

import re

from tests.console.conftest import Console, text_of
from tests.console.test_status import post_status, report


def _row(body: str, replica: str) -> str:
    m = re.search(rf'<tr id="replica-{replica}" class="\w+">(.*?)</tr>', body, re.S)
    assert m, body
    return m.group(1)


def test_every_replica_with_its_store(operator: Console) -> None:
    shared = {"kind": "redis", "up": True, "member": "demo-1#7", "replicas": 3, "trips": 0,
              "slot_leases": {"pools": {"sim": {"pool": 64, "leased": 12, "others": 20}}}}
    post_status(operator, {**report(), "store": shared}, "demo-1")
    post_status(operator, {**report(), "store": {**shared, "up": False, "member": "demo-2#8", "trips": 2,
                                                 "slot_leases": {"pools": {}}}}, "demo-2")
    post_status(operator, {**report(), "store": {"kind": "memory", "up": True}}, "solo")
    post_status(operator, report(), "old")  # a replica from before stores were reported
    page = operator.client.get("/overview/replicas", headers={"HX-Request": "true"})
    body = page.get_data(as_text=True)
    one, two, solo, old = (_row(body, r) for r in ("demo-1", "demo-2", "solo", "old"))
    assert "store-up" in one and "3 replicas" in one and "demo-1#7" in one and "sim: 12/64 slots leased" in one
    assert "store-down" in two and "2 outages" in two and "store-up" not in two
    assert "memory" in solo and "this process only" in solo
    assert '<td class="store">—</td>' in old
    assert "State store" in text_of(page)
