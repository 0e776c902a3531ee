"""Routing policies: which engine replica serves a request (one interface, one file per policy).

``round_robin`` (``round_robin.py``), ``least_loaded`` (``least_loaded.py``: tokens in flight, the
MLPerf Offline dispatcher), ``least_pending`` (``least_pending.py``: Server/Interactive),
``prefix_affinity`` (``prefix_affinity.py``: the study's sticky prefix map). The interface and the
load accounting are in ``base.py``; ``argmin.py`` keeps the least-loaded replica current in O(log
replicas), so no policy scans every replica per request. Any transport takes any policy.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Optional

from sut.core.routing.base import RELEASE_GATES, AffinitySettings, Router
from sut.core.routing.least_loaded import LeastLoadedRouter
from sut.core.routing.least_pending import LeastPendingRouter
from sut.core.routing.prefix_affinity import PrefixAffinityRouter
from sut.core.routing.round_robin import RoundRobinRouter

ROUTERS: dict[str, type[Router]] = {c.name: c for c in (RoundRobinRouter, LeastLoadedRouter, LeastPendingRouter,
                                                         PrefixAffinityRouter)}


def make_router(name: str, replicas: int, max_tokens: int, settings: Optional[AffinitySettings] = None) -> Router:
    """A router by policy name. Raises ``ValueError`` for an unknown name (listing the known ones)."""
    if name not in ROUTERS:
        raise ValueError(f"unknown routing policy {name!r}; known: {', '.join(ROUTERS)}")
    return ROUTERS[name](replicas, max_tokens, settings or AffinitySettings())


def model_revision(model_dir: str | os.PathLike) -> str:
    """The model revision for prefix hashing: sha256 (first 16 hex digits) of the model folder's
    ``config.json`` with sorted keys. Raises ``OSError``/``ValueError`` if it cannot be read."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:16]


__all__ = ["AffinitySettings", "RELEASE_GATES", "ROUTERS", "Router", "make_router", "model_revision",
           "RoundRobinRouter", "LeastLoadedRouter", "LeastPendingRouter", "PrefixAffinityRouter"]
