"""The one transport interface between the dispatcher and engine replicas, and its factory.

A transport owns how requests reach engines and how results come back; it knows nothing of
LoadGen, routing or the ledger. Life cycle:

1. ``make_transport(name, spec)`` builds it (nothing starts). ``replicas`` is known from the spec
   already, so a routing policy can be built before ``start``.
2. ``start(sink)`` starts (or connects to) every replica and blocks until all are ready; returns one
   ``ReplicaRecord`` per replica, in replica order (also kept as ``self.records``; the sink as
   ``self.sink``, which implementations read at every delivery so that ``attach`` can swap it). Raises ``TransportError`` (the run fails before
   LoadGen starts) and leaves nothing running.
3. ``submit(replica, requests)`` hands ``Request``s to one replica; it must not block for long (a
   transport that has back-pressure queues internally). Raises ``TransportError`` when the
   replica is gone (the transport also reports a ``FatalEvent`` that says why; the dispatcher
   prefers that message).
4. Results flow to the sink on the transport's own threads: ``sink.on_first(replica,
   [FirstToken])`` (only when ``spec.stream``), ``sink.on_results(replica, [Completion])`` and at
   most one ``sink.on_fatal(FatalEvent)`` (``Transport._report_fatal`` keeps it to one, and quiet after
   ``stop``). A request's first token is always reported before its completion.
5. ``flush()``: no more requests for now (LoadGen's ``flush_queries``; a batching transport sends
   its partial batches). ``stats()``: transport facts for the run record. ``stop()``: end every
   process, session and connection the transport made; safe to call twice and after a failure.

Implementations register with ``@register_transport(name)``; ``TRANSPORTS`` maps the built-in
names to the module that registers each (imported on first use, so a host without flamepy can run
the others).
"""

from __future__ import annotations

import abc
import logging
import threading
from dataclasses import dataclass
from typing import Any, ClassVar, Optional, Protocol, Sequence

from sut.constants import STALL_TIMEOUT_S
from sut.engine import EngineSettings, GenerationSettings
from sut.engine.logs import drop_log_tail, log_tail_once
from sut.errors import TransportError
from sut.messages import Completion, FatalEvent, FirstToken, ReplicaRecord, Request
from sut.registry import Registry


class ResultSink(Protocol):
    """Where a transport delivers results (the dispatcher implements it)."""

    def on_first(self, replica: int, firsts: list[FirstToken]) -> None: ...

    def on_results(self, replica: int, results: list[Completion]) -> None: ...

    def on_fatal(self, event: FatalEvent) -> None: ...


@dataclass(frozen=True)
class TransportSpec:
    """What every transport gets.

    Attributes:
        engine / generation: engine and sampling settings (every replica builds the same engine).
        options: the transport's own options object (its ``options_cls``), parsed once by the caller.
        log_dir: where engine, server and service output goes (``engine-N.log`` ...); None = console.
        stream: report first tokens (Server/Interactive scenarios).
        detail: per-request cached-token counts and timestamps in completions where they cost
            something to collect (the synthetic-locality entry point).
        allow_prefix_caching: the engines may run with prefix caching (never in MLPerf runs; the
            guard in ``sut.core.guard`` enforces it).
        dataset_path: the cnn_eval file (a transport whose remote side loads prompts by index).
        run_dir: the run folder (a transport may keep its own files there).
        stall_timeout_s: the run's stall limit (``--stall-timeout-s``), seconds.
    """

    engine: EngineSettings
    generation: GenerationSettings
    options: Any = None
    log_dir: Optional[str] = None
    stream: bool = False
    detail: bool = False
    allow_prefix_caching: bool = False
    dataset_path: Optional[str] = None
    run_dir: Optional[str] = None
    stall_timeout_s: float = STALL_TIMEOUT_S


class Transport(abc.ABC):
    """One way to reach engine replicas (see the module docstring for the contract)."""

    name: ClassVar[str] = ""
    #: frozen dataclass of the transport's options (``--option KEY=VALUE`` / its own CLI flags).
    options_cls: ClassVar[Optional[type]] = None
    #: the replicas generate each ``Request``'s own ``max_tokens`` (else every request gets the generation
    #: settings' length, and a caller that needs per-request lengths must refuse this transport).
    per_request_max_tokens: ClassVar[bool] = False

    def __init__(self, spec: TransportSpec):
        self.spec = spec
        self.sink: Optional[ResultSink] = None  # set by start/attach; read at every delivery
        self.records: list[ReplicaRecord] = []  # set by start
        #: guards ``fatal_event`` and ``_stopped`` (implementations may guard their own counters with it too).
        self._lock = threading.Lock()
        self._stopped = False  # set by ``_mark_stopped``
        #: the one ``FatalEvent`` sent (``_report_fatal``), else None: ``attach`` then refuses a new sink.
        self.fatal_event: Optional[FatalEvent] = None
        #: replicas killed on purpose (replica-loss, ``sut.locality.failover.kill_replica``): their loss is reported
        #: without the engine-log tail on the console.
        self.planned_losses: set[int] = set()

    def _report_fatal(self, replica: Optional[int], message: str, *, tail_log: Optional[logging.Logger] = None,
                      after_stop: bool = False, rid: Optional[int] = None) -> bool:
        """Send this transport's one ``FatalEvent(replica, message)`` to the sink; True if this call sent it.

        Only the first call sends (under ``self._lock``, so two threads failing at once send one event);
        later calls, and calls after ``_mark_stopped`` (a replica ended by ``stop`` is no failure), send
        nothing and return False. ``after_stop``: send even after ``stop`` (a failure of the stop itself,
        e.g. a Flame session that could not be closed). ``tail_log``: the message's engine-log tail block is
        logged there once and replaced by a pointer to the log (``sut.engine.logs.log_tail_once``), for the
        event sent only; for a replica in ``planned_losses`` the block becomes a pointer to the log, nothing
        logged. ``rid``: the request whose failure this is (``FatalEvent.rid``), if one is."""
        with self._lock:
            if self.fatal_event is not None or (self._stopped and not after_stop):
                return False
            if tail_log is not None:
                planned = replica in self.planned_losses
                message = drop_log_tail(message) if planned else log_tail_once(message, tail_log)
            self.fatal_event = event = FatalEvent(replica, message, rid)
        self.sink.on_fatal(event)
        return True

    def _mark_stopped(self) -> bool:
        """Note that ``stop`` began (``_report_fatal`` is quiet from now on); True on the first call only."""
        with self._lock:
            first, self._stopped = not self._stopped, True
        return first

    def check_prefix_caching_setting(self) -> None:
        """The guard before anything starts (``sut.core.guard.check_settings``): ``TransportError`` when the
        engine settings ask for prefix caching and neither the spec nor the options (``allow_prefix_caching``)
        allow it."""
        from sut.core import guard

        allowed = self.spec.allow_prefix_caching or bool(getattr(self.spec.options, "allow_prefix_caching", False))
        try:
            guard.check_settings(self.spec.engine.enable_prefix_caching, allowed)
        except guard.PrefixCachingError as e:
            raise TransportError(str(e)) from None

    def attach(self, sink: ResultSink) -> list[ReplicaRecord]:
        """Deliver results of a started transport to ``sink`` from now on (a benchmark runs several
        SUTs over one started transport); returns ``start``'s records. ``TransportError`` if not started, or if a replica failed (a fatal event
        was sent) while an earlier sink was attached."""
        if not self.records:
            raise TransportError(f"{self.name} transport: attach needs a started transport")
        if self.fatal_event is not None:  # a replica failed while an earlier SUT was attached
            raise TransportError(f"{self.name} transport: a replica failed during an earlier test; start a new one")
        self.sink = sink
        return self.records

    @property
    @abc.abstractmethod
    def replicas(self) -> int:
        """Number of replicas (known before ``start``)."""

    @abc.abstractmethod
    def start(self, sink: ResultSink) -> list[ReplicaRecord]:
        """Start every replica; block until ready. Raises ``TransportError``."""

    @abc.abstractmethod
    def submit(self, replica: int, requests: Sequence[Request]) -> None:
        """Send requests to one replica. Raises ``TransportError`` if it is gone."""

    def flush(self) -> None:
        """No more requests for now: send anything held back. Default: nothing held."""

    def stats(self) -> dict:
        """Transport facts for the run record."""
        return {}

    def noncompliance_reasons(self) -> list[str]:
        """Why runs through this transport are not MLPerf results, learnt only once it started (e.g. Flame's
        control plane turned out to be the test stand-in), for ``run.json`` ``compliance.reasons``. Default: none."""
        return []

    def mark_timed(self) -> None:
        """Everything sent so far was warm-up, not timed (the locality runner's warm-up bursts): a
        transport that counts batches reports those apart from the timed ones (``sut.flame.stats``).
        Default: nothing to do."""

    def end_check(self) -> Optional[str]:
        """After the run's last answer, before ``stop``: why the answers cannot all be from the replicas read back
        at the start (e.g. a server restarted behind its URL), or None. Default: None (replicas this process
        started and watches cannot be swapped unseen)."""
        return None

    @abc.abstractmethod
    def stop(self) -> None:
        """End everything this transport started. Idempotent."""


#: Built-in transports and the module that registers each.
TRANSPORTS = {"local": "sut.core.transports.local", "flame": "sut.flame.transport", "http": "sut.core.transports.http"}

_REGISTRY: Registry[Transport] = Registry("transport", TRANSPORTS)

#: Class decorator: make a transport available to ``make_transport(name, ...)``.
register_transport = _REGISTRY.register
#: The transport class registered as NAME; ``KeyError`` listing the known names.
transport_class = _REGISTRY.get


def make_transport(name: str, spec: TransportSpec) -> Transport:
    """Build (not start) the transport ``name`` for ``spec``."""
    return transport_class(name)(spec)


__all__ = ["Completion", "FatalEvent", "FirstToken", "ReplicaRecord", "Request", "ResultSink", "Transport",
           "TransportError", "TransportSpec", "make_transport", "register_transport", "transport_class"]
