"""A policy's breaker settings: one source for the defaults and bounds (the breaker's own
``BreakerConfig``), checked at load, and the policy reference (docs/policy.md) says the same."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import pytest

from extproc.policy.breaker import BreakerConfig
from extproc.policy.schema import BreakerSettings, PolicyError, build_policy
from tests.test_policy_files import policy_reference

SHARED = [f.name for f in dataclasses.fields(BreakerSettings) if f.name in BreakerConfig.__dataclass_fields__]


def doc(breaker: dict[str, Any] | None = None) -> dict[str, Any]:
    backend: dict[str, Any] = {"name": "b", "address": "127.0.0.1:1", "models": [{"name": "m", "context_window": 64}]}
    if breaker is not None:
        backend["breaker"] = breaker
    return {"backends": [backend], "tiers": {"t": {"tpm": 10, "rpm": 1}}, "tenants": []}


def test_settings_default_to_the_breakers_own_defaults() -> None:
    assert len(SHARED) == 12  # every tunable but the two attribution ones and the probe's kind
    settings, config = BreakerSettings(), BreakerConfig()
    for name in SHARED:
        assert getattr(settings, name) == getattr(config, name), name
    assert settings.config() == config


def test_config_carries_every_setting() -> None:
    s = BreakerSettings(window_s=7.0, min_requests=3, error_ratio=0.25, consecutive_failures=0, latency_slo_s=2.0,
                        cooldown_s=4.0, max_cooldown_s=9.0, ramp_steps=(0.5, 1.0), ramp_step_s=1.0,
                        trip_on_preemption=False, preemption_threshold=3.0)
    c = s.config()
    for name in SHARED:
        assert getattr(c, name) == getattr(s, name), name
    # The breaker's own tunables the policy does not expose keep their defaults.
    assert c.window_buckets == BreakerConfig().window_buckets
    assert c.cooldown_multiplier == BreakerConfig().cooldown_multiplier


def test_a_cooldown_above_the_maximum_raises_the_maximum() -> None:
    c = BreakerSettings(cooldown_s=300.0).config()
    assert (c.cooldown_s, c.max_cooldown_s) == (300.0, 300.0)


@pytest.mark.parametrize(("breaker", "words"), [
    ({"error_ratio": 1.5}, "error_ratio must be in (0, 1]"),
    ({"cooldown_s": 0}, "cooldown_s"),
    ({"ramp_steps": [0.5, 0.2]}, "ramp_steps must not decrease"),
    ({"ramp_steps": []}, "ramp_steps must be in (0, 1]"),
    ({"ramp_steps": ["x"]}, "ramp_steps must be numbers"),
    ({"min_requests": 0}, "min_requests must be >= 1"),
    ({"min_failing_tenants": 0}, "min_failing_tenants must be >= 1"),
])
def test_a_bad_breaker_fails_at_load_with_its_place(breaker: dict[str, Any], words: str) -> None:
    with pytest.raises(PolicyError) as exc:
        build_policy(doc(breaker))
    assert "backends[0].breaker" in str(exc.value) and words in str(exc.value)
    assert build_policy(doc({"error_ratio": 0.9})).backends[0].breaker.error_ratio == 0.9


def _shown(default: object) -> str:
    if default is None:
        return "off"
    if isinstance(default, bool):
        return str(default).lower()
    if isinstance(default, tuple):
        return "[" + ", ".join(map(str, default)) + "]"
    if isinstance(default, float) and default.is_integer():
        return str(int(default))
    return str(default)


def test_policy_reference_states_each_breaker_default() -> None:
    row = next(line for line in policy_reference().splitlines() if line.startswith("| `breaker` |"))
    wrong = []
    for f in dataclasses.fields(BreakerSettings):
        m = re.search(rf"`{f.name}` \(([^)]*)\)", row)
        want = _shown(f.default)
        if m is None or not re.match(rf"{re.escape(want)}(?![\d.])", m.group(1)):
            wrong.append(f"{f.name}: docs/policy.md says {m.group(1) if m else 'nothing'}, default is {want}")
    assert not wrong, "; ".join(wrong)
