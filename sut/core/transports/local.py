"""The ``local`` transport: vLLM engine workers in processes of this host (``sut.engine``).

One replica per planned engine slot (``sut.engine.plan_engines``: one per visible GPU x
``engines_per_device``, or CPU core groups), in slot order. ``start`` checks the prefix-caching
setting (``sut.core.guard.check_settings``), starts every worker (``EnginePool``: engines sharing a
device one after the other) and returns one ``ReplicaRecord`` per replica whose ``info`` is the
engine's read-back record (engine arguments, ``enable_prefix_caching``, device kind / name / UUID,
KV cache, pid). ``submit`` sends ``Request``s down the worker's pipe at once (the worker adds them to
the running engine between steps). Each worker's watcher thread delivers ``Completion``s
(``cached_tokens``, ``t_queued``, ``t_done``; ``t_first`` when streaming or ``spec.detail``) and,
when ``spec.stream``, ``FirstToken``s before them; an engine that dies or raises becomes one
``FatalEvent`` naming the replica (the first only): the last lines of its log are logged once, at
once, and the event's message names the log instead of repeating them. ``stop`` ends every
worker's process group.

Options (``LocalOptions``, ``--option KEY=VALUE`` of ``--sut vllm``): ``dispatch_chunk`` (requests
per submit, default 512: Offline engines start on a large query while the rest is still routed),
``allow_prefix_caching`` (experiments only; the run is then not compliant), ``gc_freeze``
(``gc.freeze()`` each worker's heap after start-up and time its GC pauses, as the Flame service's
engines do), ``first_token_weight`` (``least_pending``'s weight, Server/Interactive, default 8).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

from sut.core.transport import Transport, TransportSpec, register_transport
from sut.engine import EnginePool
from sut.errors import EngineError, TransportError
from sut.messages import Completion, FirstToken, ReplicaRecord, Request

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LocalOptions:
    """Options of the ``local`` transport (``--sut vllm``; see the module docstring)."""

    dispatch_chunk: int = 512
    allow_prefix_caching: bool = False
    gc_freeze: bool = False
    first_token_weight: float = 8.0

    def __post_init__(self):
        if self.dispatch_chunk < 1:
            raise ValueError(f"dispatch_chunk must be >= 1, got {self.dispatch_chunk}")
        if not 0 <= self.first_token_weight <= 1e6:
            raise ValueError(f"first_token_weight must be in [0, 1e6], got {self.first_token_weight}")


@register_transport("local")
class LocalTransport(Transport):
    """Engine workers of this host behind the ``Transport`` interface (module docstring).

    Raises ``EngineError`` at construction when the engines cannot be placed (``plan_engines``).
    """

    options_cls = LocalOptions
    per_request_max_tokens = True  # the worker asks each request's own length (sut.engine.worker)

    def __init__(self, spec: TransportSpec):
        super().__init__(spec)
        self.options: LocalOptions = spec.options or LocalOptions()
        self.pool = EnginePool(spec.engine, spec.generation, gc_freeze=self.options.gc_freeze, detail=spec.detail,
                               stream=spec.stream)
        self.samples = [0] * len(self.pool)  # completions delivered per replica (under self._lock)

    @property
    def replicas(self) -> int:
        return len(self.pool)

    def start(self, sink) -> list[ReplicaRecord]:
        """Start every engine; block until all are ready. ``TransportError`` (nothing left running)."""
        self.check_prefix_caching_setting()
        self.sink = sink
        try:
            infos = self.pool.start(self.spec.log_dir)
        except EngineError as e:
            raise TransportError(str(e)) from None
        for r, e in enumerate(self.pool.engines):
            e.watch(self._done_of(r), self._fatal_of(r), on_first=self._first_of(r) if self.spec.stream else None)
        self.records = [ReplicaRecord(r, info) for r, info in enumerate(infos)]
        return self.records

    # -- results (engine watcher threads) -------------------------------------------------------
    def _done_of(self, replica: int):
        def on_done(_engine: int, results: list[Completion]) -> None:
            with self._lock:
                self.samples[replica] += len(results)
            self.sink.on_results(replica, results)

        return on_done

    def _first_of(self, replica: int):
        def on_first(_engine: int, firsts: list[FirstToken]) -> None:
            self.sink.on_first(replica, firsts)

        return on_first

    def _fatal_of(self, replica: int):
        def on_fatal(message: str) -> None:
            self._report_fatal(replica, message, tail_log=log)

        return on_fatal

    # -- requests -------------------------------------------------------------------------------
    def submit(self, replica: int, requests: Sequence[Request]) -> None:
        try:
            self.pool.engines[replica].submit(requests)
        except EngineError as e:
            raise TransportError(str(e)) from None

    def stats(self) -> dict:
        """``engines``: each replica's read-back record with its ``samples`` (completions delivered);
        ``dispatch_chunk``."""
        with self._lock:
            counts = list(self.samples)
        return {"engines": [dict(r.info, samples=n) for r, n in zip(self.records, counts)],
                "dispatch_chunk": self.options.dispatch_chunk}

    def stop(self) -> None:
        self._mark_stopped()
        self.pool.shutdown()
