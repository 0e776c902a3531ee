"""The dispatcher: routing policy x transport x ledger, the one path every SUT and the locality runner use.

Algorithm
---------
``dispatch([Request, ...])`` routes each request (``sut.core.routing``; the policy books its
load) and hands the requests of each replica to the transport in chunks of ``chunk``, sending a
chunk as soon as it is full, so engines start on a large Offline query while the rest is still
being routed. A request id used twice (twice in one ``dispatch``, or again while still outstanding)
fails the run naming it before anything of that dispatch is routed. The dispatcher is the
transport's ``ResultSink``:

* ``on_first``: the policy learns the delivery's first tokens (``least_pending``; ``first_many``: the replica
  re-keyed once a delivery), then the ledger
  (``first_tokens``: LoadGen's ``FirstTokenComplete``).
* ``on_results``: each completion must come from the replica its request was routed to (else the
  run fails naming the request and both replicas), then pass the one answer check of every transport
  (``sut.core.answers.AnswerCheck``: a length the generation settings allow, every id inside the
  model's vocabulary, an answer shorter than ``max_tokens`` (a request that asks its own ``Request.max_tokens``: that
  many) ending in an EOS id unless the run ignores EOS; else the run fails naming the request, its QSL index and LoadGen sample, the replica and what
  came back); the policy takes its load off (``done_many``: once a delivery); the optional ``observer(replica, completion)`` sees it
  (the locality runner records cached tokens and times); then the ledger answers it (an unknown or
  duplicate request id fails the run there). A streamed first token outside the vocabulary fails
  the run before it reaches the ledger.
* ``on_fatal``: the ledger fails the run with the event's message, plus the QSL index and LoadGen
  sample of its request where it names one (every outstanding sample is answered exactly once, empty).

A submit that raises ``TransportError`` (a dead replica) waits up to ``death_report_s`` for the
transport's own ``FatalEvent``, which says how the replica ended, before failing the run with the
submit's error.

The ledger is duck-typed: ``complete(results)`` (one that also takes ``answers=`` gets the checked
delivery's ``sut.ledger.response.Answers``, made once for the check and the EOS cut), ``fail(message)``,
``first_tokens(results)``
(streaming only), ``error`` and, optionally, ``describe(request id)`` (the sample it answers, for messages)
(``sut.ledger.sample.SampleLedger``, ``sut.ledger.streaming.StreamingLedger``).
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
from typing import Callable, Optional, Sequence

from sut.core.answers import AnswerCheck
from sut.core.routing import Router
from sut.core.transport import Transport
from sut.errors import TransportError
from sut.messages import Completion, FatalEvent, FirstToken, ReplicaRecord, Request

log = logging.getLogger(__name__)

#: Seconds a failed submit waits for the transport to report how the replica ended.
DEATH_REPORT_S = 3.0


class Dispatcher:
    """Routes requests to a transport's replicas and answers every one exactly once through a ledger.

    Args:
        transport: built, not started.
        router: a routing policy over ``transport.replicas`` replicas.
        ledger: ``SampleLedger``-like (module docstring).
        chunk: requests per ``submit`` call (>= 1).
        observer: called with ``(replica, Completion)`` for every valid completion, before the ledger.
        vocab_size: the model's vocabulary size (``config.json`` ``vocab_size``): every generated id must be
            below it (0: not checked). EOS ids and lengths come from ``transport.spec.generation``.
    """

    def __init__(self, transport: Transport, router: Router, ledger, chunk: int = 512,
                 observer: Optional[Callable[[int, Completion], None]] = None, death_report_s: float = DEATH_REPORT_S,
                 vocab_size: int = 0):
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        if router.replicas != transport.replicas:
            raise ValueError(f"router has {router.replicas} replicas, transport {transport.replicas}")
        self.transport, self.router, self.ledger = transport, router, ledger
        self.chunk, self.observer, self.death_report_s = chunk, observer, death_report_s
        self._lock = threading.Lock()
        self._where: dict[int, int] = {}  # request id -> replica, until answered
        self._asked: dict[int, int] = {}  # request id -> its own max_tokens (requests that ask one), until answered
        self.replicas: list[ReplicaRecord] = []
        self.answered = [0] * transport.replicas
        self.check = AnswerCheck(transport.spec.generation, vocab_size)
        self._takes_answers = "answers" in inspect.signature(ledger.complete).parameters

    def start(self) -> list[ReplicaRecord]:
        """Start the transport with this dispatcher as its sink (blocks; ``TransportError``)."""
        self.replicas = self.transport.start(self)
        return self.replicas

    # -- requests out --------------------------------------------------------------------------
    def dispatch(self, items: Sequence[Request]) -> None:
        """Route and send requests; failures go to the ledger (never raises). A request id that comes
        twice in ``items``, or is still outstanding from an earlier dispatch, fails the run naming it
        before anything of ``items`` is routed."""
        reused = self._reused_id(items)
        if reused is not None:
            self.ledger.fail(f"dispatch refused: {reused}")
            return
        per: dict[int, list] = {}
        try:
            for lo in range(0, len(items), self.chunk):  # one lock hold per chunk of requests, full chunks sent at once
                for r, batch in self._route_locked(items[lo:lo + self.chunk], per):
                    self.transport.submit(r, batch)
            for r, batch in per.items():
                if batch:
                    self.transport.submit(r, batch)
        except TransportError as e:
            deadline = time.monotonic() + self.death_report_s
            while self.ledger.error is None and time.monotonic() < deadline:
                time.sleep(0.05)
            self.ledger.fail(f"dispatch failed: {e}")

    def _route_locked(self, part: Sequence[Request], per: dict) -> list:
        """Route ``part`` under the lock into ``per`` (replica -> requests not sent yet); returns the
        ``(replica, requests)`` that reached ``chunk`` (taken out of ``per``), to be sent."""
        full = []
        route, where, asked, chunk = self.router.route, self._where, self._asked, self.chunk
        with self._lock:
            for req in part:
                r = where[req.rid] = route(req.rid, req.prompt)
                if len(req) > 3 and req.max_tokens:
                    asked[req.rid] = req.max_tokens
                batch = per.get(r)
                if batch is None:
                    batch = per[r] = []
                batch.append(req)
                if len(batch) >= chunk:
                    full.append((r, batch))
                    per[r] = []
        return full

    def _reused_id(self, items: Sequence[Request]) -> Optional[str]:
        """Why ``items`` cannot be dispatched (a request id used twice), or None."""
        seen = {req.rid for req in items}
        if len(seen) != len(items):  # rare: find which one, in order
            once: set[int] = set()
            for req in items:
                if req.rid in once:
                    return f"request id {req.rid} came twice in one dispatch (ids must be unique)"
                once.add(req.rid)
        with self._lock:
            old = None if self._where.keys().isdisjoint(seen) else next(rid for rid in seen if rid in self._where)
        return None if old is None else f"request id {old} is still outstanding from an earlier dispatch"

    def flush(self) -> None:
        self.transport.flush()

    # -- results in (ResultSink, on the transport's threads) -------------------------------------
    def on_first(self, replica: int, firsts: list[FirstToken]) -> None:
        wrong = None
        where, mine = self._where, []
        with self._lock:
            for f in firsts:
                r = where.get(f.rid)
                if r == replica:
                    mine.append(f)
                elif r is not None:
                    wrong = wrong or (f.rid, r)
            self.router.first_many([f.rid for f in mine])  # the replica's score once per delivery
        bad = self.check.first_fault(mine)
        if wrong is not None:
            self.ledger.fail(f"first token of request {wrong[0]}{self._sample(wrong[0])} was routed to replica "
                             f"{wrong[1]} but came from {self._replica(replica)}")
            return
        if bad is not None:
            self.ledger.fail(f"request {bad[0]}{self._sample(bad[0])}: {self._replica(replica)} {bad[1]}")
            return
        self.ledger.first_tokens(firsts)

    def on_results(self, replica: int, results: list[Completion]) -> None:
        wrong, ok, asked = None, [], []
        with self._lock:
            own = self._asked.pop if self._asked else None  # MLPerf runs: no request asks its own length
            for c in results:
                r = self._where.get(c.rid)
                if r is None:
                    continue  # unknown or answered twice: the ledger fails the run naming it
                if r != replica:
                    wrong = wrong or (c.rid, r)
                    continue
                del self._where[c.rid]
                ok.append(c)
                if own is not None:
                    asked.append(own(c.rid, 0))
            self.router.done_many([c.rid for c in ok])  # the replica's load once per delivery
            self.answered[replica] += len(ok)
        if wrong is not None:
            self.ledger.fail(f"request {wrong[0]}{self._sample(wrong[0])} was routed to replica {wrong[1]} but "
                             f"answered by {self._replica(replica)}")
            return
        fault, answers = self.check.check(ok, asked or None)
        if fault is not None:
            rid = ok[fault[0]].rid
            self.ledger.fail(f"request {rid}{self._sample(rid)}: {self._replica(replica)} {fault[1]}")
            return
        if self.observer is not None:
            for c in ok:
                self.observer(replica, c)
        if answers is not None and len(ok) == len(results) and self._takes_answers:  # checked arrays: cut once
            self.ledger.complete(results, answers=answers)
        else:
            self.ledger.complete(results)

    def _replica(self, replica: int) -> str:
        """``replica R``, with its server URL where it has one (``http`` transport)."""
        url = next((r.info.get("url") for r in self.replicas if r.index == replica), None)
        return f"replica {replica} ({url})" if url else f"replica {replica}"

    def _sample(self, rid: int) -> str:
        """`` (QSL index I, LoadGen sample S)`` of request ``rid`` where the ledger can tell, else ``""``."""
        describe = getattr(self.ledger, "describe", None)
        what = describe(rid) if describe is not None else None
        return f" ({what})" if what else ""

    def on_fatal(self, event: FatalEvent) -> None:
        """Fail the run with the event's message, and the QSL index and LoadGen sample of its request (if any)."""
        self.ledger.fail(event.message + (self._sample(event.rid) if event.rid is not None else ""))

    # -- record ----------------------------------------------------------------------------------
    @property
    def outstanding(self) -> int:
        with self._lock:
            return len(self._where)

    def outstanding_by_replica(self) -> dict[int, int]:
        """``{replica index: samples routed there and not yet answered}`` (every replica, zeros too)."""
        with self._lock:
            counts = {r.index: 0 for r in self.replicas}
            for r in self._where.values():
                counts[r] = counts.get(r, 0) + 1
        return counts

    def stats(self) -> dict:
        with self._lock:
            return dict(self.router.stats(), answered=list(self.answered))
