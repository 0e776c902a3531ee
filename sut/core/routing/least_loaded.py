"""``least_loaded``: the replica with the least estimated work in flight (the MLPerf Offline dispatcher).

A request's work is its prompt tokens plus ``decode_weight x max_tokens`` (``AffinitySettings``);
ties go to the replica with fewer requests in flight, then the lower index. Cache-blind; balances
tokens, not requests, so long prompts spread evenly. The least-loaded replica comes from the router's
``ArgMin`` tree (``base.py``): O(log replicas) a request, no scan.
"""

from __future__ import annotations

from sut.core.routing.base import Router


class LeastLoadedRouter(Router):
    name = "least_loaded"

    def _choose(self, rid, prompt):
        return self.least_loaded(), len(prompt)
