"""``round_robin``: replica ``i mod n`` for the i-th routed request (after a replica is lost, ``mark_down``:
the i-th live replica ``mod`` the live count). Cache-blind baseline; no knobs."""

from __future__ import annotations

from sut.core.routing.base import Router


class RoundRobinRouter(Router):
    name = "round_robin"

    def _choose(self, rid, prompt):
        live = self.live()
        return live[sum(self.routed) % len(live)], len(prompt)
