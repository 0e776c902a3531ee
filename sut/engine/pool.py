"""``EnginePool``: every engine of a run (one ``EngineHandle`` per planned slot), started together.

The pool applies no prefix-caching rule: the one guard is ``sut.core.guard`` (the local transport
checks the settings before ``start`` and ``TransportSUT`` the read-back records after it).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Optional

from sut.engine.devices import plan_engines
from sut.engine.handle import EngineHandle
from sut.engine.logs import engine_log_path
from sut.engine.settings import EngineSettings, GenerationSettings

log = logging.getLogger(__name__)


class EnginePool:
    """All engines of a run.

    Args:
        settings: engine settings shared by all engines (``plan_engines`` places them; it raises
            ``EngineError`` when they cannot be placed).
        gen: sampling settings.
        start_timeout_s: how long a start may take before the run fails.
        gc_freeze: freeze each worker's heap after start-up and time its GC pauses (as the Flame
            service's engine does); off by default.
        detail: first-token times in every ``Completion`` (the locality runner).
        stream: engines report each request's first token as soon as the step that made it returns
            (``watch(on_first=...)``; Server and Interactive scenarios).
    """

    def __init__(self, settings: EngineSettings, gen: GenerationSettings, start_timeout_s: float = 1800.0,
                 gc_freeze: bool = False, detail: bool = False, stream: bool = False):
        self.settings, self.gen = settings, gen
        self.start_timeout_s = start_timeout_s
        self.slots = plan_engines(settings)
        self.engines = [EngineHandle(s, settings, gen, gc_freeze=gc_freeze, detail=detail, stream=stream)
                        for s in self.slots]

    def __len__(self) -> int:
        return len(self.engines)

    def _waves(self) -> list[list[EngineHandle]]:
        """Engines on different devices start together; engines sharing one device start one after the
        other, so that each one's memory profiling sees the previous one's final footprint, unless their
        KV cache is given in bytes (``kv_cache_memory_bytes``: no profiling, so all start together)."""
        if self.settings.kv_cache_memory_bytes is not None:
            return [list(self.engines)]
        by_device: dict[str, list[EngineHandle]] = {}
        for e in self.engines:
            by_device.setdefault(f"{e.slot.kind}:{e.slot.device}", []).append(e)
        return [[grp[i] for grp in by_device.values() if i < len(grp)] for i in range(max(map(len, by_device.values())))]

    def start(self, log_dir: Optional[str | os.PathLike] = None) -> list[dict]:
        """Start every engine and wait for all; return their read-back records in slot order. On any
        failure shut all down and raise ``EngineError`` (its message ends with the failing engine's
        last log lines).

        ``log_dir``: engine N's stdout/stderr (vLLM's logs and warnings) go to ``log_dir/engine-N.log``;
        None = the console.
        """
        t0 = time.monotonic()
        log.info("starting %d engine(s): %s", len(self.engines), [(s.kind, s.device) for s in self.slots])
        if log_dir is not None:
            log.info("vLLM's own output (logs, warnings) goes to %s (--verbose: to the console)",
                     engine_log_path(log_dir, 0 if len(self.engines) == 1 else "N"))
        try:
            for wave in self._waves():
                for e in wave:
                    e.start(None if log_dir is None else engine_log_path(log_dir, e.slot.index))
                for e in wave:
                    e.wait_ready(self.start_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        log.info("engines ready in %.1f s", time.monotonic() - t0)
        return [e.info for e in self.engines]

    def shutdown(self) -> None:
        """Shut every engine down in parallel (safe to call twice)."""
        threads = [threading.Thread(target=e.shutdown) for e in self.engines]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
