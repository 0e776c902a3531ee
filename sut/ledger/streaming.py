"""The sample ledger of the Server and Interactive scenarios: first tokens, then whole responses.

LoadGen (6.0.17, ``use_token_latencies`` on, any scenario but Offline) needs, for every sample, one
``FirstTokenComplete`` before its ``QuerySamplesComplete`` ("Attempted to record a sample latency
before it's first token latency" otherwise); TTFT is counted from the query's scheduled time to that
call, TPOT from it to the completion, divided by ``n_tokens - 1``. TEST06 then checks that the logged
first-token ids are a prefix of the response.

:class:`StreamingLedger` extends :class:`sut.ledger.sample.SampleLedger`:

- ``first_tokens([(request id, first id)])`` queues one ``FirstTokenComplete`` call (each response:
  one little-endian int32, ``n_tokens`` 1, its buffer alive until the call returns) on the same
  long-lived completer thread as every ``QuerySamplesComplete``, so a sample's first token always
  reaches LoadGen before its completion (one FIFO outbox, one thread). Not from the thread that delivers
  it, even when that call returns before the completion is queued: LoadGen 6.0.17 records both through
  per-thread log buffers that its IO thread drains in any order, and a Server run that sent first tokens
  from the delivering threads logged "Attempted to record a sample latency before it's first token
  latency" for most of its samples (measured with ``python -m sut bench-harness``'s 5,000 q/s case);
- ``complete`` refuses (the run fails, every outstanding sample answered empty) a response whose
  first id is not the reported first token, or that comes without one;
- a sample answered empty after a failure gets an empty ``FirstTokenComplete`` first when it has
  had none: LoadGen 6.0.17 in accuracy mode crashes the process (SIGSEGV, logging the first token
  it never got) on a ``QuerySamplesComplete`` without one (tests/test_http_transport.py, the Server
  accuracy run with an answer cut short);
- (``issue`` after a failure answers the new samples empty at once, as every ledger does: in Server,
  LoadGen keeps issuing queries after the run has failed);
- per-sample latencies measured by the harness (from ``issue_queries`` to the first token reaching
  the ledger, and from there to the whole response, per further token), summarised by
  :meth:`latency_summary` for ``run.json`` next to LoadGen's own.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Iterable, Optional, Sequence

import numpy as np

from sut.ledger.response import Answers, complete_samples, first_token_complete
from sut.ledger.sample import EMPTY_FIRST, FAIL_CHUNK, FIRST, SampleLedger
from sut.record.latency_trend import queue_trend

log = logging.getLogger(__name__)


def _pct(values: list, q: float) -> Optional[float]:
    return None if not values else float(np.percentile(np.asarray(values), q))


class StreamingLedger(SampleLedger):
    """A :class:`SampleLedger` that also reports first tokens (see the module docstring).

    Extra counters: ``first_sent`` (samples whose ``FirstTokenComplete`` call returned), and the
    harness's per-sample ``timings``: ``(issued, first token, done)`` times (``time.monotonic``) and output ids,
    one tuple per answered sample (:meth:`latency_arrays` turns them into TTFT / TPOT / end-to-end seconds).
    An outstanding request's entry: ``(sample id, QSL index, issued, first id or None, first token time)``.

    Args:
        first_fn: sends ``[(loadgen sample id, first id)]`` to LoadGen (tests pass a recorder);
            the other arguments as :class:`SampleLedger`.
    """

    def __init__(self, eos_ids: Iterable[int], progress: bool = True, complete_fn: Callable = complete_samples,
                 fail_chunk: int = FAIL_CHUNK, first_fn: Callable = first_token_complete, first_id: int = 0):
        super().__init__(eos_ids, progress=progress, complete_fn=complete_fn, fail_chunk=fail_chunk, first_id=first_id)
        self._first_fn = first_fn
        self.first_sent = 0
        self.timings: list[tuple[float, float, float, int]] = []

    def _new_entry(self, sample_id: int, index: int, now: float) -> tuple:
        return sample_id, index, now, None, None

    def first_tokens(self, results: Sequence[tuple[int, int]]) -> None:
        """Queue ``(request id, first generated id)`` pairs for ``FirstTokenComplete``.

        A request that is unknown, already finished or already has its first token fails the run.
        Results after a failure are dropped.
        """
        now = time.monotonic()
        with self._lock:
            if self.error is not None:
                return
            send, bad = [], []
            outstanding = self._outstanding
            get = outstanding.get
            for r in results:
                entry = get(r[0])
                if entry is None or entry[3] is not None:
                    bad.append(r[0])
                    continue
                first = int(r[1])
                outstanding[r[0]] = (entry[0], entry[1], entry[2], first, now)
                send.append((entry[0], first))
            if send:
                self._post_locked(FIRST, send)
            if bad:
                self._fail_locked(f"first token of request {bad[0]} reported twice, after its response, or for a "
                                  "request never issued" + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""))

    def _send_firsts(self, pairs: list) -> None:
        """On the completer thread: one ``FirstTokenComplete`` call for ``(sample id, first id)`` pairs."""
        try:
            self._first_fn(pairs)
        except Exception as e:  # noqa: BLE001 - LoadGen may not have these samples: the run fails
            with self._lock:
                if self.error is None:
                    self._fail_locked(f"FirstTokenComplete failed for {len(pairs)} sample(s): {e!r}")

    def _firstless(self, entries: list) -> list:
        return [e[0] for e in entries if e[3] is None]

    def _answer_empty_locked(self, sample_ids: list, firstless: Optional[list] = None) -> None:
        """An empty first token for each sample that has had none (``firstless``; None: all of ``sample_ids``,
        samples issued after a failure), then the empty responses (one FIFO queue: LoadGen gets them in that
        order)."""
        firstless = sample_ids if firstless is None else firstless
        for i in range(0, len(firstless), self._fail_chunk):
            self._post_locked(EMPTY_FIRST, firstless[i:i + self._fail_chunk])
        super()._answer_empty_locked(sample_ids)

    def _send_empty(self, kind: int, batch: list) -> None:
        """On the completer thread: ``EMPTY_FIRST``: one ``FirstTokenComplete`` of empty first tokens for LoadGen
        sample ids ``batch`` (not counted in ``first_sent``; the run has failed already, so an error here is only
        logged); ``EMPTY``: the empty answers."""
        if kind != EMPTY_FIRST:
            super()._send_empty(kind, batch)
            return
        try:
            self._first_fn([(sid, None) for sid in batch])
        except Exception:  # noqa: BLE001
            log.exception("empty FirstTokenComplete for %d sample(s) failed", len(batch))

    def _check_answers_locked(self, rids: list, entries: list, answers: Answers, cut: list) -> Optional[str]:
        """Every answer of the delivery must start with its reported first token (none reported, or another
        id, refuses the delivery: the run fails); then its ``timings`` are kept."""
        flat, starts = answers.flat, answers.starts
        if all(cut):  # every answer has ids: their first ids in one numpy pass
            heads = flat[starts].tolist()
        else:
            heads = [int(flat[a]) if n else None for a, n in zip(starts, cut)]
        for i, e in enumerate(entries):
            first = e[3]
            if first is None:
                return (f"request {rids[i]} finished without a first token (Server/Interactive need "
                        "FirstTokenComplete before the response)")
            if heads[i] != first:
                got = [] if heads[i] is None else [heads[i]]
                return f"request {rids[i]}: first token {first} was reported, but the response starts with {got}"
        now = time.monotonic()
        self.timings.extend((e[2], e[4], now, n) for e, n in zip(entries, cut))
        return None

    def latency_arrays(self) -> dict[str, np.ndarray]:
        """Per answered sample (seconds; one array each, same order): ``issued`` (monotonic time), ``ttft``,
        ``e2e`` (issue to the whole response) and ``tpot`` (NaN for a one-token answer: it has no TPOT)."""
        t = np.asarray(self.timings, dtype=float).reshape(-1, 4)
        issued, first, done, n = t.T
        with np.errstate(divide="ignore", invalid="ignore"):
            tpot = np.where(n > 1, (done - first) / (n - 1), np.nan)
        return {"issued": issued, "ttft": first - issued, "e2e": done - issued, "tpot": tpot}

    def latency_summary(self, horizon_s: Optional[float] = None, ttft_limit_ms: Optional[float] = None,
                        arrays: Optional[dict] = None) -> dict:
        """The harness's per-sample TTFT / TPOT (ms): count, mean, p50, p90, p99, max; and ``ttft_trend``
        (:func:`sut.record.latency_trend.queue_trend` projected to ``horizon_s`` against ``ttft_limit_ms``).
        ``arrays``: :meth:`latency_arrays`, when the caller has them already."""
        a = arrays if arrays is not None else self.latency_arrays()
        out = {}
        for name, vals in (("ttft_ms", a["ttft"]), ("tpot_ms", a["tpot"][np.isfinite(a["tpot"])])):
            ms = (vals * 1e3).tolist()
            out[name] = {"samples": len(ms), "mean": float(np.mean(ms)) if ms else None,
                         "p50": _pct(ms, 50), "p90": _pct(ms, 90), "p99": _pct(ms, 99), "max": max(ms) if ms else None}
        out["ttft_trend"] = queue_trend(a["issued"], a["ttft"], a["e2e"], horizon_s, ttft_limit_ms)
        out["measured"] = ("harness: from issue_queries to the first token reaching the ledger (TTFT), then per further "
                           "token to the whole response (TPOT); LoadGen's own figures are in loadgen")
        return out
