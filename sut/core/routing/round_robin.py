"""``round_robin``: replica ``i mod n`` for the i-th routed request. Cache-blind baseline; no knobs."""

from __future__ import annotations

from sut.core.routing.base import Router


class RoundRobinRouter(Router):
    name = "round_robin"

    def _choose(self, rid, prompt):
        return sum(self.routed) % self.replicas, len(prompt)
