"""``TransportSUT``: the LoadGen SUT over the dispatch core (``--sut vllm``, ``--sut flame``, ``--sut vllm-http``).

Algorithm
---------
``issue_queries`` registers the samples with the ledger (each issued sample gets its own request
id; ``sut.ledger.sample``) and puts ``Request``s on the dispatch thread's inbox; it returns at once. The
dispatch thread hands them to the ``Dispatcher`` (all that waits in its inbox in one call: a busy Server
run's queries travel together) (routing policy x transport; ``sut.core.dispatcher``);
``flush_queries`` queues a flush behind them (a batching transport sends its partial batches). The
transport's threads deliver results to the dispatcher, which answers each sample exactly once
through the ledger. A fatal event from the transport fails the run at once.

A backend is a subclass that names its transport (``transport_name``) and the routing policy per
scenario (``policy_for``). Its options dataclass is the transport's ``options_cls``; the dispatch
knobs every backend shares are read from it when present: ``dispatch_chunk`` (requests per submit,
default 512), ``first_token_weight`` (``least_pending``'s weight, default 8),
``allow_prefix_caching`` (experiments only: the run is then not compliant) and
``allow_unconfirmed_prefix_caching`` (a transport that cannot read the setting back).

Several LoadGen tests over one started transport (``sut.run.series``): the first SUT is made with
``keep_transport=True`` (it starts the transport, and its ``stop`` leaves it running), the later ones with
``transport=`` that started transport (they attach to it); ``record()``'s per-engine ``samples`` then
count this SUT's test only.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import ClassVar, Optional, Sequence

from sut.base import SUTContext, SystemUnderTest
from sut.constants import MAX_NEW_TOKENS
from sut.core import guard
from sut.core.dispatcher import Dispatcher
from sut.core.routing import AffinitySettings, make_router
from sut.core.transport import Transport, TransportSpec, make_transport, transport_class
from sut.errors import RunFailed
from sut.messages import Request
from sut.scenarios import STREAMING_SCENARIOS

log = logging.getLogger(__name__)

_FLUSH = object()


class TransportSUT(SystemUnderTest):
    """LoadGen SUT = ledger + dispatcher (routing policy x transport). Subclasses set ``transport_name``."""

    transport_name: ClassVar[str] = ""

    @classmethod
    def options_cls(cls) -> type:
        return transport_class(cls.transport_name).options_cls

    def policy_for(self, scenario: str) -> str:
        """Routing policy by scenario: token-balanced for Offline, least pending work when first tokens count."""
        return "least_pending" if scenario in STREAMING_SCENARIOS else "least_loaded"

    def __init__(self, ctx: SUTContext, transport: Optional[Transport] = None, keep_transport: bool = False):
        super().__init__(ctx)
        self.opts = o = self.check_options(ctx.options)
        self.streaming = ctx.scenario in STREAMING_SCENARIOS
        self.allow_prefix_caching = bool(getattr(o, "allow_prefix_caching", False))
        try:
            guard.check_settings(ctx.engine.enable_prefix_caching, self.allow_prefix_caching)
        except guard.PrefixCachingError as e:
            raise RunFailed(str(e)) from None
        self._owns_transport = transport is None  # a benchmark passes one started transport to several SUTs
        self._stops_transport = self._owns_transport and not keep_transport  # keep: later SUTs attach to it
        self._samples_before: list[int] = []  # a shared transport's per-engine counts when this SUT attached
        self.transport = transport or make_transport(self.transport_name, TransportSpec(
            engine=ctx.engine, generation=ctx.generation, options=o, log_dir=ctx.engine_log_dir, stream=self.streaming,
            allow_prefix_caching=self.allow_prefix_caching, dataset_path=ctx.dataset.path, run_dir=ctx.run_dir,
            stall_timeout_s=ctx.stall_timeout_s))
        self.policy = self.policy_for(ctx.scenario)
        router = make_router(self.policy, self.transport.replicas, MAX_NEW_TOKENS,
                             AffinitySettings(first_token_weight=float(getattr(o, "first_token_weight", 8.0))))
        self.dispatcher = Dispatcher(self.transport, router, self.ledger, chunk=int(getattr(o, "dispatch_chunk", 512)),
                                     vocab_size=ctx.vocab_size)
        self._inbox: "queue.SimpleQueue" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._dispatch_loop, name="dispatcher", daemon=True)
        self._stopped = False
        self.unconfirmed: list[int] = []

    # -- life cycle -------------------------------------------------------------------------
    def start(self) -> dict:
        if self._thread.is_alive() or self._stopped:
            raise RuntimeError(f"--sut {self.name}: start() called twice or after stop()")
        if self._owns_transport:
            replicas = self.dispatcher.start()
        else:
            replicas = self.dispatcher.replicas = self.transport.attach(self.dispatcher)
            self._samples_before = [e.get("samples", 0) for e in self.transport.stats().get("engines", [])]
        try:
            self.unconfirmed = guard.check_replicas(replicas, self.allow_prefix_caching,
                                                    bool(getattr(self.opts, "allow_unconfirmed_prefix_caching", False)))
        except guard.PrefixCachingError as e:
            raise RunFailed(str(e)) from None
        self._thread.start()
        late = self.transport.noncompliance_reasons()
        return {"engines": [r.info for r in replicas], **({"noncompliance_reasons": late} if late else {})}

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self._inbox.put(None)
        try:
            if self._stops_transport:
                self.transport.stop()
        finally:
            self.ledger.close()

    def end_check(self) -> Optional[str]:
        """The transport's ``end_check``."""
        return self.transport.end_check()

    def stall_detail(self) -> str:
        """Outstanding samples per replica, named by its server URL where it has one."""
        names = {r.index: r.info.get("url") for r in self.dispatcher.replicas}
        parts = [f"replica {i}{f' ({names[i]})' if names.get(i) else ''}: {n}"
                 for i, n in sorted(self.dispatcher.outstanding_by_replica().items())]
        return "outstanding per replica: " + ", ".join(parts) if parts else ""

    # -- LoadGen callbacks ------------------------------------------------------------------
    def issue_queries(self, samples: Sequence) -> None:
        prompts = self.ctx.dataset.prompts
        items = [Request(rid, prompts[idx], idx) for rid, idx in self.ledger.issue(samples)]
        if self._stopped:  # nobody dispatches any more: answer them (empty) through the failure path
            self.ledger.fail(f"--sut {self.name}: issue_queries after stop()")
            return
        self._inbox.put(items)

    def flush_queries(self) -> None:
        self._inbox.put(_FLUSH)

    def _dispatch_loop(self) -> None:
        """The dispatch thread: everything waiting in the inbox at once (Server: the queries LoadGen issued while
        the last dispatch ran) goes out as one ``dispatch``, in order; a flush after the requests before it."""
        inbox = self._inbox
        while True:
            got = [inbox.get()]
            while not inbox.empty():
                got.append(inbox.get())
            items = []
            for one in got:
                if one is None or one is _FLUSH:
                    self._dispatch(items)
                    items = []
                    if one is None:
                        return
                    self._dispatch(_FLUSH)
                else:
                    items += one
            self._dispatch(items)

    def _dispatch(self, items) -> None:
        """Dispatch ``items`` (a list of ``Request``s) or flush (``_FLUSH``); an error fails the run."""
        try:
            if items is _FLUSH:
                self.dispatcher.flush()
            elif items:
                self.dispatcher.dispatch(items)
        except Exception as e:  # noqa: BLE001 - never lose a sample silently
            log.exception("dispatch failed")
            self.ledger.fail(f"dispatch failed: {e!r}")

    def record(self) -> dict:
        out = {"routing": self.dispatcher.stats(), "transport": self.transport.name}
        out.update(self.transport.stats())
        if self._samples_before and len(out.get("engines", [])) == len(self._samples_before):  # this test's only
            out["engines"] = [dict(e, samples=e.get("samples", 0) - n)
                              for e, n in zip(out["engines"], self._samples_before)]
        if self.unconfirmed:
            out["prefix_caching_unconfirmed_replicas"] = self.unconfirmed
        return out
