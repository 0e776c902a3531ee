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

Server and Interactive (``ctx.scenario``): LoadGen sends one sample per query at its scheduled
time, and TTFT counts from that time, so every sample is sent on at once (no chunking) to the
engine with the least pending work, scored as in the best vLLM submission of v6.1 (AMD): requests
outstanding + ``first_token_weight`` (default 8) x requests not yet at their first token. The
engines stream (``EnginePool(stream=True)``): each first token goes to the ledger, which calls
``FirstTokenComplete``, as soon as the engine step that produced it returns; the whole sequence
follows with ``QuerySamplesComplete``. Offline keeps the token-balanced chunked path above.

Knobs: ``dispatch_chunk`` (samples per message to an engine, default 512, Offline); ``gc_freeze``
(``gc.freeze()`` each engine worker's heap after start-up, as the Flame service's engines do;
default off); ``first_token_weight`` (Server/Interactive routing score, default 8).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Sequence

from sut.base import InputError, RunFailed, SUTContext, SystemUnderTest, register_sut
from sut.constants import MAX_NEW_TOKENS
from sut.engine import EngineError, EnginePool, EngineSettings, plan_engines, settings_from_mapping
from sut.scenarios import STREAMING_SCENARIOS

log = logging.getLogger(__name__)

#: How long the dispatcher, on a send to a dead engine, waits for the engine's watcher to report the death.
_DEATH_REPORT_S = 3.0


@dataclass(frozen=True)
class StandaloneOptions:
    """Backend options of ``--sut vllm`` (``--option KEY=VALUE``; see the module docstring).

    ``allow_prefix_caching`` lets an experiment run with ``enable_prefix_caching``; the harness then
    marks the run not compliant.
    """

    dispatch_chunk: int = 512
    allow_prefix_caching: bool = False
    gc_freeze: bool = False
    first_token_weight: float = 8.0

    def __post_init__(self):
        if self.dispatch_chunk < 1:
            raise ValueError(f"dispatch_chunk must be >= 1, got {self.dispatch_chunk}")
        if not 0 <= self.first_token_weight <= 1e6:
            raise ValueError(f"first_token_weight must be in [0, 1e6], got {self.first_token_weight}")


class PendingWork:
    """Per-engine pending work for Server/Interactive routing (thread-safe).

    ``score(e) = outstanding(e) + weight x waiting_first(e)``: requests sent to engine ``e`` and not
    finished, plus the weighted ones among them that have no first token yet (queued or in prefill,
    which is what delays a new request's first token). ``pick`` takes the lowest score (ties: the
    lower engine index) and counts the request in at once.
    """

    def __init__(self, n_engines: int, weight: float):
        self.weight = weight
        self.outstanding = [0] * n_engines
        self.waiting_first = [0] * n_engines
        self._where: dict[int, tuple[int, bool]] = {}  # request id -> (engine, first token seen)
        self._lock = threading.Lock()

    def score(self, e: int) -> float:
        return self.outstanding[e] + self.weight * self.waiting_first[e]

    def pick(self, rid: int) -> int:
        with self._lock:
            e = min(range(len(self.outstanding)), key=lambda i: (self.score(i), i))
            self.outstanding[e] += 1
            self.waiting_first[e] += 1
            self._where[rid] = (e, False)
            return e

    def first(self, rid: int) -> None:
        with self._lock:
            where = self._where.get(rid)
            if where is not None and not where[1]:
                self._where[rid] = (where[0], True)
                self.waiting_first[where[0]] -= 1

    def done(self, rid: int) -> None:
        with self._lock:
            where = self._where.pop(rid, None)
            if where is not None:
                self.outstanding[where[0]] -= 1
                if not where[1]:
                    self.waiting_first[where[0]] -= 1


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

    @classmethod
    def check_engine(cls, engine: EngineSettings) -> None:
        """``InputError`` when the engines cannot be placed here (``--device cuda`` without a GPU, more
        CPU engines than cores)."""
        try:
            plan_engines(engine)
        except EngineError as e:
            raise InputError(str(e)) from None

    def __init__(self, ctx: SUTContext, pool: EnginePool | None = None):
        super().__init__(ctx)
        self.opts = self.check_options(ctx.options)
        self.dispatch_chunk = self.opts.dispatch_chunk
        self.streaming = ctx.scenario in STREAMING_SCENARIOS
        self._owns_pool = pool is None  # a benchmark passes one started pool to several SUT objects
        self.pool = pool or EnginePool(ctx.engine, ctx.generation, allow_prefix_caching=self.opts.allow_prefix_caching,
                                       gc_freeze=self.opts.gc_freeze, stream=self.streaming)
        if self.streaming and not all(e.stream for e in self.pool.engines):
            raise ValueError("a Server/Interactive SUT needs streaming engines (EnginePool(stream=True))")
        self.pending = PendingWork(len(self.pool.engines), self.opts.first_token_weight)
        self._inbox: "queue.Queue[list | None]" = queue.Queue()
        self._dispatcher = threading.Thread(target=self._dispatch_loop, name="dispatcher", daemon=True)
        self._req_engine: dict[int, int] = {}  # request id -> engine index (for token accounting)
        self._req_cost: dict[int, int] = {}
        self._acct_lock = threading.Lock()
        self._stopped = False

    # -- life cycle -----------------------------------------------------------------------
    def start(self) -> dict:
        infos = self.pool.start(self.ctx.engine_log_dir) if self._owns_pool else [e.info for e in self.pool.engines]
        for e in self.pool.engines:
            e.watch(self._on_done, self.ledger.fail, on_first=self._on_first if self.streaming else None)
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
                if self.streaming:
                    self._dispatch_now(items, prompts)
                    continue
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
            except EngineError as e:
                # The engine is gone; its watcher names how it ended (pid, exit code) within ~2 s: prefer that.
                deadline = time.monotonic() + _DEATH_REPORT_S
                while self.ledger.error is None and time.monotonic() < deadline:
                    time.sleep(0.05)
                self.ledger.fail(f"dispatch failed: {e}")
            except IndexError as e:
                self.ledger.fail(f"dispatch failed: {e}")

    def _dispatch_now(self, items: list, prompts) -> None:
        """Server/Interactive: each sample to the engine of least pending work, sent at once."""
        per_engine: dict[int, list] = {}
        for rid, qsl_idx in items:
            per_engine.setdefault(self.pending.pick(rid), []).append((rid, prompts[qsl_idx]))
        for idx, batch in per_engine.items():
            self.pool.engines[idx].submit(batch)

    def _on_first(self, engine_index: int, firsts: list) -> None:
        for rid, _ in firsts:
            self.pending.first(rid)
        self.ledger.first_tokens(firsts)

    def _on_done(self, engine_index: int, results: list) -> None:
        if self.streaming:
            for rid, _ in results:
                self.pending.done(rid)
        with self._acct_lock:
            eng = self.pool.engines[engine_index]
            for rid, _ in results:
                eng.outstanding_tokens -= self._req_cost.pop(rid, 0)
                self._req_engine.pop(rid, None)
            eng.samples_done += len(results)
        self.ledger.complete(results)

    def record(self) -> dict:
        out = {"engines": self.pool.describe(), "dispatch_chunk": self.dispatch_chunk}
        if self.streaming:
            out["routing"] = {"policy": "least pending work: outstanding + first_token_weight x waiting for first token",
                              "first_token_weight": self.pending.weight}
        return out


__all__ = ["StandaloneSUT", "RunFailed"]
