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
   ``stall_timeout_s``) or a transport's fatal event. The burst's wall time ends at the last
   completion's arrival. Any ledger error -> ``RunFailed`` naming it (an unknown or duplicate
   request, a request answered by another replica than the one it was routed to: the dispatcher's
   and the ledger's own checks).
4. Validation of every request (``sut.locality.study.validate_results``): input hash as handed to
   the transport == the trace's (``expected_hashes``), answered exactly once, output length ==
   ``max_tokens``, served replica == routed replica. A failure -> ``RunFailed`` naming the requests.

Metrics (``BurstResult.metrics``): requests/s and output tokens/s over the wall time, cached share
of input tokens (the engines' cached-token counts; None when the transport cannot tell), engine-side
TTFT and end-to-end percentiles where the transport reports timestamps, and the client-side
completion time from ``t0`` (what the study's standalone client timed).
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
    """``max_tokens``: output tokens asked per request; ``rate``: arrivals/s (Poisson, ``arrival_seed``;
    0 = one burst); ``stall_timeout_s``; ``chunk``: requests per submit; ``first_id``: request id of
    the trace's first request; ``progress``: a progress bar; ``vocab_size``: the model's (every generated id must
    be below it, ``sut.core.answers``; 0: not checked)."""

    max_tokens: int
    rate: float = 0.0
    arrival_seed: int = 0
    stall_timeout_s: float = 900.0
    chunk: int = 512
    first_id: int = 0
    progress: bool = False
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


def _pct(values: Sequence[float], q: float) -> Optional[float]:
    return round(float(np.percentile(values, q)), 4) if len(values) else None


def _latency(values: Sequence[float]) -> Optional[dict]:
    return {"p50": _pct(values, 50), "p90": _pct(values, 90), "p99": _pct(values, 99)} if len(values) else None


class _Collector:
    """The dispatcher's observer and the ledger's ``complete_fn``: what came back, by trace rid
    (request id - ``first_id``)."""

    def __init__(self, first_id: int):
        self.first_id = first_id
        self.lock = threading.Lock()
        self.seen: dict[int, tuple[int, Completion, float]] = {}  # trace rid -> (replica, completion, arrival)
        self.outputs: dict[int, list] = {}  # trace rid -> every output the ledger sent for it

    def observe(self, replica: int, c: Completion) -> None:
        with self.lock:
            self.seen[c.rid - self.first_id] = (replica, c, time.monotonic())

    def complete(self, batch) -> None:
        with self.lock:
            for sid, ids in batch:
                self.outputs.setdefault(int(sid), []).append(np.asarray(ids, dtype=np.int32))


def _arrivals(n: int, rate: float, seed: int) -> np.ndarray:
    if rate <= 0:
        return np.zeros(n)
    return np.cumsum(np.random.default_rng(seed).exponential(1.0 / rate, size=n))


def _send(trace, bs: BurstSettings, ledger: SampleLedger, disp: Dispatcher) -> float:
    """Issue and dispatch every request at its arrival time; returns ``t0`` (monotonic s)."""
    arrivals = _arrivals(len(trace), bs.rate, bs.arrival_seed)
    t0 = time.monotonic()
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
            batch.append(Request(rid, trace[idx].prompt, idx))
        disp.dispatch(batch)
        i = j
    disp.flush()
    return t0


def run_burst(transport: Transport, router: Router, trace: Sequence[TraceRequest], bs: BurstSettings,
              expected_hashes: Optional[Sequence[str]] = None) -> BurstResult:
    """Send ``trace`` (trace rids ``0..n-1`` in arrival order) through the started ``transport``;
    collect, validate and measure it (module docstring). ``expected_hashes[rid]``: the trace's input
    hashes as recorded when it was built (default: computed from ``trace`` now).

    Raises:
        RunFailed: a transport failure, stall, unknown/duplicate/misrouted answer or failed validation.
    """
    if [r.rid for r in trace] != list(range(len(trace))):
        raise ValueError("trace rids must be 0..n-1 in arrival order")
    col = _Collector(bs.first_id)
    rec = _Recording(transport)
    ledger = SampleLedger((), progress=bs.progress, complete_fn=col.complete, first_id=bs.first_id,
                          label=lambda _sid, index: f"trace request {index}")
    disp = Dispatcher(rec, router, ledger, chunk=bs.chunk, observer=col.observe, vocab_size=bs.vocab_size)
    disp.replicas = transport.attach(disp)
    t0 = _send(trace, bs, ledger, disp)
    error = ledger.wait_idle(bs.stall_timeout_s)
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
    failures = validate_results(trace, results, bs.max_tokens, expected_hashes)
    raise_for_failures(failures, "validation of the burst's requests")
    return BurstResult(_metrics(trace, col.seen, t0), results, hashes, disp.stats())


def _metrics(trace: Sequence[TraceRequest], seen: dict, t0: float) -> dict:
    """Throughput, cached share, per-replica counts and latencies of a validated burst (module docstring)."""
    wall = max(t for _, _, t in seen.values()) - t0
    out_tokens = sum(len(c.token_ids) for _, c, _ in seen.values())
    prompt = sum(len(r.prompt) for r in trace)
    cached = [c.cached_tokens for _, c, _ in seen.values()]
    cached_total = None if any(x is None for x in cached) else int(sum(cached))
    per: dict[int, dict] = {}
    for rid, (rep, c, _) in sorted(seen.items()):
        p = per.setdefault(rep, {"replica": rep, "requests": 0, "prompt_tokens": 0, "cached_tokens": 0})
        p["requests"] += 1
        p["prompt_tokens"] += len(trace[rid].prompt)
        p["cached_tokens"] = None if c.cached_tokens is None or p["cached_tokens"] is None else \
            p["cached_tokens"] + int(c.cached_tokens)
    done = [c for _, c, _ in seen.values()]
    ttft = [c.t_first - c.t_queued for c in done if c.t_first is not None and c.t_queued is not None]
    e2e = [c.t_done - c.t_queued for c in done if c.t_done is not None and c.t_queued is not None]
    return {
        "requests": len(trace), "wall_s": round(wall, 4),
        "requests_per_s": round(len(trace) / wall, 4), "output_tokens": out_tokens,
        "output_tokens_per_s": round(out_tokens / wall, 2), "prompt_tokens": prompt,
        "cached_tokens": cached_total,
        "cached_share": None if cached_total is None else round(cached_total / max(1, prompt), 4),
        "ttft_s": _latency(ttft) if len(ttft) == len(done) else None,
        "e2e_s": _latency(e2e) if len(e2e) == len(done) else None,
        "completion_s": _latency([t - t0 for _, _, t in seen.values()]),
        "per_replica": [per[r] for r in sorted(per)],
    }
