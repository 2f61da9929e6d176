"""Per-endpoint state of a pool: each replica's watermark, breaker, reservations, slots.

The pool's ``BackendState`` keeps the admission budget (the tier guarantees and
the burst pool hold per pool); an ``EndpointSet`` places what it admits
(``extproc.policy.placement``) and tracks what each endpoint holds.

With a shared store each endpoint's slots and KV are leased separately
(``extproc.runtime.leases``): an endpoint then carries this replica's lease on it
and what the other replicas hold there. A request is placed only where this
replica's own lease has room (the slot and the footprint); the score sees the
endpoint as a whole (this replica's reservations plus what the others hold), so two
replicas steer to the same endpoint only while it has room for both.

The endpoints come from a list: today the policy's ``endpoints:``, on every reload
(``sync``). A discovery source would call ``sync`` with what it found. An endpoint
that leaves the list drains: it takes no new requests, and is forgotten once its
last request has finished.

Placement reads the endpoints through an index of their candidates, renewed as they
change (``extproc.backends.endpoint_index``), so a pick costs per group of like endpoints,
not per endpoint. While some tier has a KV share, a candidate depends on the tier placed,
which the index cannot hold: placement then scans (``extproc.backends.shared_kv_placement``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from functools import partial

from extproc.backends import build
from extproc.backends.endpoint_index import COUNTS, STANDING, EndpointIndex, Standing, through
from extproc.backends.resolve import resolve
from extproc.backends.shared_kv_placement import Shares, count, shared_candidates, shared_pick
from extproc.policy.affinity import PrefixAffinity
from extproc.policy.breaker import Breaker, BreakerState
from extproc.policy.breaker_outcome import Outcome
from extproc.policy.owed import owed_endpoints
from extproc.policy.placement import Candidate, Placement, largest_capacity, pick
from extproc.policy.placement_index import for_footprint
from extproc.policy.schema import (
    Backend,
    BreakerOverride,
    BreakerSettings,
    Endpoint,
    PlacementSettings,
)
from extproc.policy.watermark import WatermarkController

UNUSABLE_METRICS = ("no_data", "unreachable", "stale")
_UNSET = object()


@dataclass
class EndpointState:
    spec: Endpoint
    ip: str | None  # None until the host name resolves
    wm: WatermarkController
    breaker: Breaker
    kv_in_use: int = 0
    in_flight: int = 0
    draining: bool = False
    sample: object | None = None  # the last scrape.Sample
    overcommit: float = 1.0  # the backend's kv_overcommit: reservations may exceed the cache this many times
    override: BreakerOverride | None = None  # the operator's manual trip/reset applied to ``breaker``
    # A shared store: this replica's lease on the endpoint (None: nothing is leased, the
    # endpoint is this process's alone), and what the other replicas hold on it.
    leased_slots: int | None = None
    leased_kv: int = 0
    others_slots: int = 0
    others_kv: int = 0
    # Requests Envoy re-picked away from this endpoint (it refused the connection) and onto it.
    repicked_away: int = 0
    repicked_here: int = 0
    # This replica's reservations here per tier (KV shares). Kept with ``kv_in_use`` whether
    # or not a share is set (a reload may set one); the index does not read it, the scan does.
    kv_by_tier: Counter[str] = field(default_factory=Counter)
    # Told when something placement reads changes (watch; extproc.backends.endpoint_index).
    on_change: Callable[[str], None] | None = field(default=None, repr=False, compare=False)

    def __setattr__(self, name: str, value: object) -> None:
        old = self.__dict__.get(name, _UNSET)
        object.__setattr__(self, name, value)
        hook = self.__dict__.get("on_change")
        if hook is not None and (name in COUNTS or name in STANDING) and old != value:
            if name in ("wm", "breaker"):
                old.on_change = None  # type: ignore[attr-defined]
                value.on_change = partial(hook, name)  # type: ignore[attr-defined]
            hook(name)

    def watch(self, hook: Callable[[str], None] | None) -> None:
        """Call ``hook(what)`` whenever something placement reads changes (None: stop)."""
        object.__setattr__(self, "on_change", hook)
        self.wm.on_change = None if hook is None else partial(hook, "wm")
        self.breaker.on_change = None if hook is None else partial(hook, "breaker")
        if hook is not None:
            hook("spec")

    @property
    def key(self) -> str:
        return self.spec.key

    @property
    def destination(self) -> str:
        """The x-sluice-endpoint value: ip:port."""
        return f"{self.ip}:{self.spec.port}"

    def metrics_state(self, now: float) -> str:
        return self.wm.state(now).reason if self.spec.metrics_url else "ok"

    def usable(self, now: float) -> bool:
        if self.ip is None or self.draining or self.breaker.state(now) == BreakerState.OPEN:
            return False
        return self.metrics_state(now) not in UNUSABLE_METRICS

    def scale(self, now: float) -> float:
        return self.wm.scale(now) if self.spec.metrics_url else 1.0

    def candidate(self, now: float, kv: int = 0, extra: tuple[int, int] = (0, 0), lease: bool = True) -> Candidate:
        """The endpoint as placement sees it, for a request of footprint ``kv``.

        Leased: unusable unless this replica's lease holds one more slot and ``kv`` more
        (``lease=False`` skips that check: could a bigger lease hold it?); the counts
        include what the other replicas hold and ``extra``, demand planned here already."""
        return for_footprint(*self.counted(self.standing(now), extra, lease), kv)

    def standing(self, now: float) -> Standing:
        """What the breaker, the metrics and the settings say at ``now``, and until when."""
        waiting = 0.0
        st = self.wm.state(now) if self.spec.metrics_url else None
        if st is not None and st.smoothed_waiting is not None:
            waiting = st.smoothed_waiting
        change = self.breaker.next_change(now)
        if self.spec.metrics_url:
            change = min(change, self.wm.next_change(now))
        scale = self.scale(now) * self.overcommit
        return Standing(self.usable(now), scale, waiting, through(change, now))

    def counted(self, s: Standing, extra: tuple[int, int] = (0, 0),
                lease: bool = True) -> tuple[Candidate, int | None]:
        """The candidate for a footprint of 0 from ``s`` and the counts, and how much more KV
        this replica's lease holds here (None: no lease bounds it; see ``candidate``)."""
        usable, room = s.usable, None
        kv_in_use, in_flight = self.kv_in_use + extra[1], self.in_flight + extra[0]
        if self.leased_slots is not None:
            if lease:
                usable = usable and self.in_flight < self.leased_slots
                if self.spec.kv_capacity_tokens is not None:
                    room = self.leased_kv - self.kv_in_use
            kv_in_use += self.others_kv
            in_flight += self.others_slots
        spec = self.spec
        return Candidate(key=self.key, usable=usable, kv_in_use=kv_in_use,
                         kv_capacity=spec.kv_capacity_tokens, kv_scale=s.kv_scale,
                         in_flight=in_flight, max_concurrency=spec.max_concurrency,
                         waiting=s.waiting), room


@dataclass
class EndpointSet:
    """The endpoints of one pool, keyed by ``host:port``."""

    by_key: dict[str, EndpointState] = field(default_factory=dict)
    breaker_settings: BreakerSettings | None = None
    placement: PlacementSettings = field(default_factory=PlacementSettings)
    # Prefix affinity (placement.prefix_affinity): prefix block key -> the endpoint that
    # last served it; None while off. ``affinity_counts``: hit | spill | miss.
    affinity: PrefixAffinity | None = None
    affinity_counts: dict[str, int] = field(default_factory=lambda: {"hit": 0, "spill": 0, "miss": 0})
    index: EndpointIndex = field(default_factory=EndpointIndex, init=False, repr=False)

    def __post_init__(self) -> None:
        for st in self.by_key.values():
            self.index.watch(st)

    @classmethod
    def create(cls, spec: Backend, now: float) -> EndpointSet:
        s = cls()
        s.sync(spec, now)
        return s

    def sync(self, spec: Backend, now: float) -> None:
        """Follow the policy's list: new endpoints join, changed ones are updated in place
        (their reservations stay), missing ones drain."""

        wanted = {e.key: e for e in spec.endpoints}
        new_breakers = self.breaker_settings is not None and spec.breaker != self.breaker_settings
        self.breaker_settings = spec.breaker
        for key, st in list(self.by_key.items()):
            if key not in wanted:
                st.draining = True
                if st.in_flight == 0:
                    self._forget(key)
        for key, e in wanted.items():
            st = self.by_key.get(key)
            if st is None:
                st = EndpointState(e, resolve(e.host), build.watermark_controller(spec),
                                   build.breaker(spec.breaker, now))
                self.by_key[key] = st
                self.index.watch(st)
                continue
            st.draining = False
            if st.spec != e:
                st.spec = e
            if st.ip is None:
                st.ip = resolve(e.host)
            st.wm = st.wm if _same_watermark(st, spec) else build.watermark_controller(spec)
            if new_breakers:
                st.breaker = build.breaker(spec.breaker, now)
                st.override = None  # the new breaker gets the manual state again (apply_overrides)
        for st in self.by_key.values():
            st.overcommit = spec.kv_overcommit
        self._sync_affinity(spec.placement)

    def _sync_affinity(self, p: PlacementSettings) -> None:
        """Keep the affinity map across reloads unless its bounds change; drop it when off."""
        old, self.placement = self.placement, p
        if not p.prefix_affinity:
            self.affinity = None
        elif self.affinity is None or (old.affinity_max_entries, old.affinity_ttl_s) != \
                (p.affinity_max_entries, p.affinity_ttl_s):
            self.affinity = PrefixAffinity(p.affinity_max_entries, p.affinity_ttl_s)

    def apply_overrides(self, mine: dict[str, BreakerOverride], now: float, wall: float) -> None:
        """The policy's manual trips/resets of single endpoints (``endpoint: host:port``),
        applied once per change: open ejects the endpoint from picking, closed forces its
        breaker closed (stale metrics still eject it). ``wall`` converts ``until``."""
        for key, st in self.by_key.items():
            ov = mine.get(key)
            if ov == st.override:
                continue
            st.override = ov
            if ov is None:
                st.breaker.set_manual(None, "", None, now)
            else:
                until = None if ov.until is None else now + (ov.until - wall)
                if until is not None and until <= now:
                    st.breaker.set_manual(None, "", None, now)  # expired while in transit
                    continue
                st.breaker.set_manual(ov.state, ov.reason, until, now)

    def candidates(self, now: float, kv: int = 0, shares: Shares | None = None) -> list[Candidate]:
        """Each endpoint for footprint ``kv``; with ``shares``, for the tier they name."""
        if shares is not None:
            return shared_candidates(self.by_key.values(), now, kv, shares)
        index = self.index.fresh(self.by_key, now)
        return [c for k in self.by_key if (c := index.candidate(k, kv)) is not None]

    def largest_capacity(self) -> int | None:
        return self.index.largest_capacity(lambda: largest_capacity([
            Candidate(k, True, 0, st.spec.kv_capacity_tokens, 1.0, 0, 1)
            for k, st in self.by_key.items() if not st.draining]))

    def owed(self, heads: Mapping[str, int], priorities: Mapping[str, int], tier: str | None,
             now: float, behind_head: bool = False) -> tuple[str, ...]:
        """The endpoints owed to blocked waiters (extproc.policy.owed; ``heads``: each waiting
        tier's head footprint): to the head of a tier above ``tier``, and with ``behind_head``
        to the head of ``tier`` itself."""
        if tier is None or not heads:
            return ()
        # Only a head that fits no endpoint is owed one: while each fits somewhere (the usual
        # case) the answer is known without a look at every endpoint.
        mine, index = priorities.get(tier, 0), self.index.fresh(self.by_key, now)
        if all(index.fits(kv) for t, kv in heads.items()
               if priorities.get(t, 0) > mine or (behind_head and t == tier)):
            return ()
        return owed_endpoints(self.candidates(now), heads, priorities, tier, behind_head)

    def place(self, kv: int, now: float, prefix: tuple[int, ...] = (), exclude: Collection[str] = (),
              shares: Shares | None = None, tier: str = "") -> Placement | None:
        """Pick an endpoint and reserve on it; ``prefix`` (extproc.openai_api.prefix_key) steers the
        pick to the endpoint that last served the longest known part of it, and records
        where it went; ``exclude`` (owed endpoints) is not picked. The placement names a
        second choice too (``placement.second_choice``), where nothing is reserved."""
        aff = self.affinity if prefix else None
        known = aff.lookup(prefix, now) if aff is not None else None
        preferred = known[0] if known is not None else None
        headroom = self.placement.affinity_min_headroom
        if shares is None:
            got, second = self.index.fresh(self.by_key, now).pick(kv, preferred, headroom, exclude)
        else:
            got, second = shared_pick(self.by_key.values(), kv, now, shares, preferred, headroom, exclude)
        if got is not None:
            st = self.by_key[got.key]
            st.kv_in_use += kv
            st.in_flight += 1
            count(st.kv_by_tier, tier, kv)
            result = None
            if aff is not None:
                aff.record(prefix, got.key, now)
                result = "miss" if preferred is None else "hit" if got.preferred else "spill"
                self.affinity_counts[result] += 1
            if second is not None or result is not None:
                # One new Placement, not dataclasses.replace twice (~2.8 µs each).
                got = Placement(got.key, got.score, got.preferred, result if result is not None else got.affinity,
                                second if second is not None else got.second)
        return got

    def fits_somewhere(self, kv: int, now: float, exclude: Collection[str] = (),
                       shares: Shares | None = None) -> bool:
        if shares is not None:
            return shared_pick(self.by_key.values(), kv, now, shares, exclude=exclude)[0] is not None
        return self.index.fresh(self.by_key, now).fits(kv, exclude)

    def plan(self, kvs: list[int], now: float) -> dict[str, tuple[int, int]]:
        """Where requests of footprints ``kvs`` would go if this replica's leases could grow:
        endpoint key -> (slots, kv) more to ask for (``extproc.runtime.leases``)."""
        extra: dict[str, tuple[int, int]] = {}
        for kv in kvs:
            got = pick([st.candidate(now, kv, extra.get(k, (0, 0)), lease=False) for k, st in self.by_key.items()],
                       kv)
            if got is not None:
                s, k = extra.get(got.key, (0, 0))
                extra[got.key] = (s + 1, k + kv)
        return extra

    def release(self, key: str, kv: int, tier: str = "") -> None:
        st = self.by_key.get(key)
        if st is None:
            return
        st.kv_in_use -= kv
        st.in_flight -= 1
        count(st.kv_by_tier, tier, -kv)
        if st.draining and st.in_flight <= 0:
            self._forget(key)

    def move(self, src: str, dst: str, kv: int, repick: bool = True, tier: str = "") -> bool:
        """A request placed on ``src`` runs on ``dst`` (Envoy re-picked after a connect
        failure; or, ``repick=False``, a gateway's subset hint ruled ``src`` out): its slot
        and KV follow it, over ``dst``'s budget if need be (it is already running there).
        False, and nothing moved, if ``dst`` is not in the pool."""
        to = self.by_key.get(dst)
        if to is None or src == dst:
            return False
        to.kv_in_use += kv
        to.in_flight += 1
        count(to.kv_by_tier, tier, kv)
        frm = self.by_key.get(src)
        if repick:
            to.repicked_here += 1
            if frm is not None:
                frm.repicked_away += 1
        self.release(src, kv, tier)
        return True

    def key_of(self, destination: str) -> str | None:
        """The endpoint whose ``destination`` (ip:port) this is, or None."""
        for key, st in self.by_key.items():
            if st.ip is not None and st.destination == destination:
                return key
        return None

    def _forget(self, key: str) -> None:
        self.index.forget(self.by_key.pop(key))
        if self.affinity is not None:
            self.affinity.forget(key)  # a prefix it served now goes by the score

    def record(self, key: str, outcome: Outcome, latency_s: float | None, now: float) -> Outcome:
        """Record on the endpoint's breaker; returns what the pool's breakers should hear.

        A failure while another endpoint is still usable is blamed on this endpoint
        alone: the pool's breakers hear ``CANCELLED`` (not counted, a half-open probe's
        place goes back), so one dead replica does not open the whole pool. Once no
        endpoint is usable, failures are the pool's."""
        st = self.by_key.get(key)
        if st is None:
            return outcome
        st.breaker.record(outcome, latency_s, now)
        if outcome == Outcome.FAILURE and any(o.usable(now) for k, o in self.by_key.items() if k != key):
            return Outcome.CANCELLED
        return outcome

    def any_destination(self, now: float) -> str | None:
        """Where a pass-through request (no reservation) goes: the least busy usable endpoint."""
        usable = [st for st in self.by_key.values() if st.usable(now)] or \
            [st for st in self.by_key.values() if not st.draining and st.ip is not None]
        if not usable:
            return None
        return min(usable, key=lambda st: (st.in_flight, st.key)).destination


def _same_watermark(st: EndpointState, spec: Backend) -> bool:
    w = spec.watermark
    return (st.wm.high, st.wm.low, st.wm.floor, st.wm.stale_after_s) == (w.high, w.low, w.floor, w.stale_after_s)
