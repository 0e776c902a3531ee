"""``round_robin``: replica ``i mod n`` for the i-th routed request, O(1) (after a replica is lost, ``mark_down``:
the i-th live replica ``mod`` the live count, a scan of the replicas). Cache-blind baseline; no knobs."""

from __future__ import annotations

from sut.core.routing.base import AffinitySettings, Router


class RoundRobinRouter(Router):
    name = "round_robin"
    tracks_load = False

    def __init__(self, replicas: int, max_tokens: int, settings: AffinitySettings = AffinitySettings()):
        super().__init__(replicas, max_tokens, settings)
        self._next = 0

    def _choose(self, rid, prompt):
        r = self._next
        self._next = r + 1 if r + 1 < self.replicas else 0
        if self.down:
            live = self.live()
            r = live[sum(self.routed) % len(live)]
        return r, len(prompt)
