"""``GcPauseMonitor``: garbage-collector pauses of one process (engine workers, the Flame service)."""

from __future__ import annotations

import gc
import os
import time
from typing import Optional


class GcPauseMonitor:
    """Measures every garbage-collection pause of this process through ``gc.callbacks``.

    ``freeze()`` collects once and moves every object alive at that moment (model, engine,
    imported modules) into the permanent generation (``gc.freeze``), so later collections only
    walk objects created during inference; ``unfreeze()`` undoes it (call it before the engine
    shuts down, so the engine's objects can be collected again). ``stats()`` gives the count,
    the total and the largest pause, overall and per generation.
    """

    def __init__(self, name: str):
        self.name = name
        self.count = 0
        self.total_s = 0.0
        self.max_s = 0.0
        self.max_gen: Optional[int] = None
        self.frozen_objects = 0
        self.freeze_s = 0.0
        self._t0: Optional[float] = None
        self._installed = False

    def install(self) -> "GcPauseMonitor":
        if not self._installed:
            gc.callbacks.append(self._callback)
            self._installed = True
        return self

    def uninstall(self) -> None:
        if self._installed:
            try:
                gc.callbacks.remove(self._callback)
            except ValueError:
                pass
            self._installed = False

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        if self._t0 is None:
            return
        dt = time.perf_counter() - self._t0
        self._t0 = None
        self.count += 1
        self.total_s += dt
        if dt > self.max_s:
            self.max_s = dt
            self.max_gen = info.get("generation")

    def freeze(self) -> int:
        """Collect, freeze, and restart the statistics (the freeze's own full collection is kept
        apart as ``freeze_ms``, so that ``max_pause_ms`` describes the pauses after start-up)."""
        t0 = time.perf_counter()
        gc.collect()
        gc.freeze()
        self.freeze_s = time.perf_counter() - t0
        self.count, self.total_s, self.max_s, self.max_gen = 0, 0.0, 0.0, None
        self.frozen_objects = gc.get_freeze_count()
        return self.frozen_objects

    @staticmethod
    def unfreeze() -> None:
        gc.unfreeze()

    def stats(self) -> dict:
        return {"name": self.name, "pid": os.getpid(), "collections": self.count, "total_ms": round(self.total_s * 1e3, 3),
                "max_pause_ms": round(self.max_s * 1e3, 3), "max_pause_generation": self.max_gen,
                "frozen_objects": self.frozen_objects, "freeze_ms": round(self.freeze_s * 1e3, 3)}
