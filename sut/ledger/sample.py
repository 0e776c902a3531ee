"""The sample ledger: every issued LoadGen sample is answered exactly once, or the run fails loudly.

Why one completer thread
------------------------
LoadGen logs every ``QuerySamplesComplete`` through a log buffer of the calling thread (its
``TlsLogger``), which LoadGen's IO thread swaps and drains every 10 ms. When a thread that has just
completed thousands of samples exits before the IO thread is done with its buffer, LoadGen 6.0.17
frees that buffer while a swap of it is still pending, and the IO thread then works on freed memory
(SIGSEGV in ``TlsLogger::SwapBuffers``, exit 139; ``tests/loadgen_exit_repro.py --via raw``
reproduces it without any engine). Backend threads end exactly so: an engine watcher thread that
answers a whole Offline query when its engine dies before the first sample completes, or a Flame
task thread after its batch. Therefore no backend thread calls LoadGen: the ledger queues each batch
of responses to one completer thread per process that never exits; it calls
``QuerySamplesComplete`` (``sut.ledger.response.complete_samples`` keeps the response buffers alive until
that call returns), in the order the batches were queued. Failure answers (empty responses for
every outstanding sample) go the same way, ``FAIL_CHUNK`` samples per call.

The outbox: each batch goes into the ledger's outbox (``_post_locked``), and only the first batch after the
completer took the outbox queues a completer job (``_flush``); that job sends everything gathered meanwhile, in
order, a run of first tokens and answers in two calls at most (all its first tokens, then all its answers, in one
buffer list: ``ResponseBatches``). Moving first tokens ahead of answers queued before them never sends an answer
before its first token (every answer's first token was posted before it). Under load: one thread wake and two
LoadGen calls for many engine steps; at a low rate: the same one job per step as before.

Progress bar: created with the issued total (never a ``0sample`` line), advanced by the completer,
and closed before the call that answers the last outstanding sample, so LoadGen's summary comes
after the bar's final line; a failure closes it at once, before the error is logged.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import sys
import threading
import time
from typing import Callable, Iterable, Optional, Sequence

import numpy as np

from sut.ledger.response import Answers, EosIds, ResponseBatch, ResponseBatches, complete_samples, unusable

log = logging.getLogger(__name__)

#: The progress bar: samples completed of those issued, elapsed time, tokens/s; no rate or time left (an
#: Offline query's samples may all complete near its end: the estimate would read 30 s/sample, 30 min left).
BAR_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]"
#: Seconds between progress-bar redraws on a terminal, and when stderr is a file or pipe (a log: every frame
#: stays in it, so a 600 s run at 1 s would add 600 frames).
BAR_INTERVAL_S, BAR_INTERVAL_LOG_S = 1.0, 30.0


def _bar_interval() -> float:
    try:
        return BAR_INTERVAL_S if sys.stderr.isatty() else BAR_INTERVAL_LOG_S
    except (AttributeError, ValueError):  # replaced or closed stderr
        return BAR_INTERVAL_LOG_S

def _loadgen_label(sample_id: int, index: int) -> str:
    return f"QSL index {index}, LoadGen sample {sample_id}"


#: Empty failure answers per ``QuerySamplesComplete`` call (a full Offline query has 13,368+ samples).
FAIL_CHUNK = 1024
#: What the ledger hands LoadGen, in the completer's outbox: first tokens, a delivery's answers (these two are
#: "real"), empty first tokens and empty answers after a failure.
FIRST, DONE, EMPTY_FIRST, EMPTY = range(4)


class _Completer:
    """The process's one thread that calls LoadGen's ``QuerySamplesComplete`` (see the module doc).

    Jobs run in submission order; the thread never exits (a daemon, so it does not keep the process
    alive). A job records its own errors; anything it raises is logged and the thread goes on.
    """

    _lock = threading.Lock()
    _queue: Optional[queue.SimpleQueue] = None

    @classmethod
    def submit(cls, job: Callable[[], None]) -> None:
        q = cls._queue
        if q is None:
            with cls._lock:
                if cls._queue is None:
                    cls._queue = queue.SimpleQueue()
                    threading.Thread(target=cls._loop, args=(cls._queue,), name="loadgen-completer",
                                     daemon=True).start()
                q = cls._queue
        q.put(job)

    @staticmethod
    def _loop(jobs: queue.SimpleQueue) -> None:
        while True:
            job = jobs.get()
            try:
                job()
            except BaseException:  # noqa: BLE001 - this thread must outlive every LoadGen test
                log.exception("LoadGen completion job failed")

    @classmethod
    def _forget_after_fork(cls) -> None:
        cls._lock = threading.Lock()
        cls._queue = None  # the thread does not exist in a forked child


os.register_at_fork(after_in_child=_Completer._forget_after_fork)


class SampleLedger:
    """Tracks issued samples until LoadGen has their response; answers each exactly once.

    ``issue`` gives each issued LoadGen sample its own request id (equal-issue repeats of one QSL
    index are separate requests). ``complete`` cuts outputs at the first EOS and queues them for
    LoadGen; a request id that is unknown or already answered is a fatal error. ``fail`` records the
    first fatal error and queues an empty response for every outstanding sample so that LoadGen's
    ``StartTest`` returns; the run is then reported as failed. Every ``QuerySamplesComplete`` call
    is made on the completer thread (module doc); ``complete`` and ``fail`` never block on LoadGen
    and may be called from threads that end right after.

    Per outstanding request one entry (a tuple, replaced rather than changed, so that the collector stops
    tracking it: LoadGen sample id, QSL index, then what a subclass keeps: ``_new_entry``). ``complete``
    takes a whole delivery (an engine step's results) at once: one
    :class:`~sut.ledger.response.Answers` of its answers, cut at the first EOS in a few numpy passes
    (``_check_answers_locked``: where a subclass checks a whole delivery).

    Counters: ``issued``; ``completed`` (samples LoadGen has with their output); ``answered_empty``
    (samples answered empty after a failure); ``output_tokens`` (after the EOS cut). ``idle`` is set
    when nothing is outstanding and every queued answer has been sent.

    Args:
        eos_ids: the model's EOS token ids.
        progress: show a tqdm bar of completed / issued samples and output tokens/s.
        complete_fn: sends a batch of ``(loadgen sample id, int32 ids)`` to LoadGen (``ResponseBatch``, or a list
            of pairs for failure answers; both iterate as pairs; tests pass a recorder; the
            synthetic-locality runner passes one that records the outputs, with ``eos_ids=()``).
        fail_chunk: empty failure answers per ``complete_fn`` call.
        first_id: the first request id ``issue`` hands out (then +1 per sample): ledgers that follow
            each other over one transport keep their request ids apart.
        label: ``(sample id, index) -> text`` naming an issued sample in messages (``describe``); default
            ``"QSL index I, LoadGen sample S"``.
    """

    def __init__(self, eos_ids: Iterable[int], progress: bool = True, complete_fn: Callable = complete_samples,
                 fail_chunk: int = FAIL_CHUNK, first_id: int = 0, label: Optional[Callable[[int, int], str]] = None):
        if fail_chunk < 1:
            raise ValueError(f"fail_chunk must be >= 1, got {fail_chunk}")
        self.eos_ids = tuple(eos_ids)
        self._eos = EosIds(self.eos_ids)
        self._complete_fn = complete_fn
        self._label = label or _loadgen_label
        self._fail_chunk = fail_chunk
        self._ids = itertools.count(first_id)
        self._lock = threading.Lock()
        self._sent = threading.Condition(self._lock)
        self._sent_waiters = 0  # threads in wait_sent (none during a run: no notify per completer job then)
        self._outstanding: dict[int, tuple] = {}  # request id -> (loadgen sample id, qsl index, ...) (_new_entry)
        self._queued = 0  # batches handed to the completer thread, not yet sent
        self._outbox: list = []  # (kind, batch) for the completer, in order (_post_locked)
        self._flush_queued = False  # a completer job will take the outbox
        self.issued = 0
        self.completed = 0
        self.answered_empty = 0
        self.output_tokens = 0
        self.error: Optional[str] = None
        self.first_issue_t: Optional[float] = None
        self.last_complete_t: Optional[float] = None
        self.idle = threading.Event()
        self.idle.set()
        self._bar = None
        self._bar_n = 0  # answers the bar has counted: taken for LoadGen, maybe not yet ``completed``
        self._progress = progress

    def issue(self, samples: Sequence) -> list[tuple[int, int]]:
        """Register LoadGen ``QuerySample`` objects; return ``(request id, qsl index)`` pairs to dispatch.

        After a failure the samples are answered empty at once and nothing is returned: in Server,
        LoadGen keeps issuing queries on its schedule after the run failed, and ``StartTest`` returns
        only once every one is answered.
        """
        now = time.monotonic()
        with self._lock:
            if self.error is not None:
                self.issued += len(samples)
                self._answer_empty_locked([s.id for s in samples])
                return []
            return self._issue_locked(samples, now)

    def _issue_locked(self, samples: Sequence, now: float) -> list[tuple[int, int]]:
        """Give each sample a request id (lock held); ``now`` is the issue time (monotonic seconds)."""
        if self.first_issue_t is None:
            self.first_issue_t = now
        out = []
        outstanding, ids, new = self._outstanding, self._ids, self._new_entry
        for s in samples:
            rid, index = next(ids), s.index
            outstanding[rid] = new(s.id, index, now)
            out.append((rid, index))
        self.issued += len(out)
        if out:
            if self.idle.is_set():  # set and cleared under the lock only: no need to take the Event's own lock
                self.idle.clear()
            self._bar_total()
        return out

    def _new_entry(self, sample_id: int, index: int, now: float) -> tuple:
        """The entry of a request just issued at ``now`` (lock held); subclasses add their own fields."""
        return sample_id, index

    def complete(self, results: Sequence[tuple[int, np.ndarray]], answers: Optional[Answers] = None) -> None:
        """Queue ``(request id, generated ids, ...)`` results (``Completion``s or pairs) for LoadGen, cut at the
        first EOS, all of one call in one ``QuerySamplesComplete``. ``answers``: the results' ids as one
        ``Answers`` (one per result, in order), when the caller has made it already (the dispatcher's answer check).

        Results that arrive after a failure are dropped (their samples were answered empty). A
        request id that is unknown or already answered fails the run; the other results of the
        call are still sent. A result that is not ids fails the run (its sample is answered empty).
        A subclass's ``_check_answers_locked`` may refuse the whole call (the run fails, nothing of it is sent).
        """
        with self._lock:
            if self.error is not None:
                return
            rids, entries, arrays, unknown = [], [], [], []
            pop = self._outstanding.pop
            for r in results:
                entry = pop(r[0], None)
                if entry is None:
                    unknown.append(r[0])
                    continue
                rids.append(r[0])
                entries.append(entry)
                arrays.append(r[1])
            if answers is not None and (unknown or len(answers) != len(rids)):
                answers = None  # not one per result taken: made again from the arrays taken
            broken = self._complete_locked(rids, entries, arrays, answers) if rids else None
            if unknown:
                self._fail_locked(f"request {unknown[0]} was answered twice or never issued"
                                  + (f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""))
            if broken:
                self._fail_locked(broken)

    def _complete_locked(self, rids: list, entries: list, arrays: list, answers: Optional[Answers]) -> Optional[str]:
        """Cut and queue the answers of requests ``rids`` (their entries already taken out; ``answers`` of
        ``arrays``, or None: made here; lock held); returns why the run must fail, with every entry not sent put
        back (the failure answers those)."""
        bad = []
        if answers is None:
            answers, bad = Answers.of(arrays)
        broken = None
        if bad:
            e = unusable(arrays[bad[0]])
            broken = f"the result of request {rids[bad[0]]} is unusable: {e!r}"
            for i in bad:
                self._outstanding[rids[i]] = entries[i]
            keep = sorted(set(range(len(rids))) - set(bad))
            rids, entries = [rids[i] for i in keep], [entries[i] for i in keep]
        cut = answers.cut_lengths(self._eos)
        refused = self._check_answers_locked(rids, entries, answers, cut) if rids else None
        if refused:
            self._outstanding.update(zip(rids, entries))
            return refused
        if rids:
            self.output_tokens += sum(cut)
            self._queue_locked(ResponseBatch([e[0] for e in entries], answers.le_int32(), answers.starts, cut),
                               real=True)
        return broken

    def _check_answers_locked(self, rids: list, entries: list, answers: Answers, cut: list) -> Optional[str]:
        """Hook for subclasses: a whole delivery before it is queued (``cut``: each answer's length after the EOS
        cut); a message refuses it (the run fails). Lock held."""
        return None

    def fail(self, message: str) -> None:
        """Record a fatal error (the first one wins) and answer every outstanding sample empty."""
        with self._lock:
            self._fail_locked(message)

    def _fail_locked(self, message: str) -> None:
        first = self.error is None
        if first:
            self.error = message
            self._bar_close()  # the bar's last line comes before the error
            log.error("RUN FAILED: %s", message)
        pending = list(self._outstanding.values())
        self._outstanding.clear()
        if pending:
            log.error("answering %d outstanding sample(s) with empty responses so LoadGen can stop; "
                      "the run is marked failed", len(pending))
            self._answer_empty_locked([e[0] for e in pending], self._firstless(pending))
        elif not self._queued:
            self.idle.set()

    def _firstless(self, entries: list) -> Optional[list]:
        """LoadGen sample ids of ``entries`` that had no first token (a subclass's; here None: not tracked)."""
        return None

    def _answer_empty_locked(self, sample_ids: list, firstless: Optional[list] = None) -> None:
        """Queue empty responses for LoadGen sample ids, in chunks of ``fail_chunk`` (lock held). ``firstless``:
        those of them that had no first token (None: all of them; used by a subclass)."""
        for i in range(0, len(sample_ids), self._fail_chunk):
            self._queue_locked([(sid, np.zeros(0, np.int32)) for sid in sample_ids[i:i + self._fail_chunk]],
                               real=False)

    def _queue_locked(self, batch, real: bool) -> None:
        self._post_locked(DONE if real else EMPTY, batch)

    def _post_locked(self, kind: int, batch) -> None:
        """Hand ``batch`` (``kind``: ``FIRST``, ``DONE``, ``EMPTY_FIRST``, ``EMPTY``) to the completer thread (lock
        held): into the outbox, with one completer job for all the outbox gathers until that job runs."""
        self._queued += 1
        self._outbox.append((kind, batch))
        if not self._flush_queued:
            self._flush_queued = True
            _Completer.submit(self._flush)

    def _flush(self) -> None:
        """On the completer thread: everything in the outbox, in order. A run of first tokens and answers goes in
        two calls at most (its first tokens, then its answers: every answer's first token was posted before it);
        failure answers one call each (``fail_chunk``)."""
        with self._lock:
            items, self._outbox = self._outbox, []
            self._flush_queued = False
            real = sum(len(b) for k, b in items if k == DONE) if self._progress else 0
            if real:  # before LoadGen can print its summary
                self._bar_n += real
                self._bar_advance(real, close=not self._outstanding and self._queued == len(items))
        run: list = []
        try:
            for item in items:
                if item[0] <= DONE:
                    run.append(item)
                    continue
                self._send_run(run)
                run = []
                self._send_empty(*item)
            self._send_run(run)
        finally:
            self._sent_locked_counts(items)

    def _send_run(self, run: list) -> None:
        """One ``FirstTokenComplete`` of the run's first tokens, then one ``QuerySamplesComplete`` of its answers."""
        firsts = [pair for kind, batch in run if kind == FIRST for pair in batch]
        if firsts:
            self._send_firsts(firsts)
        dones = [batch for kind, batch in run if kind == DONE]
        if not dones:
            return
        mergeable = len(dones) > 1 and all(isinstance(b, ResponseBatch) for b in dones)
        for batch in ([ResponseBatches(dones)] if mergeable else dones):
            try:
                self._complete_fn(batch)
            except Exception as e:  # noqa: BLE001 - LoadGen may not have these samples: the run fails
                with self._lock:
                    if self.error is None:
                        self.error = f"QuerySamplesComplete failed for {len(batch)} sample(s): {e!r}"
                        self._bar_close()
                        log.error("RUN FAILED: %s", self.error)

    def _send_firsts(self, pairs: list) -> None:
        """One ``FirstTokenComplete`` of ``(sample id, first id)`` pairs (a streaming ledger's)."""
        raise NotImplementedError("this ledger reports no first tokens")

    def _send_empty(self, kind: int, batch: list) -> None:
        """One call of failure answers: ``EMPTY`` ``(sample id, empty ids)`` pairs (``EMPTY_FIRST``: a subclass's)."""
        try:
            self._complete_fn(batch)
        except Exception as e:  # noqa: BLE001 - the samples may be LoadGen's no more: the run has failed already
            log.error("QuerySamplesComplete of %d empty answer(s) failed: %r", len(batch), e)

    def _sent_locked_counts(self, items: list) -> None:
        """``items`` reached LoadGen: count them, wake ``wait_sent`` and mark idle when nothing is left."""
        with self._lock:
            for kind, batch in items:
                if kind == DONE:
                    self.completed += len(batch)
                    self.last_complete_t = time.monotonic()
                elif kind == EMPTY:
                    self.answered_empty += len(batch)
                elif kind == FIRST:  # a streaming ledger's
                    self.first_sent += len(batch)
            self._queued -= len(items)
            if not self._queued:
                if self._sent_waiters:
                    self._sent.notify_all()
                if not self._outstanding:
                    self.idle.set()

    def wait_sent(self, timeout: Optional[float] = None) -> bool:
        """Wait until every queued answer has reached ``complete_fn``; False on timeout (seconds)."""
        with self._lock:
            self._sent_waiters += 1
            try:
                return self._sent.wait_for(lambda: self._queued == 0, timeout)
            finally:
                self._sent_waiters -= 1

    @property
    def outstanding(self) -> int:
        with self._lock:
            return len(self._outstanding)

    def describe(self, rid: int) -> Optional[str]:
        """The outstanding request ``rid``'s sample for messages (``label``: ``"QSL index I, LoadGen sample S"``),
        else None."""
        with self._lock:
            entry = self._outstanding.get(rid)
        return None if entry is None else self._label(entry[0], entry[1])

    def check_stall(self, stall_timeout_s: float, now: Optional[float] = None) -> bool:
        """Stall watchdog step: fail the run when samples are outstanding and none completed for
        ``stall_timeout_s`` seconds (since the last completion, else the first issue). Returns True
        when this call failed the run."""
        now = time.monotonic() if now is None else now
        with self._lock:
            last = self.last_complete_t or self.first_issue_t
            n = len(self._outstanding)
            if self.error is not None or not n or last is None or now - last <= stall_timeout_s:
                return False
            self._fail_locked(f"no request completed for {stall_timeout_s:.0f} s with {n} outstanding (stall)")
            return True

    def wait_idle(self, stall_timeout_s: float, poll_s: float = 0.5) -> Optional[str]:
        """Block until every issued sample is answered and sent (``idle``), failing the run on a stall
        (``check_stall``) meanwhile; returns ``error`` (None: every sample got its output)."""
        while not self.idle.wait(poll_s):
            self.check_stall(stall_timeout_s)
        return self.error

    # -- progress bar (lock held) ---------------------------------------------------------
    def _bar_total(self) -> None:
        if not self._progress:
            return
        if self._bar is None:
            from tqdm import tqdm

            # a bar closed when the run was idle a moment (Server) goes on from its count (answers taken for
            # LoadGen: the last may still be on their way, not yet ``completed``) and from the first issue
            self._bar = tqdm(total=self.issued, initial=self._bar_n, unit="sample", desc="completed",
                             dynamic_ncols=True, mininterval=_bar_interval(), bar_format=BAR_FORMAT)
            self._bar_drawn = now = time.monotonic()
            self._bar.start_t -= now - self.first_issue_t
        elif self._bar.total != self.issued:
            self._bar.total = self.issued
            now = time.monotonic()
            if now - self._bar_drawn >= self._bar.mininterval:  # Server: one query per call, redraw at most 1/s
                self._bar_drawn = now
                self._redraw(self._bar)

    def _bar_advance(self, n: int, close: bool) -> None:
        if self._bar is None:
            return
        self._bar.update(n)
        if self.first_issue_t is not None:
            dt = max(time.monotonic() - self.first_issue_t, 1e-9)
            self._bar.set_postfix_str(f"{self.output_tokens / dt:,.0f} tok/s", refresh=False)
        if close:
            self._bar_close()

    def tick(self) -> None:
        """Redraw the progress bar (its elapsed time) when it has not been drawn for a second: an Offline run's
        samples may all complete near its end, and the bar must not look frozen until then."""
        with self._lock:
            if self._bar is None:
                return
            bar, now = self._bar, time.monotonic()
            # drawn by neither a growing total (_bar_total) nor a completion (tqdm's update, on tqdm's own clock)
            if now - self._bar_drawn >= bar.mininterval and bar._time() - bar.last_print_t >= bar.mininterval:
                self._bar_drawn = now
                self._redraw(bar)

    @staticmethod
    def _redraw(bar) -> None:
        """Redraw ``bar`` now and count it as tqdm's last print (``refresh`` alone does not: tqdm's next ``update``
        would then draw again before ``mininterval`` has passed)."""
        bar.refresh()
        bar.last_print_t, bar.last_print_n = bar._time(), bar.n

    def _bar_close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def close(self, timeout: float = 60.0) -> None:
        """Wait (at most ``timeout`` s) until every queued answer is sent, then close the bar."""
        if not self.wait_sent(timeout):
            log.error("%d batch(es) of answers still waiting for LoadGen after %.0f s", self._queued, timeout)
        with self._lock:
            self._bar_close()
