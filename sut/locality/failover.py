"""A replica lost mid-burst: kill it, keep serving on the others, and account for every request.

Algorithm (the ``replica-loss`` workload, ``sut/locality/workloads/replica_loss.py``)
---------
1. **Kill.** ``KillPlan(replica, after, at_s=T)``: ``T`` seconds after the burst starts (its ``t0``; the caller
   sets ``T`` = ``after`` x the last warm-up's wall time, so that the kill lands mid-work on every system,
   however it delivers its answers), but never before the burst's first requests were handed to the transport
   (a ``T`` shorter than that hand-over, e.g. ``after`` near 0, fires right after it: a kill before any request
   was sent would measure a system that was down before the burst, every request refused at once, not a loss
   mid-burst), or earlier if, once every request of the burst is routed, replica ``replica``
   has answered ``(1 + after) / 2`` of the ``n`` requests routed to it and still holds some (a warm-up slowed
   by something else would otherwise put ``T`` after the end of the burst: no kill; the record's ``fired_by``
   says which fired). Without ``at_s``: once it has answered ``after`` of the ``n`` requests routed to it so
   far (in a burst: ``n`` = all of its share), so that it still holds some (a system that returns a
   batch's answers together has done the rest of its work by then). The harness
   kills it once (``kill_replica``): through the transport's own
   ``kill_replica(r)`` where it has one (test doubles), else ``SIGKILL`` to the pid the replica's own record
   reports (``ReplicaRecord.info["pid"]``: its engine process, which this harness or the Flame service
   started; what that process started is left to the transport's ``stop``).
2. **Detection.** The harness learns of the loss only as a router would: the transport's ``FatalEvent`` for
   that replica, or a ``submit`` that raises ``TransportError``. ``FatalEvent(None)`` (the whole transport
   failed) loses every replica. A loss before the kill fired is no part of the experiment: it fails the
   run (``RunFailed``, exit 1) as in any other burst.
3. **Re-route.** On the loss of replica r: ``Router.mark_down(r)``; every request outstanding on r (routed,
   not answered) is taken off it (``Router.done``) and, while it has re-routes left (``retries``), routed
   again among the live replicas and submitted; otherwise, when no replica is live, it is **failed** with
   the reason. A replica that refuses a submit is marked down too and the refused requests go elsewhere
   (or fail) the same way, but what it already holds stays outstanding: it may still answer.
4. **Late answers** of a lost replica for a request already re-routed or failed are dropped and counted.
5. **Settling.** The burst ends when every request is answered or failed. After the kill, when no request
   completes for ``loss_timeout_s``, every request still outstanding is failed ("no answer within ...
   after the loss"): a transport that stops serving its other replicas after one loss ends the burst with
   its requests failed, never with a hang. A failed request is answered empty to the ledger and recorded
   with its reason.

Outcome of each request: ``answered`` (by the replica it was first routed to), ``rerouted`` (answered by
another replica after the loss) or ``failed`` (with the reason); ``FailoverDispatcher.outcome`` checks that
every request of the burst has exactly one (nothing lost silently: ``RunFailed`` otherwise). Times
(seconds from the kill): ``detected_after_s`` (the loss reached the harness), ``recovery_s`` (the first
re-routed request answered), ``drained_s`` (the last re-routed request answered).
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from sut.core.dispatcher import Dispatcher
from sut.errors import RunFailed, TransportError
from sut.messages import Completion, FatalEvent, Request


@dataclass(frozen=True)
class KillPlan:
    """Kill replica ``replica`` once it has answered ``after`` (in (0, 1)) of the requests routed to it; a lost
    replica's requests get ``retries`` re-routes each; ``loss_timeout_s`` (module docstring, step 5)."""

    replica: int
    after: float
    retries: int = 1
    loss_timeout_s: float = 60.0
    at_s: Optional[float] = None  # seconds after the burst starts (None: the answers trigger)

    @property
    def trigger(self) -> dict:
        """How the kill fires, as recorded: ``{"when": "time", "at_s": T, "after": f}`` (at T, or at the answers
        share (1 + f) / 2 if that comes first) or ``{"when": "answers", "after": f}``."""
        if self.at_s is not None:
            return {"when": "time", "at_s": round(self.at_s, 4), "after": self.after}
        return {"when": "answers", "after": self.after}

    def threshold(self, routed: int) -> int:
        """Answers of the replica that trigger the kill when ``routed`` requests went to it (at least 1): ``after``
        of them, or with a time trigger (its fallback) ``(1 + after) / 2`` of them, so that the time normally
        comes first."""
        share = self.after if self.at_s is None else (1 + self.after) / 2
        return max(1, math.ceil(share * routed))


def kill_replica(transport, replica: int) -> str:
    """Kill ``replica`` of the started ``transport`` (module docstring, step 1); returns how.

    Raises:
        RunFailed: the replica reports no pid and the transport cannot kill it itself.
    """
    transport.planned_losses.add(replica)  # the transport reports this loss without its engine-log tail
    own = getattr(transport, "kill_replica", None)
    if callable(own):
        own(replica)
        return f"the {transport.name} transport's kill_replica({replica})"
    pid = (transport.records[replica].info or {}).get("pid") if replica < len(transport.records) else None
    if not isinstance(pid, int) or pid <= 1:
        raise RunFailed(f"replica {replica} reported no engine pid: it cannot be killed (replica-loss needs one)")
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return f"SIGKILL to pid {pid}: the replica's engine process was already gone"
    return f"SIGKILL to pid {pid} (replica {replica}'s engine process)"


class Killer:
    """Fires the kill once, on its own thread (never a transport's): ``plan.at_s`` after ``start`` (a timer; if it
    comes due before ``released``, at ``released``: the kill never precedes the burst's first submits), or
    once the plan's replica has answered its share of ``routed()`` (requests routed to it so far; every answer
    is counted either way, for the record; with a timer, only once ``all_routed`` was called and while the replica
    holds some), whichever comes first; ``fired_by`` says which ("time" / "answers"). ``arm`` is called just
    before the kill (the dispatcher takes losses from then on). ``answered``: the burst's answers, ``at``: the
    replica's, at the kill."""

    def __init__(self, plan: KillPlan, transport, routed, arm=None):
        self.plan, self.transport, self.routed, self.arm = plan, transport, routed, arm
        self.answered = self.mine = 0
        self.at: Optional[dict] = None
        self.killed_at: Optional[float] = None
        self.how: Optional[str] = None
        self.fired_by: Optional[str] = None
        self.error: Optional[str] = None
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._timer: Optional[threading.Timer] = None
        self._stopped = False  # the burst is over: no kill from now on
        self._all_routed = False  # every request of the burst is routed: a time trigger's answers fallback may fire
        self._released = False  # the burst's first requests were handed to the transport: the timer's kill may fire
        self._due = False  # the timer came due before that: the kill fires at ``released``

    def start(self) -> None:
        """The burst starts now (its ``t0``): with a time trigger, the kill fires ``plan.at_s`` seconds from here, or
        at ``released`` if that comes later (unless ``stop`` comes first: the burst ended before it)."""
        if self.plan.at_s is None:
            return
        self._timer = threading.Timer(self.plan.at_s, self._on_time)
        self._timer.name, self._timer.daemon = "replica-loss-timer", True
        self._timer.start()

    def stop(self) -> None:
        """The burst is over: a kill that has not fired never will (``at`` stays None), also one whose timer
        woke just now; the timer's thread is joined."""
        with self._lock:
            self._stopped = True
        if self._timer is not None:
            self._timer.cancel()
            if self._timer is not threading.current_thread():
                self._timer.join(10)

    def released(self) -> None:
        """The burst's first requests were handed to the transport (its first ``dispatch`` returned): a time
        trigger that came due before fires now (module docstring, step 1)."""
        with self._lock:
            self._released = True
            if self._due and self._thread is None and not self._stopped:
                self._fire_locked("time")

    def all_routed(self) -> None:
        """Every request of the burst has been routed (``routed()`` is the replica's whole share): a time trigger's
        answers fallback may fire from now on (with arrivals, a share of the requests routed so far says nothing
        about the kill time lying after the burst)."""
        with self._lock:
            self._all_routed = True

    def on_answer(self, replica: int) -> None:
        with self._lock:
            self.answered += 1
            self.mine += replica == self.plan.replica
            routed = self.routed()  # a time trigger's fallback: only on the whole share, while the replica holds some
            by_answers = self.plan.at_s is None or (self._all_routed and self.mine < routed)
            if (replica == self.plan.replica and self._thread is None and not self._stopped and by_answers
                    and self.mine >= self.plan.threshold(routed)):
                self._fire_locked("answers")

    def _on_time(self) -> None:
        with self._lock:
            if not self._released:  # nothing sent yet: the kill waits for the first requests (``released``)
                self._due = True
            elif self._thread is None and not self._stopped:
                self._fire_locked("time")

    def _fire_locked(self, by: str) -> None:
        routed = self.routed()
        self.fired_by = by
        self.at = {"replica_answered": self.mine, "replica_routed": routed,
                   "replica_outstanding": routed - self.mine, "burst_answered": self.answered}
        self.killed_at = time.monotonic()
        self._thread = threading.Thread(target=self._kill, name="replica-loss-kill", daemon=True)
        self._thread.start()  # under the lock: a stop and join that follow always find it started

    def _kill(self) -> None:
        if self.arm is not None:
            self.arm()
        try:
            self.how = kill_replica(self.transport, self.plan.replica)
        except Exception as e:  # noqa: BLE001 - recorded; the burst then fails as a run failure
            self.error = f"killing replica {self.plan.replica} failed: {e}"

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join(10)


class FailoverDispatcher(Dispatcher):
    """``Dispatcher`` whose replica losses re-route instead of failing the run (module docstring, 2-4).

    Args (beyond ``Dispatcher``'s): ``retries``: re-routes per request.
    """

    def arm(self) -> None:
        """The planned kill fires now: losses are re-routed from here on (module docstring, step 2)."""
        self.armed = True

    def __init__(self, transport, router, ledger, chunk: int = 512, observer=None, retries: int = 1,
                 vocab_size: int = 0):
        super().__init__(transport, router, ledger, chunk=chunk, observer=observer, vocab_size=vocab_size)
        self.retries = retries
        self.requests: dict[int, Request] = {}
        self.first_replica: dict[int, int] = {}
        self.reroutes: Counter = Counter()
        self.failed: dict[int, str] = {}
        self.rerouted_done: dict[int, float] = {}  # rid -> monotonic time its re-routed answer came
        self.losses: list[dict] = []
        self.late = 0
        self.armed = False  # set when the planned kill fires: a loss before it is a failure of the run
        self.lost: set[int] = set()  # replicas whose fatal event came (a refused submit only marks one down)
        self._unanswered: list[int] = []  # failed, not yet answered to the ledger

    def dispatch(self, items: Sequence[Request]) -> None:
        reused = self._reused_id(items)
        if reused is not None:
            self.ledger.fail(f"dispatch refused: {reused}")
            return
        with self._lock:
            for req in items:
                self.requests[req.rid] = req
        self._route_and_send(items, first=True)

    def _route_and_send(self, items: Sequence[Request], first: bool) -> None:
        per: dict[int, list] = {}
        with self._lock:
            for req in items:
                try:
                    r = self.router.route(req.rid, req.prompt)
                except ValueError as e:  # every replica is down
                    self._fail_locked(req.rid, str(e))
                    continue
                self._where[req.rid] = r
                if req.max_tokens:
                    self._asked[req.rid] = req.max_tokens
                if first:
                    self.first_replica[req.rid] = r
                per.setdefault(r, []).append(req)
        for r, batch in per.items():
            for i in range(0, len(batch), self.chunk):
                try:
                    self.transport.submit(r, batch[i:i + self.chunk])
                except TransportError as e:  # this and the later chunks go elsewhere
                    self.lose(r, f"submit to replica {r} failed: {e}", [req.rid for req in batch[i:]])
                    break
        self._answer_failed()

    def _fail_locked(self, rid: int, reason: str) -> None:
        if rid not in self.failed:
            self.failed[rid] = reason
            self._unanswered.append(rid)

    def _answer_failed(self) -> None:
        with self._lock:
            pending, self._unanswered = self._unanswered, []
        if pending:
            self.ledger.complete([(rid, np.zeros(0, np.int32)) for rid in pending])

    def lose(self, replica: Optional[int], how: str, rids: Optional[Sequence[int]] = None) -> None:
        """Replica ``replica`` (None: every replica) is lost (a fatal event: every request outstanding there is
        re-routed or failed), or refused a submit (``rids``: those requests only; the ones it already holds stay
        outstanding, to be answered or failed by the loss timeout). Either way no later request goes there."""
        if not self.armed:
            self.ledger.fail(f"replica {replica} failed before the planned kill: {how}")
            return
        again = []
        with self._lock:
            targets = list(range(self.router.replicas)) if replica is None else [replica]
            new = [r for r in targets if r not in self.lost]
            if rids is None and not new:
                return
            if rids is None:
                self.lost.update(new)
            for r in targets:
                if r not in self.router.down:
                    self.router.mark_down(r)
            self.losses.append({"replica": replica, "detected": time.monotonic(), "how": how[:1000],
                                "kind": "fatal event" if rids is None else "submit refused"})
            moving = [rid for rid, r in self._where.items() if r in new] if rids is None else rids
            for rid in [rid for rid in moving if self._where.get(rid) in targets]:
                r = self._where.pop(rid)
                self.router.done(rid)
                self._asked.pop(rid, None)
                if self.reroutes[rid] >= self.retries:
                    what = "lost" if rids is None else "refused it"
                    self._fail_locked(rid, f"replica {r} {what} ({how[:200]}); no re-route left")
                else:
                    self.reroutes[rid] += 1
                    again.append(self.requests[rid])
        if again:
            self._route_and_send(again, first=False)
        self._answer_failed()

    def fail_outstanding(self, reason: str) -> int:
        """Fail every request still outstanding (step 5); returns how many."""
        with self._lock:
            left = list(self._where)
            for rid in left:
                self._where.pop(rid)
                self.router.done(rid)
                self._asked.pop(rid, None)
                self._fail_locked(rid, reason)
        self._answer_failed()
        return len(left)

    def on_results(self, replica: int, results: list[Completion]) -> None:
        keep, now = [], time.monotonic()
        with self._lock:
            for c in results:
                r = self._where.get(c.rid)
                if (r is None and (c.rid in self.failed or c.rid in self.reroutes)) or \
                        (r is not None and r != replica and replica in self.router.down):
                    self.late += 1  # a lost replica's answer to a request that went elsewhere (step 4)
                    continue
                if r == replica and self.reroutes.get(c.rid):
                    self.rerouted_done[c.rid] = now
                keep.append(c)
        if keep:
            super().on_results(replica, keep)

    def on_fatal(self, event: FatalEvent) -> None:
        self.lose(event.replica, event.message)

    def outcome(self, rids: Sequence[int], answered: Sequence[int]) -> dict[int, str]:
        """``{rid: "answered" | "rerouted" | "failed"}`` for every request of the burst. ``answered``: the rids
        that came back with output. ``RunFailed`` when a request has no outcome or two (answered and failed)."""
        out, got = {}, set(answered)
        for rid in rids:
            kinds = [k for k, hit in (("failed", rid in self.failed), ("answered", rid in got)) if hit]
            if len(kinds) != 1:
                raise RunFailed(f"request {rid}: {'no outcome' if not kinds else 'answered and failed'} after the "
                                "replica loss (every request must be answered, re-routed or failed, once)")
            out[rid] = "rerouted" if kinds == ["answered"] and self.reroutes.get(rid) else kinds[0]
        return out
