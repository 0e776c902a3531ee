"""The routing-policy interface and its load accounting (``sut.core.routing`` lists the policies).

Contract: ``route(rid, prompt)`` is called once per request, in dispatch order, and returns a
replica index; ``first(rid)`` when a streamed request's first token arrives (optional);
``done(rid)`` exactly once per routed request when it finishes. Policies are not thread-safe: the
dispatcher (``sut.core.dispatcher``) serialises every call under one lock.

Load accounting (shared by every policy, kept here and not in the transport): a routed request
books ``uncached + decode_weight x max_tokens`` estimated tokens of work on its replica, where
``uncached`` is the policy's estimate of its prompt tokens the replica does not hold yet (the whole
prompt for cache-blind policies); ``done`` takes the same amount off. ``inflight`` and ``routed``
count requests; ``estimated_uncached`` sums the uncached estimates of every routed request (what the
policy expected the engines to prefill: compared with the engines' own cached-token counts) and
``routed_prompt`` the prompt tokens of every route decision (its denominator).

Cost: a policy that asks for the least-loaded replica (``tracks_load = True``) gets it from an
``ArgMin`` tree (``sut.core.routing.argmin``) over ``(load, inflight, index)``, kept current by
``route`` and ``done`` in O(log replicas): no per-request scan over the replicas (at 256 replicas
the scan cost ~100 µs a request, ``docs/benchmarks.md``).

Lost replicas: ``mark_down(r)`` (the caller saw replica ``r`` fail) takes ``r`` out of every later
choice: ``live()`` lists the others, ``_least`` chooses among them (a scan, only after a loss), the
least-loaded tree puts a lost replica last, and a policy's choice of a replica that is down goes to the
least-loaded live one instead. Requests already booked on ``r`` stay booked
until their ``done``. ``route`` raises ``ValueError`` once every replica is down.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np

from sut.core.routing.argmin import ArgMin

RELEASE_GATES = ("excess", "absolute", "never")


@dataclass(frozen=True)
class AffinitySettings:
    """Knobs of the routing policies (lengths in tokens; see each policy's module header).

    ``block_tokens`` (256), ``prefix_blocks`` (4), ``release_tokens`` (65,536), ``release_gate``
    (``excess`` | ``absolute`` | ``never``), ``max_entries`` (65,536), ``model_revision`` (a hash of the model's
    config, part of every prefix hash: ``sut.core.routing.prefix_affinity``): prefix affinity.
    ``decode_weight`` (1.0): every policy's decode-work estimate per new token.
    ``first_token_weight`` (8.0): ``least_pending``'s weight of a request still waiting for its first token.
    """

    block_tokens: int = 256
    prefix_blocks: int = 4
    release_tokens: int = 65536
    release_gate: str = "excess"
    max_entries: int = 65536
    decode_weight: float = 1.0
    model_revision: str = ""
    first_token_weight: float = 8.0

    def __post_init__(self):
        if self.block_tokens < 1 or self.prefix_blocks < 1 or self.max_entries < 1:
            raise ValueError("block_tokens, prefix_blocks and max_entries must be >= 1")
        if self.release_tokens < 0:
            raise ValueError(f"release_tokens must be >= 0, got {self.release_tokens}")
        if self.release_gate not in RELEASE_GATES:
            raise ValueError(f"release_gate must be one of {', '.join(RELEASE_GATES)}, got {self.release_gate!r}")
        if not (math.isfinite(self.decode_weight) and self.decode_weight >= 0):
            raise ValueError(f"decode_weight must be a finite number >= 0, got {self.decode_weight}")
        if not (math.isfinite(self.first_token_weight) and 0 <= self.first_token_weight <= 1e6):
            raise ValueError(f"first_token_weight must be in [0, 1e6], got {self.first_token_weight}")


class Router(ABC):
    """Routes requests to one of ``replicas`` engine replicas (see the module docstring)."""

    name = "router"
    #: keep the ``ArgMin`` of ``(load, inflight, index)`` current (``least_loaded``): policies that never ask skip it
    tracks_load = True

    def __init__(self, replicas: int, max_tokens: int, settings: AffinitySettings = AffinitySettings()):
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        self.replicas, self.max_tokens, self.settings = replicas, max_tokens, settings
        self.load = [0.0] * replicas  # estimated tokens of work in flight
        self.uncached = [0.0] * replicas  # of which: estimated uncached prefill tokens
        self.inflight = [0] * replicas
        self.routed = [0] * replicas
        self.estimated_uncached = 0
        self.routed_prompt = 0
        self.down: set[int] = set()
        self._cost: dict[int, tuple[int, float, int]] = {}
        self._deferred: Optional[set] = None  # inside first_many / done_many: replicas to re-key once at the end
        self._by_load = ArgMin([(0.0, 0, r) for r in range(replicas)]) if self.tracks_load else None

    @abstractmethod
    def _choose(self, rid: int, prompt: np.ndarray) -> tuple[int, int]:
        """Return ``(replica, estimated uncached prompt tokens on it)``."""

    def route(self, rid: int, prompt: np.ndarray) -> int:
        """Replica for request ``rid`` with int32 ``prompt``; books its estimated work."""
        if len(self.down) >= self.replicas:
            raise ValueError(f"every replica is down ({sorted(self.down)}): request {rid} has nowhere to go")
        r, uncached = self._choose(rid, prompt)
        if r in self.down:  # a policy that does not know about lost replicas
            r, uncached = self._least(lambda x: len(prompt)), len(prompt)
        self.estimated_uncached += uncached
        self.routed_prompt += len(prompt)
        cost = uncached + self.settings.decode_weight * self.max_tokens
        self._cost[rid] = (r, cost, uncached)
        self.load[r] += cost
        self.uncached[r] += uncached
        self.inflight[r] += 1
        self.routed[r] += 1
        self._rekey(r)
        return r

    def first(self, rid: int) -> None:
        """Request ``rid`` produced its first token (streamed transports). Default: nothing."""

    def done(self, rid: int) -> None:
        """Request ``rid`` finished. Raises ``KeyError`` for a request never routed or finished twice."""
        r, cost, uncached = self._cost.pop(rid)
        self.load[r] -= cost
        self.uncached[r] -= uncached
        self.inflight[r] -= 1
        self._touch(r)

    def first_many(self, rids: Sequence[int]) -> None:
        """``first`` for each of ``rids`` (one delivery), every replica they touch re-keyed once at the end."""
        self._deferring(self.first, rids)

    def done_many(self, rids: Sequence[int]) -> None:
        """``done`` for each of ``rids`` (one delivery), every replica they touch re-keyed once at the end
        (``KeyError`` as ``done``; the replicas touched before it are still re-keyed)."""
        self._deferring(self.done, rids)

    def _deferring(self, one: Callable[[int], None], rids: Sequence[int]) -> None:
        if self._deferred is not None or len(rids) < 2:  # nested (the outer call re-keys), or nothing to save
            for rid in rids:
                one(rid)
            return
        self._deferred = touched = set()
        try:
            for rid in rids:
                one(rid)
        finally:
            self._deferred = None
            for r in touched:
                self._rekey(r)

    def _touch(self, r: int) -> None:
        """Replica ``r``'s load changed: re-key it now, or once at the end of ``first_many`` / ``done_many``."""
        if self._deferred is None:
            self._rekey(r)
        else:
            self._deferred.add(r)

    def _rekey(self, r: int) -> None:
        """Replica ``r``'s place in the least-loaded tree: ``(load, inflight, index)``, or last of all once it is
        marked down (``mark_down``); policies with trees of their own extend it."""
        if self._by_load is not None:
            self._by_load.update(r, (float("inf"), 0, r) if r in self.down else (self.load[r], self.inflight[r], r))

    def replica_of(self, rid: int) -> int:
        """The replica ``rid`` was routed to (``KeyError`` once it is done)."""
        return self._cost[rid][0]

    def least_loaded(self) -> int:
        """The replica with the least estimated work in flight; ties: fewer requests in flight, then the
        lower index. O(1) (``tracks_load`` policies only)."""
        return self._by_load.best

    def least_loaded_for(self, owner: int, held: int) -> int:
        """The replica with the least estimated work after taking a request whose prompt replica ``owner``
        already holds ``held`` tokens of (-1: no owner): the owner when ``(load[owner] - held, inflight,
        owner)`` is no more than the least-loaded replica's ``(load, inflight, index)``, else that replica.
        The same choice as a scan of ``load[r] + uncached(r)`` over every replica, since only the owner's
        uncached work differs from the others'. O(1) (``tracks_load`` policies only)."""
        best = self._by_load.best
        if owner < 0 or owner == best or owner in self.down:
            return best
        mine = (self.load[owner] - held, self.inflight[owner], owner)
        return owner if mine <= (self.load[best], self.inflight[best], best) else best

    def mark_down(self, replica: int) -> None:
        """Replica ``replica`` is lost: no later request goes there (``ValueError`` for no such replica)."""
        if not 0 <= replica < self.replicas:
            raise ValueError(f"no replica {replica} (replicas 0..{self.replicas - 1})")
        self.down.add(replica)
        self._rekey(replica)

    def live(self) -> list[int]:
        """The replicas not marked down, in index order."""
        return [r for r in range(self.replicas) if r not in self.down]

    def _least(self, extra: Callable[[int], float]) -> int:
        return min(self.live() or range(self.replicas),
                   key=lambda r: (self.load[r] + extra(r), self.inflight[r], r))

    def stats(self) -> dict:
        out = {"policy": self.name, "routed": list(self.routed),
               "estimated_uncached_tokens": int(self.estimated_uncached),
               "routed_prompt_tokens": int(self.routed_prompt)}
        if self.down:
            out["down"] = sorted(self.down)
        return out
