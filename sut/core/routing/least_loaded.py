"""``least_loaded``: the replica with the least estimated work in flight (the MLPerf Offline dispatcher).

A request's work is its prompt tokens plus ``decode_weight x max_tokens`` (``AffinitySettings``);
ties go to the replica with fewer requests in flight, then the lower index. Cache-blind; balances
tokens, not requests, so long prompts spread evenly.
"""

from __future__ import annotations

from sut.core.routing.base import Router


class LeastLoadedRouter(Router):
    name = "least_loaded"

    def _choose(self, rid, prompt):
        return self._least(lambda r: len(prompt)), len(prompt)
