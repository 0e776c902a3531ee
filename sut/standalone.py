"""The standalone vLLM SUT: LoadGen samples → token-balanced dispatcher → one engine per device.

Algorithm
---------
``issue_queries`` registers the samples with the ledger (each issued sample gets its own
request id) and puts them on the dispatcher's queue; it returns at once. The dispatcher thread
assigns each sample to the engine with the fewest outstanding tokens (prompt length + 128 new
tokens), not round-robin, and ships them in chunks of ``dispatch_chunk`` samples so that the
engines start work while the rest of a large Offline query is still being sent. Each engine's
watcher thread hands finished outputs to the ledger, which cuts them at the first EOS and calls
``QuerySamplesComplete``. An engine that dies fails the run at once (see ``sut.engine``).

Knobs: ``dispatch_chunk`` (samples per message to an engine, default 512); ``gc_freeze``
(``gc.freeze()`` each engine worker's heap after start-up, as the Flame service's engines do;
default off).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from dataclasses import dataclass
from typing import Sequence

from sut.base import InputError, RunFailed, SUTContext, SystemUnderTest, register_sut
from sut.constants import MAX_NEW_TOKENS
from sut.engine import EngineError, EnginePool, settings_from_mapping

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StandaloneOptions:
    """Backend options of ``--sut vllm`` (``--option KEY=VALUE``; see the module docstring).

    ``allow_prefix_caching`` lets an experiment run with ``enable_prefix_caching``; the harness then
    marks the run not compliant.
    """

    dispatch_chunk: int = 512
    allow_prefix_caching: bool = False
    gc_freeze: bool = False

    def __post_init__(self):
        if self.dispatch_chunk < 1:
            raise ValueError(f"dispatch_chunk must be >= 1, got {self.dispatch_chunk}")


@register_sut("vllm")
class StandaloneSUT(SystemUnderTest):
    """LoadGen SUT that runs vLLM engines in local worker processes (one per device)."""

    @classmethod
    def check_options(cls, options: dict) -> StandaloneOptions:
        """The options as ``StandaloneOptions``; ``InputError`` names an unknown or ill-typed one."""
        unknown = sorted(set(options) - {f.name for f in dataclasses.fields(StandaloneOptions)})
        if unknown:
            raise InputError(f"--sut vllm: unknown option(s) {', '.join(unknown)} (flags such as --batch-size belong to "
                             "--sut flame)")
        try:
            return settings_from_mapping(StandaloneOptions, options)
        except ValueError as e:
            raise InputError(f"--sut vllm: {e}") from None

    def __init__(self, ctx: SUTContext, pool: EnginePool | None = None):
        super().__init__(ctx)
        self.opts = self.check_options(ctx.options)
        self.dispatch_chunk = self.opts.dispatch_chunk
        self._owns_pool = pool is None  # a benchmark passes one started pool to several SUT objects
        self.pool = pool or EnginePool(ctx.engine, ctx.generation, allow_prefix_caching=self.opts.allow_prefix_caching,
                                       gc_freeze=self.opts.gc_freeze)
        self._inbox: "queue.Queue[list | None]" = queue.Queue()
        self._dispatcher = threading.Thread(target=self._dispatch_loop, name="dispatcher", daemon=True)
        self._req_engine: dict[int, int] = {}  # request id -> engine index (for token accounting)
        self._req_cost: dict[int, int] = {}
        self._acct_lock = threading.Lock()
        self._stopped = False

    # -- life cycle -----------------------------------------------------------------------
    def start(self) -> dict:
        infos = self.pool.start() if self._owns_pool else [e.info for e in self.pool.engines]
        for e in self.pool.engines:
            e.watch(self._on_done, self.ledger.fail)
        self._dispatcher.start()
        return {"engines": infos}

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self._inbox.put(None)
        if self._owns_pool:
            self.pool.shutdown()
        self.ledger.close()

    # -- LoadGen callbacks ----------------------------------------------------------------
    def issue_queries(self, samples: Sequence) -> None:
        self._inbox.put(self.ledger.issue(samples))

    # -- dispatcher -----------------------------------------------------------------------
    def _dispatch_loop(self) -> None:
        prompts = self.ctx.dataset.prompts
        while True:
            items = self._inbox.get()
            if items is None:
                return
            try:
                per_engine: dict[int, list] = {}
                for rid, qsl_idx in items:
                    prompt = prompts[qsl_idx]
                    cost = len(prompt) + MAX_NEW_TOKENS
                    with self._acct_lock:
                        eng = self.pool.least_loaded()
                        eng.outstanding_tokens += cost
                        self._req_engine[rid] = eng.slot.index
                        self._req_cost[rid] = cost
                    batch = per_engine.setdefault(eng.slot.index, [])
                    batch.append((rid, prompt))
                    if len(batch) >= self.dispatch_chunk:
                        eng.submit(batch)
                        per_engine[eng.slot.index] = []
                for idx, batch in per_engine.items():
                    if batch:
                        self.pool.engines[idx].submit(batch)
            except (EngineError, IndexError) as e:
                self.ledger.fail(f"dispatch failed: {e}")

    def _on_done(self, engine_index: int, results: list) -> None:
        with self._acct_lock:
            eng = self.pool.engines[engine_index]
            for rid, _ in results:
                eng.outstanding_tokens -= self._req_cost.pop(rid, 0)
                self._req_engine.pop(rid, None)
            eng.samples_done += len(results)
        self.ledger.complete(results)

    def record(self) -> dict:
        return {"engines": self.pool.describe(), "dispatch_chunk": self.dispatch_chunk}


__all__ = ["StandaloneSUT", "RunFailed"]
