"""``least_pending``: least pending work for Server / Interactive (first-token latency matters).

Score of replica ``e``: requests outstanding on ``e`` + ``first_token_weight`` (default 8) x those
of them still waiting for their first token (queued or in prefill, which is what delays a new
request's first token), as in the best vLLM submission of MLPerf v6.1 (AMD). The lowest score wins;
ties go to the lower index. ``first(rid)`` (a streamed first token) takes the request out of the
waiting count; ``done(rid)`` out of both. The lowest score comes from an ``ArgMin`` tree over
``(score, index)`` (``argmin.py``), updated on route, first token and completion: O(log replicas), once per
replica a delivery (``first_many`` / ``done_many``).
"""

from __future__ import annotations

from sut.core.routing.argmin import ArgMin
from sut.core.routing.base import AffinitySettings, Router


class LeastPendingRouter(Router):
    name = "least_pending"
    tracks_load = False

    def __init__(self, replicas: int, max_tokens: int, settings: AffinitySettings = AffinitySettings()):
        self._routing = False  # inside route (its booking's _rekey leaves the rescore to route)
        super().__init__(replicas, max_tokens, settings)
        self.weight = settings.first_token_weight
        self.waiting_first = [0] * replicas
        self._waiting: set[int] = set()
        self._by_score = ArgMin([(0.0, r) for r in range(replicas)])

    def score(self, e: int) -> float:
        return self.inflight[e] + self.weight * self.waiting_first[e]

    def _rescore(self, e: int) -> None:
        self._by_score.update(e, (float("inf") if e in self.down else self.score(e), e))

    def _rekey(self, r: int) -> None:
        super()._rekey(r)
        if not self._routing:
            self._rescore(r)

    def _choose(self, rid, prompt):
        return self._by_score.best, len(prompt)

    def route(self, rid, prompt) -> int:
        self._routing = True  # the booking's _rekey leaves the score to this method (one tree update, not two)
        try:
            r = super().route(rid, prompt)
        finally:
            self._routing = False
        self.waiting_first[r] += 1
        self._waiting.add(rid)
        self._rescore(r)
        return r

    def first(self, rid: int) -> None:
        if rid in self._waiting:
            self._waiting.discard(rid)
            r = self.replica_of(rid)
            self.waiting_first[r] -= 1
            self._touch(r)

    def done(self, rid: int) -> None:
        r = self.replica_of(rid)
        if rid in self._waiting:
            self._waiting.discard(rid)
            self.waiting_first[r] -= 1
        super().done(rid)  # its _rekey rescores r, the waiting count already taken off

    def stats(self) -> dict:
        return dict(super().stats(), first_token_weight=self.weight)
