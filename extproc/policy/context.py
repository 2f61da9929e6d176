"""The context-window check: what to reserve per completion, or why the request cannot run.

A request whose prompt plus ``max_tokens`` exceeds the model's window is refused the
way OpenAI refuses it (400 ``context_length_exceeded``); one that names no length gets
what fits, up to the default, and is never refused for it. ``exact`` False means the
prompt count stopped past the window (the count is a lower bound).

Pure: no I/O, no clock.
"""

from __future__ import annotations

from extproc.policy.decision import Reject
from extproc.policy.reasons import Reason

__all__ = ["completion_budget", "input_too_long"]


def completion_budget(prompt: int, max_tokens: int | None, n: int, window: int, default_max_tokens: int, *,
                      exact: bool = True, param: str = "messages") -> int | Reject:
    """Tokens to reserve (and enforce upstream) per generated completion, or the refusal."""
    if n == 0:
        return 0
    if max_tokens is not None:
        if prompt + max_tokens > window:
            more = "" if exact else "more than "
            return _too_long(f"This model's maximum context length is {window} tokens. However, you requested "
                             f"{more}{prompt + max_tokens} tokens ({more}{prompt} in the messages, {max_tokens} in "
                             "the completion). Please reduce the length of the messages or completion.", param)
        return max_tokens
    if prompt >= window:
        return _too_long(f"This model's maximum context length is {window} tokens. However, your messages "
                         f"resulted in {'more than ' if not exact else ''}{prompt if exact else window} "
                         "tokens. Please reduce the length of the messages.", param)
    # The client asked for no particular length: reserve what fits, never reject for it.
    return min(default_max_tokens, window - prompt)


def _too_long(message: str, param: str) -> Reject:
    return Reject(Reason.CONTEXT_LENGTH, message, code="context_length_exceeded", param=param)


def input_too_long(index: int, window: int) -> Reject:
    """An embeddings input over the window: each input is its own sequence, and the backend
    refuses the whole request for one of them (an unbilled 400 without Sluice's reason)."""
    return _too_long(f"This model's maximum context length is {window} tokens. However, "
                     f"input[{index}] has more than {window} tokens. Please reduce the length of "
                     "the input.", f"input[{index}]")
