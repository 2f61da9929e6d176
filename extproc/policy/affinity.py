"""Which endpoint last served a prompt prefix: a bounded LRU map with expiry. Pure.

Keys are the chained block keys of ``extproc.openai_api.prefix_key`` (a key names the whole
prefix before it). ``record`` maps every key of a placed request to its endpoint;
``lookup`` answers the endpoint of the *longest* key still known, so a request is led
to where most of its prefix was last computed. An entry lives ``ttl_s`` after it was
last recorded (an engine's cache does not keep an idle prefix forever; the exact
eviction is the engine's, unseen), and the map holds at most ``max_entries`` keys,
least recently recorded dropped first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class PrefixAffinity:
    def __init__(self, max_entries: int, ttl_s: float) -> None:
        self.max_entries = max(1, max_entries)
        self.ttl_s = ttl_s
        self._map: OrderedDict[int, tuple[str, float]] = OrderedDict()  # key -> (endpoint, expires)

    def __len__(self) -> int:
        return len(self._map)

    def lookup(self, keys: Sequence[int], now: float) -> tuple[str, int] | None:
        """(endpoint, how many leading blocks it is known for), longest first; None if none."""
        for n in range(len(keys), 0, -1):
            got = self._map.get(keys[n - 1])
            if got is None:
                continue
            endpoint, expires = got
            if expires <= now:
                del self._map[keys[n - 1]]
                continue
            return endpoint, n
        return None

    def record(self, keys: Sequence[int], endpoint: str, now: float) -> None:
        expires = now + self.ttl_s
        for k in keys:
            self._map[k] = (endpoint, expires)
            self._map.move_to_end(k)
        while len(self._map) > self.max_entries:
            self._map.popitem(last=False)

    def forget(self, endpoint: str) -> None:
        """An endpoint left the pool: its entries would only point nowhere."""
        for k in [k for k, (e, _) in self._map.items() if e == endpoint]:
            del self._map[k]
