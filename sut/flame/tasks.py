"""The task tracker of one replica: create a batch's Flame task, watch it, retry once, deliver its results.

Every task has its own thread that waits on its watch (``ReplicaSession.await_terminal``: all streams
on one ``grpc.aio`` loop) and handles the outcome:

* Succeed: the result (``sut.flame.payload``) must be the batch's (same batch id, same request ids
  in order) and name an engine shard (node, slot) that a warm-up answer of the run read back (an
  engine never read back, e.g. on a node no warm-up ping reached, fails the run); each sample becomes a
  ``sut.messages.Completion`` (generated ids, the engine's cached prompt tokens and times) delivered
  for the replica **of that shard**, so a result served by another replica than the one routed to
  fails the run in the dispatcher. A per-sample error (a prompt the engine cannot take) fails the
  run naming the request, batch and replica.
* Failed: read back with ``get_task`` (watch messages carry no events) and created again once; a
  second failure fails the run naming both tasks and their messages.
* Cancelled (a session closed by someone else) or lost (session gone, watch broken): fails the run.

Failing the run = one ``FatalEvent`` naming the replica, through the transport (``owner.fatal``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import threading
import time
from typing import Optional

from sut.flame import payload as pl
from sut.flame.endpoint import lost_cause
from sut.flame.session import CANCELLED, LOST, SUCCEED, ReplicaSession
from sut.flame.stats import FlameStats
from sut.messages import Completion

log = logging.getLogger("sut.flame.transport")


@dataclasses.dataclass
class Batch:
    """One batch of requests and the Flame task(s) that carry it (times: ``time.monotonic()`` s)."""

    batch_id: int
    requests: list  # sut.messages.Request
    data: bytes
    raw_bytes: int
    task_id: Optional[str] = None
    attempts: int = 0
    errors: list = dataclasses.field(default_factory=list)
    t_create: float = 0.0  # last attempt
    t_running: Optional[float] = None
    t_done: Optional[float] = None


def _number_or_none(v) -> bool:
    return v is None or (type(v) in (int, float) and math.isfinite(v))


def _meta_fields_problem(meta: dict) -> Optional[str]:
    """What is wrong with the fields of a result's meta that the run's counters read (``FlameStats.note_result``:
    ``t``, an object of seconds; ``executor``, an object; ``engine_gc_max_pause_ms``, milliseconds), else None. A
    string where seconds are due failed the run as "watcher ... crashed: TypeError", naming no field."""
    t, ex = meta.get("t"), meta.get("executor")
    if t is not None and not (isinstance(t, dict) and all(_number_or_none(v) for v in t.values())):
        return f"the result's meta field 't' must be an object of finite seconds, got {json.dumps(t)[:80]}"
    if ex is not None and not isinstance(ex, dict):
        return f"the result's meta field 'executor' must be an object, got {json.dumps(ex)[:80]}"
    if not _number_or_none(meta.get("engine_gc_max_pause_ms")):
        return (f"the result's meta field 'engine_gc_max_pause_ms' must be a finite number, got "
                f"{json.dumps(meta.get('engine_gc_max_pause_ms'))[:80]}")
    return None


class TaskTracker:
    """Creates and follows the tasks of replica session ``rs``.

    ``owner`` (the transport) provides ``deliver(replica, [Completion])``, ``fatal(replica, message)``
    and ``halted`` (True once the transport is stopping or has failed: no new task, no retry).
    ``done_cb(batch)`` runs when a batch's thread ends, whatever the outcome (credits).
    """

    def __init__(self, rs: ReplicaSession, stats: FlameStats, owner, done_cb):
        self.rs, self.stats, self.owner, self.done_cb = rs, stats, owner, done_cb
        self.replica = rs.replica
        self._lock = threading.Lock()
        self._threads: set[threading.Thread] = set()

    def launch(self, tb: Batch) -> bool:
        """Create the batch's task and start its thread; False (after a fatal event) if it could not be created."""
        if not self._create(tb):
            return False
        th = threading.Thread(target=self._track, args=(tb,), name=f"flame-task-{self.replica}-{tb.batch_id}", daemon=True)
        with self._lock:
            self._threads.add(th)
        th.start()
        return True

    def inflight(self) -> int:
        """Tasks of this replica not settled yet."""
        with self._lock:
            return len(self._threads)

    def join(self, timeout: float) -> None:
        """Wait at most ``timeout`` s in all for the task threads (a hung watch must not cost it per task)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            threads = list(self._threads)
        for th in threads:
            th.join(max(0.0, deadline - time.monotonic()))

    def _create(self, tb: Batch) -> bool:
        tb.attempts += 1
        tb.t_create = time.monotonic()
        tb.t_running = None
        try:
            tb.task_id = self.rs.create_task(tb.data)
        except Exception as e:  # noqa: BLE001 - any RPC failure here means the session is unusable
            self.owner.fatal(self.replica, f"cannot create a Flame task for batch {tb.batch_id} of replica {self.replica} "
                                           f"in session {self.rs.id}: {lost_cause(self.rs.endpoint, str(e), self.rs.id)}")
            return False
        self.stats.note_sent(tb.raw_bytes, len(tb.data), tb.t_create)
        return True

    def _track(self, tb: Batch) -> None:
        try:
            while not self._attempt(tb):
                if not self._create(tb):
                    return
        except Exception as e:  # noqa: BLE001 - never lose a sample silently
            log.exception("flame: watcher of batch %d (replica %d) crashed", tb.batch_id, self.replica)
            self.owner.fatal(self.replica, f"watcher of batch {tb.batch_id} (replica {self.replica}) crashed: {e!r}")
        finally:
            with self._lock:
                self._threads.discard(threading.current_thread())
            self.done_cb(tb)

    def _attempt(self, tb: Batch) -> bool:
        """Wait for the current task of ``tb``; True when the batch is settled, False to create it again."""

        def running():
            if tb.t_running is None:
                tb.t_running = time.monotonic()

        state, out, msg = self.rs.await_terminal(tb.task_id, running)
        tb.t_done = time.monotonic()
        where = f"Flame task {tb.task_id} (batch {tb.batch_id}, replica {self.replica})"
        if state == SUCCEED:
            self._finish(tb, out)
        elif state == CANCELLED:
            if not self.owner.halted:
                self.owner.fatal(self.replica, f"{where} was cancelled: session {self.rs.id} was closed by someone else")
        elif state == LOST:
            self.owner.fatal(self.replica, f"lost {where}: {lost_cause(self.rs.endpoint, msg, self.rs.id)}")
        else:
            return self._failed(tb, msg)
        return True

    def _failed(self, tb: Batch, msg: str) -> bool:
        tb.errors.append(msg)
        retry = tb.attempts < 2 and not self.owner.halted
        self.stats.note_failure(self.replica, tb.batch_id, tb.task_id, tb.attempts, msg, retry)
        if retry:
            log.warning("flame: task %s (batch %d, replica %d) failed: %s; retrying once", tb.task_id, tb.batch_id,
                        self.replica, msg)
            return False
        if tb.attempts >= 2:
            tasks = ", ".join(self.stats.failed_task_ids(tb.batch_id, self.replica))
            self.owner.fatal(self.replica, f"Flame task for batch {tb.batch_id} of replica {self.replica} failed "
                                           f"{tb.attempts} times (tasks {tasks}): {' | '.join(tb.errors)}")
        return True

    def _served_by(self, meta) -> tuple[Optional[int], Optional[str]]:
        """``(the replica whose engine served a result with meta `meta`, None)``: the replica of the engine shard it
        names (``node``, ``shard``) as a warm-up answer read that engine back (``FlameStats.shard``); else ``(None, why
        the result cannot be taken)``: a meta that is no object, a shard no warm-up answer named (an engine whose
        read-back, prefix caching included, was never checked), or a ``replica`` that is not its shard's."""
        if not isinstance(meta, dict):
            return None, f"the result's meta is a {type(meta).__name__}, not an object"
        key = f"{meta.get('node')}/{meta.get('shard')}"
        shard = self.stats.shard(key)
        served = None if shard is None else shard.get("replica")
        if type(served) is not int:
            return None, (f"served by engine shard {key}, which no warm-up answer of this run named: that engine was "
                          "never read back (prefix caching included), so its answers are not taken")
        named = meta.get("replica", served)
        if type(named) is not int or named != served:
            return None, f"the result names replica {named!r}, but its engine shard {key} serves replica {served}"
        return served, _meta_fields_problem(meta)

    def _finish(self, tb: Batch, out: Optional[bytes]) -> None:
        where = f"Flame task {tb.task_id} (batch {tb.batch_id}, replica {self.replica})"
        try:
            res = pl.decode_result(out)
        except pl.PayloadError as e:
            self.owner.fatal(self.replica, f"{where} returned an unreadable result: {e}")
            return
        rids = [r.rid for r in tb.requests]
        got = [s.request_id for s in res.samples]
        if res.batch_id != tb.batch_id or got != rids:
            self.owner.fatal(self.replica, f"{where}: result of batch {res.batch_id} with {len(got)} samples does not "
                                           f"match the batch's {len(rids)} samples")
            return
        served, why = self._served_by(res.meta)
        if why:
            self.owner.fatal(self.replica, f"{where}: {why}")
            return
        self.stats.note_result(self.replica, tb, res)
        ok = [Completion(s.request_id, s.token_ids, s.cached_tokens, s.t_queued, s.t_first, s.t_done)
              for s in res.samples if s.ok]
        bad = [s for s in res.samples if not s.ok]
        if ok:
            self.owner.deliver(served, ok)
        if bad:
            qsl = {r.rid: r.index for r in tb.requests}
            self.owner.fatal(self.replica, f"{len(bad)} sample(s) of batch {tb.batch_id} (replica {self.replica}) failed "
                                           f"in the service; first: request {bad[0].request_id} (QSL index "
                                           f"{qsl.get(bad[0].request_id)}): {bad[0].error}")
