"""A stand-in for ``sut.engine.EngineHandle`` that needs no vLLM (tests of the Flame path only).

Selected with the client option ``engine_backend=fake``; a run that uses it is a protocol test,
never a benchmark. Outputs are a deterministic function of the prompt (``fake_generate``), so
tests can check that every sample comes back to the right LoadGen id; each submitted batch is
"generated" after ``step_s`` seconds, so batches overlap like requests in a real engine.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from typing import Callable, Optional

import numpy as np

from sut.engine import EngineSettings, EngineSlot, GenerationSettings

FAKE_TOKEN_BASE = 1000  # generated ids are in [1000, 2000): never an EOS id of a Llama 3 model


def fake_generate(prompt: np.ndarray, max_tokens: int = 128, eos_id: Optional[int] = None) -> np.ndarray:
    """Deterministic "generation": 2..max_tokens ids derived from the prompt; ends with ``eos_id``
    for one prompt in three when it is given."""
    p = np.asarray(prompt, dtype=np.int64)
    h = int((p * np.arange(1, len(p) + 1)).sum() % 1_000_003)
    n = 2 + h % max(1, max_tokens - 1)
    ids = (FAKE_TOKEN_BASE + (h + 7919 * np.arange(n)) % 1000).astype(np.int32)
    if eos_id is not None and h % 3 == 0:
        ids[-1] = eos_id
    return ids


class FakeEngineHandle:
    """Same surface as ``EngineHandle``: start, wait_ready, watch, submit, request_stats, shutdown."""

    def __init__(self, slot: EngineSlot, settings: EngineSettings, gen: GenerationSettings,
                 step_s: float = 0.05, start_s: float = 0.0, **_ignored):
        self.slot, self.settings, self.gen = slot, settings, gen
        self.step_s, self.start_s = float(step_s), float(start_s)
        self.info: dict = {}
        self._q: "queue.Queue[Optional[list]]" = queue.Queue()
        self._on_done: Optional[Callable] = None
        self._thread: Optional[threading.Thread] = None
        self._stopping = False
        self.samples_done = 0

    @property
    def pid(self) -> int:
        return os.getpid()

    def start(self) -> None:
        pass

    def wait_ready(self, timeout: float) -> dict:
        time.sleep(min(self.start_s, timeout))
        self.info = {
            "engine": self.slot.index, "pid": os.getpid(), "vllm_version": "fake", "torch_version": "fake",
            "engine_args": {"model": self.settings.model, "max_num_seqs": self.settings.max_num_seqs,
                            "max_model_len": self.settings.max_model_len},
            "enable_prefix_caching": bool(self.settings.enable_prefix_caching),
            "device": {"kind": self.slot.kind, "slot": self.slot.device, "name": "fake-engine", "uuid": None},
            "fake": True,
        }
        return self.info

    def watch(self, on_done, on_fatal, on_stats=None) -> None:
        self._on_done, self._on_stats = on_done, on_stats
        self._thread = threading.Thread(target=self._loop, name="fake-engine", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        eos = self.gen.eos_token_ids[0] if self.gen.eos_token_ids else None
        while True:
            batch = self._q.get()
            if batch is None:
                return
            time.sleep(self.step_s)
            out = [(rid, fake_generate(p, self.gen.max_tokens, None if self.gen.ignore_eos else eos)) for rid, p in batch]
            self.samples_done += len(out)
            self._on_done(self.slot.index, out)

    def submit(self, batch) -> None:
        self._q.put(list(batch))

    def request_stats(self) -> None:
        if self._on_stats is not None:
            self._on_stats({"name": f"fake-engine-{self.slot.index}", "pid": os.getpid(), "collections": 0,
                            "total_ms": 0.0, "max_pause_ms": 0.0, "max_pause_generation": None, "frozen_objects": 0})

    def shutdown(self, timeout: float = 30.0) -> None:
        self._stopping = True
        self._q.put(None)
        if self._thread is not None:
            self._thread.join(timeout)
