"""``least_pending``: least pending work for Server / Interactive (first-token latency matters).

Score of replica ``e``: requests outstanding on ``e`` + ``first_token_weight`` (default 8) x those
of them still waiting for their first token (queued or in prefill, which is what delays a new
request's first token), as in the best vLLM submission of MLPerf v6.1 (AMD). The lowest score wins;
ties go to the lower index. ``first(rid)`` (a streamed first token) takes the request out of the
waiting count; ``done(rid)`` out of both.
"""

from __future__ import annotations

from sut.core.routing.base import AffinitySettings, Router


class LeastPendingRouter(Router):
    name = "least_pending"

    def __init__(self, replicas: int, max_tokens: int, settings: AffinitySettings = AffinitySettings()):
        super().__init__(replicas, max_tokens, settings)
        self.weight = settings.first_token_weight
        self.waiting_first = [0] * replicas
        self._waiting: set[int] = set()

    def score(self, e: int) -> float:
        return self.inflight[e] + self.weight * self.waiting_first[e]

    def _choose(self, rid, prompt):
        return min(self.live(), key=lambda i: (self.score(i), i)), len(prompt)

    def route(self, rid, prompt) -> int:
        r = super().route(rid, prompt)
        self.waiting_first[r] += 1
        self._waiting.add(rid)
        return r

    def first(self, rid: int) -> None:
        if rid in self._waiting:
            self._waiting.discard(rid)
            self.waiting_first[self.replica_of(rid)] -= 1

    def done(self, rid: int) -> None:
        if rid in self._waiting:
            self._waiting.discard(rid)
            self.waiting_first[self.replica_of(rid)] -= 1
        super().done(rid)

    def stats(self) -> dict:
        return dict(super().stats(), first_token_weight=self.weight)
