"""The simulated engine's automatic prefix cache, after vLLM's (V1) design. No I/O.

- A prompt's *full* blocks are named by a chained hash: block i's hash covers its own
  ``block_size`` token ids and the hash of block i-1, so it names everything before it
  too (``block_hashes``). A partial last block is never cached.
- A block whose KV has been computed is registered under its hash. While sequences
  reference it, it is *shared*: a new sequence with the same leading hashes takes a
  reference instead of a new block and skips prefilling those tokens.
- A cached block nobody references counts as free (``vllm:kv_cache_usage_perc`` does
  not see it) but keeps its content; it is evicted, least recently freed first, only
  when a new block is needed and no never-cached free block is left.
- As in vLLM, a hit never covers the whole prompt: the last token is always computed
  (its logits produce the first output token), so at most ``(prompt - 1) // block_size``
  blocks hit.
- ``queries`` and ``hits`` count tokens, like ``vllm:prefix_cache_queries`` and
  ``vllm:prefix_cache_hits``: each time a sequence is admitted (a recomputed, preempted
  sequence asks again), its prompt tokens are queried and the cached ones hit.

Accounting with the engine: ``Engine.free_blocks`` includes the evictable cached
blocks; a sequence's ``blocks`` are its private blocks; ``Sequence.cached`` lists the
shared blocks it references. ``total = sum(private) + shared + free`` always.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as Seq


def block_hashes(token_ids: Seq[int], block_size: int) -> tuple[int, ...]:
    """Chained hashes of the full blocks of ``token_ids`` (cheap: one tuple hash per block)."""
    out: list[int] = []
    parent = 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start:start + block_size])))
        out.append(parent)
    return tuple(out)


class PrefixCache:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.refs: dict[int, int] = {}  # shared (referenced) cached blocks: hash -> sequences holding it
        self.evictable: OrderedDict[int, None] = OrderedDict()  # free but cached, oldest first
        self.queries = 0  # tokens
        self.hits = 0  # tokens
        self.evictions = 0  # blocks

    def __contains__(self, h: int) -> bool:
        return h in self.refs or h in self.evictable

    def lookup(self, hashes: Seq[int], prompt_tokens: int) -> list[int]:
        """The leading hashes of a prompt that are cached now (at most all but its last token)."""
        limit = min(len(hashes), max(prompt_tokens - 1, 0) // self.block_size)
        hit: list[int] = []
        for h in hashes[:limit]:
            if h not in self:
                break
            hit.append(h)
        return hit

    def shared_among(self, hit: Seq[int]) -> int:
        """How many of ``hit`` are referenced already: those cost no free block at all."""
        return sum(1 for h in hit if h in self.refs)

    def acquire(self, hit: Seq[int]) -> int:
        """Reference ``hit``; returns how many came out of the free (evictable) blocks."""
        from_free = 0
        for h in hit:
            if h in self.refs:
                self.refs[h] += 1
            else:
                del self.evictable[h]
                self.refs[h] = 1
                from_free += 1
        return from_free

    def register(self, h: int) -> bool:
        """A sequence's private block now holds computed KV for ``h``: share it, unless
        an equal block is cached already (then the sequence keeps its own copy)."""
        if h in self:
            return False
        self.refs[h] = 1
        return True

    def release(self, cached: Seq[int]) -> int:
        """A sequence drops its references; returns how many blocks became free.
        Released tail first, so a prefix's last blocks are evicted before its first."""
        freed = 0
        for h in reversed(cached):
            n = self.refs[h] - 1
            if n:
                self.refs[h] = n
                continue
            del self.refs[h]
            self.evictable[h] = None
            freed += 1
        return freed

    def evict_for(self, blocks: int, free_blocks: int) -> None:
        """Make ``blocks`` new blocks allocatable out of ``free_blocks``: evict the oldest
        cached free blocks that the never-cached free ones cannot cover."""
        short = blocks - (free_blocks - len(self.evictable))
        for _ in range(max(short, 0)):
            if not self.evictable:
                return
            self.evictable.popitem(last=False)
            self.evictions += 1

    def count_query(self, prompt_tokens: int, hit_blocks: int) -> None:
        self.queries += prompt_tokens
        self.hits += hit_blocks * self.block_size
