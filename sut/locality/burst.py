"""One burst of a trace through the dispatch core: routing policy x started transport x one ledger.

Algorithm
---------
1. A fresh ``SampleLedger`` (``eos_ids=()``: outputs are not cut, the trace asks a fixed length;
   ``complete_fn`` records the outputs instead of calling LoadGen; request ids from ``first_id``) and
   a fresh ``Dispatcher`` over the started transport (``transport.attach``) with the given router.
2. Timed from here (``t0``): every request is issued to the ledger and dispatched (routing, send;
   a batching transport compresses and sends its batches) at its arrival time (``rate`` 0: all at
   once, one burst), then ``flush``. The dispatcher's observer records each completion's replica,
   cached tokens, engine timestamps and its arrival time here.
3. ``ledger.wait_idle``: until every request is answered, failing on a stall (no completion for
   ``stall_timeout_s``) or a transport's fatal event. The burst's wall time (``wall_s``) ends at the last
   completion's arrival; when nothing was answered (a replica-loss burst whose every request failed), it
   ends when the burst settled (every request failed: ``t_end``). Any ledger error -> ``RunFailed`` naming
   it (an unknown or duplicate request, a request answered by another replica than the one it was routed to:
   the dispatcher's and the ledger's own checks).
4. Validation of every request (``sut.locality.study.validate_results``): input hash as handed to
   the transport == the trace's (``expected_hashes``), answered exactly once, output length ==
   ``max_tokens``, served replica == routed replica. A failure -> ``RunFailed`` naming the requests.

Metrics (``BurstResult.metrics``): requests/s and output tokens/s over the wall time, cached share of input
tokens (the engines' cached-token counts; None when the transport cannot tell) and the share the router
expected (``router_cached_share``: 1 - its uncached estimates / the prompt tokens it routed, a re-routed
request counted at each route), engine-side TTFT and end-to-end percentiles where the transport reports
timestamps, and the client-side completion time from ``t0`` (what the study's standalone client timed); per
request, client-side TTFT, TPOT and latency percentiles, goodput against ``targets``, per-replica load and
its balance (``sut.locality.latency``).

A replica lost mid-burst (``kill``: the ``replica-loss`` workload, ``sut.locality.failover``): the kill
fires ``kill.at_s`` after ``t0`` (its timer starts there; never before the first dispatch has handed its
requests to the transport) or once enough requests are answered, the dispatcher re-routes or fails the lost
replica's requests instead of failing the run, step 3 waits until every request is answered or failed
(``loss_timeout_s`` after the kill without an answer fails the rest), the validation accepts a failed
request only empty and with its reason, and ``metrics["failover"]`` records what happened to each request.
Then ``requests_per_s`` counts the answered requests only (``answered``, ``failed``).
"""

from __future__ import annotations

import hashlib
import threading
import time
from dataclasses import dataclass, field
from typing import NamedTuple, Optional, Sequence

import numpy as np

from sut.core.dispatcher import Dispatcher
from sut.core.routing import Router
from sut.core.transport import Transport
from sut.errors import RunFailed
from sut.ledger.sample import SampleLedger
from sut.locality.failover import FailoverDispatcher, Killer, KillPlan
from sut.locality.latency import balance, latency_metrics, replica_load, request_times, spread
from sut.locality.study import RequestResult, raise_for_failures, validate_results
from sut.locality.trace import TraceRequest, input_hash
from sut.messages import Completion, Request


class _Sample(NamedTuple):
    """What ``SampleLedger.issue`` reads of a LoadGen sample: ``id`` (the trace rid) and ``index``."""

    id: int
    index: int


class _Recording(Transport):
    """The started transport as the dispatcher sees it: records what each submit hands over (request
    id -> (replica, input hash)) and passes everything through."""

    def __init__(self, inner: Transport):
        super().__init__(inner.spec)
        self.inner, self.name = inner, inner.name
        self.sent: dict[int, tuple[int, str]] = {}

    @property
    def replicas(self) -> int:
        return self.inner.replicas

    def start(self, sink):
        raise RuntimeError("a burst runs over a started transport")

    def attach(self, sink):
        return self.inner.attach(sink)

    def submit(self, replica, requests):
        for r in requests:
            self.sent[r.rid] = (replica, input_hash(r.prompt))
        self.inner.submit(replica, requests)

    def flush(self):
        self.inner.flush()

    def stop(self):
        self.inner.stop()


@dataclass(frozen=True)
class BurstSettings:
    """``max_tokens``: output tokens asked per request (a request's own ``TraceRequest.max_tokens`` wins);
    ``rate``: arrivals/s (Poisson, ``arrival_seed``; 0 = one burst); ``stall_timeout_s``; ``chunk``: requests
    per submit; ``first_id``: request id of the trace's first request; ``progress``: a progress bar;
    ``targets``: ``(ttft_s, tpot_s)`` of goodput (None: no goodput); ``kill``: a replica lost mid-burst; ``vocab_size``: the model's (every generated id must be
    below it, ``sut.core.answers``; 0: not checked)."""

    max_tokens: int
    rate: float = 0.0
    arrival_seed: int = 0
    stall_timeout_s: float = 900.0
    chunk: int = 512
    first_id: int = 0
    progress: bool = False
    targets: Optional[tuple] = None
    kill: Optional[KillPlan] = None
    vocab_size: int = 0


@dataclass
class BurstResult:
    """``metrics`` (module docstring), ``results`` (one ``RequestResult`` per answer, trace rids),
    ``output_hashes`` (trace rid -> sha256 of the int32 output ids), ``routing`` (the dispatcher's
    and router's counters)."""

    metrics: dict
    results: list = field(repr=False)
    output_hashes: dict = field(repr=False)
    routing: dict = field(default_factory=dict)


class _Collector:
    """The dispatcher's observer and the ledger's ``complete_fn``: what came back, by trace rid
    (request id - ``first_id``); ``sent``: when each request was handed to the dispatcher; ``killer``: told
    of every answer (a replica lost mid-burst)."""

    def __init__(self, first_id: int, killer: Optional[Killer] = None):
        self.first_id, self.killer = first_id, killer
        self.lock = threading.Lock()
        self.seen: dict[int, tuple[int, Completion, float]] = {}  # trace rid -> (replica, completion, arrival)
        self.outputs: dict[int, list] = {}  # trace rid -> every output the ledger sent for it
        self.sent: dict[int, float] = {}  # trace rid -> monotonic time it was dispatched
        self.last: Optional[float] = None  # monotonic time of the latest answer

    def observe(self, replica: int, c: Completion) -> None:
        with self.lock:
            self.last = time.monotonic()
            self.seen[c.rid - self.first_id] = (replica, c, self.last)
        if self.killer is not None:
            self.killer.on_answer(replica)

    def complete(self, batch) -> None:
        with self.lock:
            for sid, ids in batch:
                self.outputs.setdefault(int(sid), []).append(np.asarray(ids, dtype=np.int32))


def _arrivals(n: int, rate: float, seed: int) -> np.ndarray:
    if rate <= 0:
        return np.zeros(n)
    return np.cumsum(np.random.default_rng(seed).exponential(1.0 / rate, size=n))


def _send(trace, bs: BurstSettings, ledger: SampleLedger, disp: Dispatcher, col: _Collector) -> float:
    """Issue and dispatch every request at its arrival time; returns ``t0`` (monotonic s). A kill's timer
    (``col.killer``) starts at ``t0`` and is told when the first dispatch has handed its requests over."""
    arrivals = _arrivals(len(trace), bs.rate, bs.arrival_seed)
    t0 = time.monotonic()
    if col.killer is not None:
        col.killer.start()
    i = 0
    while i < len(trace) and ledger.error is None:
        due = t0 + arrivals[i] - time.monotonic()
        if due > 0:
            time.sleep(min(due, 0.5))
            continue
        j = i + 1
        while j < len(trace) and arrivals[j] <= time.monotonic() - t0:
            j += 1
        batch = []
        for rid, idx in ledger.issue([_Sample(r.rid, r.rid) for r in trace[i:j]]):
            if rid != bs.first_id + idx:
                raise RuntimeError(f"ledger gave request id {rid} to trace request {idx} (expected {bs.first_id + idx})")
            batch.append(Request(rid, trace[idx].prompt, idx, trace[idx].max_tokens))
        now = time.monotonic()
        with col.lock:
            for req in batch:
                col.sent[req.index] = now
        disp.dispatch(batch)
        if i == 0 and col.killer is not None:
            col.killer.released()
        i = j
    disp.flush()
    return t0


def run_burst(transport: Transport, router: Router, trace: Sequence[TraceRequest], bs: BurstSettings,
              expected_hashes: Optional[Sequence[str]] = None) -> BurstResult:
    """Send ``trace`` (trace rids ``0..n-1`` in arrival order) through the started ``transport``;
    collect, validate and measure it (module docstring). ``expected_hashes[rid]``: the trace's input
    hashes as recorded when it was built (default: computed from ``trace`` now).

    Raises:
        RunFailed: a transport failure (with ``kill``: one that is no replica loss), stall, unknown /
            duplicate / misrouted answer, a request without an outcome, or failed validation.
    """
    if [r.rid for r in trace] != list(range(len(trace))):
        raise ValueError("trace rids must be 0..n-1 in arrival order")
    col = _Collector(bs.first_id)
    rec = _Recording(transport)
    ledger = SampleLedger((), progress=bs.progress, complete_fn=col.complete, first_id=bs.first_id,
                          label=lambda _sid, index: f"trace request {index}")
    killer = None
    if bs.kill:
        disp = FailoverDispatcher(rec, router, ledger, chunk=bs.chunk, observer=col.observe, retries=bs.kill.retries,
                                  vocab_size=bs.vocab_size)
        killer = col.killer = Killer(bs.kill, transport, lambda: disp.router.routed[bs.kill.replica], arm=disp.arm)
    else:
        disp = Dispatcher(rec, router, ledger, chunk=bs.chunk, observer=col.observe, vocab_size=bs.vocab_size)
    disp.replicas = transport.attach(disp)
    try:
        t0 = _send(trace, bs, ledger, disp, col)
        if killer is not None:
            killer.all_routed()
        error = _wait_failover(ledger, disp, col, killer, bs) if killer else ledger.wait_idle(bs.stall_timeout_s)
        t_end = time.monotonic()  # the burst settled (every request answered or failed)
    finally:
        if killer is not None:  # the burst is over (or broke off): a kill not fired by now never fires
            killer.stop()
            killer.join()
    error = error or (killer.error if killer is not None else None)
    ledger.close(timeout=10.0)
    if error is not None:
        raise RunFailed(error)
    results, hashes = [], {}
    for rid, outs in sorted(col.outputs.items()):
        served = col.seen.get(rid, (None,))[0]
        routed, sent_hash = rec.sent.get(bs.first_id + rid, (None, ""))
        for ids in outs:
            results.append(RequestResult(rid, served, routed, ids, sent_hash))
            hashes[rid] = hashlib.sha256(ids.astype("<i4").tobytes()).hexdigest()
    failed = {rid - bs.first_id: why for rid, why in disp.failed.items()} if killer else None
    failures = validate_results(trace, results, bs.max_tokens, expected_hashes, failed)
    raise_for_failures(failures, "validation of the burst's requests")
    metrics = _metrics(trace, col, t0, bs, disp.stats(), t_end)
    if killer is not None:
        metrics.update(answered=len(col.seen), failed=len(failed),
                       failover=failover_record(disp, killer, col, len(trace), t0))
    return BurstResult(metrics, results, hashes, disp.stats())


def _wait_failover(ledger: SampleLedger, disp: FailoverDispatcher, col: _Collector, killer: Killer,
                   bs: BurstSettings) -> Optional[str]:
    """``wait_idle`` of a burst with a kill: after the kill, ``loss_timeout_s`` without an answer fails what is
    still outstanding (``failover`` step 5) instead of stalling; before it, the usual stall watchdog."""
    while not ledger.idle.wait(0.2):
        if killer.killed_at is None:
            ledger.check_stall(bs.stall_timeout_s)
        else:
            marks = [killer.killed_at, col.last or 0.0, *(x["detected"] for x in disp.losses)]
            if time.monotonic() - max(marks) > bs.kill.loss_timeout_s:
                disp.fail_outstanding(f"no answer within {bs.kill.loss_timeout_s:g} s after replica "
                                      f"{bs.kill.replica} was killed (the transport served no more)")
        if ledger.error is not None:
            break
    return ledger.error


def failover_record(disp: FailoverDispatcher, killer: Killer, col: _Collector, n: int, t0: float) -> dict:
    """What happened to each request of a burst with a kill (``sut.locality.failover``): counts per outcome,
    the kill and its detection, recovery times (seconds from the kill), failures with their reasons."""
    first = col.first_id
    outcome = disp.outcome([first + i for i in range(n)], [first + rid for rid, (_, c, _) in col.seen.items()])
    kinds = {k: sum(1 for v in outcome.values() if v == k) for k in ("answered", "rerouted", "failed")}
    k0 = killer.killed_at

    def after(t: Optional[float]) -> Optional[float]:
        return None if t is None or k0 is None else round(t - k0, 4)

    loss = disp.losses[0] if disp.losses else None
    rerouted = sorted(disp.rerouted_done.values())
    return {"killed": {"replica": killer.plan.replica, "trigger": killer.plan.trigger, "fired": k0 is not None,
                       "fired_by": killer.fired_by, **(killer.at or {}), "at_s": after_t0(k0, t0), "how": killer.how},
            "loss_seen": bool(disp.losses), **kinds, "requests": n,
            "detected_after_s": after(loss["detected"]) if loss else None,
            "detected_how": loss["how"] if loss else None,
            "losses": [{"replica": x["replica"], "kind": x["kind"], "after_s": after(x["detected"]),
                        "how": x["how"]}
                       for x in disp.losses],
            "recovery_s": after(rerouted[0]) if rerouted else None,
            "drained_s": after(rerouted[-1]) if rerouted else None, "late_answers_dropped": disp.late,
            "retries": killer.plan.retries, "loss_timeout_s": killer.plan.loss_timeout_s,
            "requests_rerouted": sorted(rid - first for rid, v in outcome.items() if v == "rerouted"),
            "requests_failed": {str(rid - first): why for rid, why in sorted(disp.failed.items())}}


def after_t0(t: Optional[float], t0: float) -> Optional[float]:
    return None if t is None else round(t - t0, 4)


def _router_share(estimated_uncached: Optional[int], routed_prompt: int) -> Optional[float]:
    """The cached share the router expected: 1 - its uncached estimates / the prompt tokens it routed (every
    route decision: a request re-routed after a replica loss counts each time, in both sums)."""
    return None if estimated_uncached is None else round(1 - estimated_uncached / max(1, routed_prompt), 4)


def _metrics(trace: Sequence[TraceRequest], col: _Collector, t0: float, bs: BurstSettings, routing: dict,
             t_end: float) -> dict:
    """Throughput, cached share, per-replica load and latencies of a validated burst (module docstring). ``wall_s``
    runs from ``t0`` to the last answer; when nothing was answered (every request failed after a replica loss) to
    ``t_end``, when the burst settled (its last request failed: at once where it was refused, else by the loss
    timeout), and then ``requests_per_s`` is 0."""
    seen = col.seen
    wall = max((t for _, _, t in seen.values()), default=t_end) - t0
    out_tokens = sum(len(c.token_ids) for _, c, _ in seen.values())
    prompt = sum(len(trace[rid].prompt) for rid in seen)  # every request, but a failed one (replica loss)
    cached = [c.cached_tokens for _, c, _ in seen.values()]
    cached_total = None if any(x is None for x in cached) else int(sum(cached))
    per = replica_load(trace, seen, t0)
    done = [c for _, c, _ in seen.values()]
    ttft = [c.t_first - c.t_queued for c in done if c.t_first is not None and c.t_queued is not None]
    e2e = [c.t_done - c.t_queued for c in done if c.t_done is not None and c.t_queued is not None]
    est = routing.get("estimated_uncached_tokens")
    return {
        "requests": len(trace), "wall_s": round(wall, 4),
        "requests_per_s": round(len(seen) / wall, 4), "output_tokens": out_tokens,
        "output_tokens_per_s": round(out_tokens / wall, 2), "prompt_tokens": prompt,
        "cached_tokens": cached_total,
        "cached_share": None if cached_total is None else round(cached_total / max(1, prompt), 4),
        "router_cached_share": _router_share(est, routing.get("routed_prompt_tokens", prompt)),
        "ttft_s": spread(ttft) if len(ttft) == len(done) else None,
        "e2e_s": spread(e2e) if len(e2e) == len(done) else None,
        "completion_s": spread([t - t0 for _, _, t in seen.values()]),
        **latency_metrics(request_times(seen, col.sent), wall, len(trace), bs.targets),
        "per_replica": per, "balance": balance(per),
    }
