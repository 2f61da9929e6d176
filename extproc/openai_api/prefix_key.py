"""A request's prompt prefix as a few chained hashes, for prefix affinity. Pure.

The engines' prefix caches work on blocks of tokens, each named by a hash of all the
tokens before it (vLLM's automatic prefix caching). Sluice does the same on *bytes*,
without tokenizing: the prompt as the engine renders it, in order (for chat each
message's role then its content, system prompt first; for completions the prompt
text), is cut into blocks of ``block_bytes``, and block i's key is a hash of bytes
[0, (i + 1) x block_bytes). Only full blocks count, and only the first ``max_bytes``:
the work per request is bounded (at most ``max_bytes`` bytes encoded and hashed).

Why blocks and not one key: one choice serves both shapes of sharing.
- Requests with the same long system prompt share its leading blocks, whatever the
  user turn after it.
- A conversation's turn k+1 starts with turn k's whole prompt, so it shares all of
  turn k's blocks (up to ``max_bytes``): the longest known block leads it to the
  endpoint that served the previous turn, which holds it in its cache.
The longest block any endpoint is known for wins (``extproc.policy.affinity``).

The hash is Python's own (64-bit SipHash, keyed per process): 20-40 us for 16 KiB
where BLAKE2b took 70-110 us here, and the keys never leave the process that made them
(each extproc process keeps its own map). The model's name seeds the chain (two models
never share a cache). Images and token-id prompts are not in the texts: two requests
that differ only there share keys, which costs at most a cache miss. Embeddings have no prefix
cache to aim for: no keys.
"""

from __future__ import annotations

from extproc.openai_api.body import ParsedRequest

SEPARATOR = b"\x1f"  # between texts (role, content, ...): "ab"+"c" and "a"+"bc" differ


def prefix_keys(req: ParsedRequest, model: str, block_bytes: int, max_bytes: int) -> tuple[int, ...]:
    """The chained block keys of ``req``'s prompt prefix, shortest first (maybe none)."""
    if req.kind == "embeddings" or block_bytes <= 0:
        return ()
    parts: list[bytes] = []
    total = 0
    for i, text in enumerate(req.texts):
        if total >= max_bytes:
            break
        # A character is at most 4 bytes: never encode more than what is left to hash.
        room = max_bytes - total
        data = (SEPARATOR if i else b"") + text[:room].encode("utf-8", "surrogatepass")
        parts.append(data[:room])
        total += len(parts[-1])
    prompt = b"".join(parts)
    keys: list[int] = []
    key = hash(model)
    for start in range(0, len(prompt) - block_bytes + 1, block_bytes):
        key = hash((key, prompt[start:start + block_bytes]))
        keys.append(key)
    return tuple(keys)
