"""Settings of the simulated backend (fixed at start) and the live, admin-mutable ones."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MODES = ("preempt", "oom")
SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass
class SimConfig:
    model: str = "sim-llama-8b"
    # KV cache: 2048 blocks x 16 tokens = 32 k tokens, roughly an 8B model on a 24 GB GPU.
    kv_blocks: int = 2048
    block_size: int = 16
    max_num_seqs: int = 64
    max_model_len: int = 8192
    # Prompt tokens prefilled in one step; None means max_model_len (vLLM's default
    # without chunked prefill). The first waiting prompt is always allowed.
    max_num_batched_tokens: int | None = None
    # vLLM V1's scheduling: prompts prefilled in chunks of max_num_batched_tokens mixed
    # with decode, blocks allocated chunk by chunk (see engine.py).
    chunked_prefill: bool = False
    # vLLM's automatic prefix caching (prefix_cache.py): shared prompt blocks are reused
    # and their prefill skipped. Off by default so existing runs keep their numbers;
    # vLLM V1 itself enables it by default (--no-enable-prefix-caching turns it off).
    prefix_caching: bool = False
    # vLLM keeps 1 % of the blocks free when admitting, so running sequences can grow.
    watermark: float = 0.01
    # vLLM's --scheduling-policy: "fcfs", or "priority" (the request's ``priority`` orders the
    # waiting queue, lower first, and picks who is preempted; see engine.py).
    scheduling_policy: str = "fcfs"
    mode: str = "preempt"
    time_scale: float = 1.0
    # A prefill step costs ttft_ms plus prefill_ms_per_1k_tokens per 1000 prompt tokens.
    ttft_ms: float = 20.0
    prefill_ms_per_1k_tokens: float = 25.0
    # A decode step costs 1000/tokens_per_s ms plus decode_ms_per_seq per sequence in the
    # batch: one sequence alone gets 100 tok/s, 64 together ~38 tok/s each.
    tokens_per_s: float = 100.0
    decode_ms_per_seq: float = 0.25
    # ... plus this per 1000 KV tokens the batch attends to (the memory-bound part).
    decode_ms_per_1k_kv_tokens: float = 0.3
    # After an OOM in "oom" mode admission pauses this long (model seconds), as if the
    # server were restarting.
    oom_pause_s: float = 2.0
    default_max_tokens: int = 256
    embedding_dim: int = 8
    record_limit: int = 1000
    work_log_limit: int = 10_000  # per-request work records kept (work.py)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {self.mode!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, not {self.scheduling_policy!r}")
        if self.kv_blocks < 1 or self.block_size < 1 or self.max_num_seqs < 1:
            raise ValueError("kv_blocks, block_size and max_num_seqs must be >= 1")
        if self.time_scale <= 0 or self.tokens_per_s <= 0:
            raise ValueError("time_scale and tokens_per_s must be > 0")

    @property
    def batched_tokens_budget(self) -> int:
        return self.max_num_batched_tokens or self.max_model_len


@dataclass
class LiveConfig:
    """What POST /admin/config may change while the server runs."""

    kv_usage_override: float | None = None
    fail_status: int | None = None
    mode: str = "preempt"
    time_scale: float = 1.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "kv_usage_override": self.kv_usage_override,
            "fail_status": self.fail_status,
            "mode": self.mode,
            "time_scale": self.time_scale,
        }


def parse_live_update(body: Any) -> dict[str, Any]:
    """Validate an /admin/config body; returns the fields to set or raises ValueError."""
    if not isinstance(body, dict):
        raise ValueError("body must be a JSON object")
    unknown = set(body) - {"kv_usage_override", "fail_status", "mode", "time_scale", "slowdown"}
    if unknown:
        raise ValueError(f"unknown settings: {sorted(unknown)}")
    out: dict[str, Any] = {}
    if "kv_usage_override" in body:
        v = body["kv_usage_override"]
        if v is not None and (
            isinstance(v, bool) or not isinstance(v, int | float) or not 0.0 <= v <= 1.0
        ):
            raise ValueError("kv_usage_override must be null or a number in [0, 1]")
        out["kv_usage_override"] = None if v is None else float(v)
    if "fail_status" in body:
        v = body["fail_status"]
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 400 <= v <= 599):
            raise ValueError("fail_status must be null or an HTTP error status (400-599)")
        out["fail_status"] = v
    if "mode" in body:
        if body["mode"] not in MODES:
            raise ValueError(f"mode must be one of {list(MODES)}")
        out["mode"] = body["mode"]
    if "slowdown" in body:
        # {"factor": 2, "seconds": 20}: decode steps take twice as long for 20 model seconds.
        v = body["slowdown"]
        factor = v.get("factor") if isinstance(v, dict) else None
        seconds = v.get("seconds") if isinstance(v, dict) else None
        if not all(isinstance(x, int | float) and not isinstance(x, bool) and x > 0 for x in (factor, seconds)):
            raise ValueError("slowdown must be {\"factor\": > 0, \"seconds\": > 0}")
        out["slowdown"] = {"factor": float(factor), "seconds": float(seconds)}  # type: ignore[arg-type]
    if "time_scale" in body:
        v = body["time_scale"]
        if isinstance(v, bool) or not isinstance(v, int | float) or v <= 0:
            raise ValueError("time_scale must be a number > 0")
        out["time_scale"] = float(v)
    return out
