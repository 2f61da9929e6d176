"""What to charge when the backend's usage never arrives: time spent generating × a rate.

With ``response_processing: usage_trailers`` Sluice does not see the response body, so
for a successful response without a usage record (the client left mid-stream, the
backend sent no usage chunk, a gzip body, the stream was cut) it cannot count the
streamed text. It charges instead:

    prompt + min(reserved completion, n × rate × generating time)

``rate`` is the model's decode rate per choice, learned (an exponentially weighted
mean) from the streamed responses of that model that did report their usage:
completion tokens / n / (end − first byte). The generating time is end − first byte
for a stream and first byte − admission for a non-streaming body (the backend answers
when it is done). Until a model has a learned rate, the reservation is charged: the
bound a client agreed to, never more.

Pure: no clock, no I/O; times are passed in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# A response shorter than this says more about scheduling jitter than decode speed.
MIN_LEARN_S = 0.02
MIN_LEARN_TOKENS = 4
WEIGHT = 0.2  # of the newest sample in the running mean


@dataclass
class DecodeRates:
    """Per-model decode rate (tokens/s per choice) from completed, usage-reporting streams."""

    rates: dict[str, float] = field(default_factory=dict)

    def observe(self, model: str, completion_tokens: int, n: int, seconds: float) -> None:
        if seconds < MIN_LEARN_S or completion_tokens < MIN_LEARN_TOKENS or n < 1:
            return
        sample = completion_tokens / n / seconds
        old = self.rates.get(model)
        self.rates[model] = sample if old is None else old + WEIGHT * (sample - old)

    def rate(self, model: str) -> float | None:
        return self.rates.get(model)


def completion_estimate(budget: int, n: int, rate: float | None, seconds: float) -> int:
    """Completion tokens to charge for ``seconds`` of generation: never above ``budget``."""
    if rate is None:
        return budget
    return max(0, min(budget, math.ceil(n * rate * max(seconds, 0.0))))
