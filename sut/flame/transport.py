"""The ``flame`` transport: batches of requests become tasks of Flame sessions, one session per replica.

Algorithm
---------
``start`` connects to Flame (option ``endpoint``, else ``FLAME_ENDPOINT``, else
``~/.flame/flame.yaml``; one that is not loopback and not https is warned about and recorded in the
run's ``flame.exposure``: ``sut.flame.endpoint.endpoint_exposure``), registers the application if it
is missing, and opens **one session per replica** (``replicas`` = option ``engines``), as the study
did ("two persistent worker sessions", ../shared/research/study.md §2): session r has ``min_instances = max_instances`` = the executors of one
engine (``executors_per_engine``), and its common data (``sut.flame.service_config``) carries the
engine and sampling settings and names **engine slot r**, so its services build the engine of slot r
of ``sut.engine.plan_engines`` on their host (the same GPU UUID that serves replica r on the local
transport) and no other. All sessions warm up at once (``sut.flame.warmup``: every executor answers a
PING; bind failures and stalls fail the start); each replica's ``ReplicaRecord`` carries its engine's
read-back record (``enable_prefix_caching`` included: the caller runs ``sut.core.guard.check_replicas``), and
every other engine a warm-up answer read back (a replica's executors on several nodes: an engine per node) must
report prefix caching off too, or the start fails naming its shard.

``submit(r, requests)`` hands requests to replica r's ``Batcher`` (``sut.flame.batcher``: batch size,
batch-formation window, credits per executor, zlib payload); its ``TaskTracker``
(``sut.flame.tasks``) creates the tasks, retries a failed one once and delivers one
``Completion`` per sample (generated ids, cached prompt tokens, the engine's queued / first / done
times) to the sink. A lost session, an exhausted retry or a per-sample error is one ``FatalEvent``
naming the replica (and batch); after it no task is created any more. ``stop`` closes every session
(retrying while Flame refuses because tasks are still Running), waits for the task threads and closes
the connection. Prefix caching is allowed only through the spec (``spec.allow_prefix_caching``: the
synthetic-locality entry point), or the option of the same name (experiments; not compliant).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import logging
import os
import socket
import threading
from pathlib import Path
from typing import Optional, Sequence

from accuracy.dataset import sha256_file
from sut.core import guard
from sut.core.transport import Transport, TransportSpec, register_transport
from sut.errors import RunFailed, TransportError
from sut.exits import stopped_again
from sut.flame.batcher import Batcher, check_fits
from sut.flame.endpoint import STANDIN_NOTE, connect, control_plane_kind, endpoint_exposure
from sut.flame.health import ExecutorHealth, executors_of, release_survivors, stuck_after_close
from sut.flame.options import FlameOptions
from sut.flame.service_config import make_common_data
from sut.flame.session import ReplicaSession, ensure_app
from sut.flame.stats import FlameStats
from sut.flame.tasks import TaskTracker
from sut.flame.warmup import Warmup
from sut.messages import ReplicaRecord

log = logging.getLogger("sut.flame.transport")


@register_transport("flame")
class FlameTransport(Transport):
    """Replicas = Flame sessions pinned to engine slots (see the module docstring)."""

    options_cls = FlameOptions
    per_request_max_tokens = True  # a task's meta carries them to the service's engine (sut.flame.batcher)

    def __init__(self, spec: TransportSpec):
        super().__init__(spec)
        self.o: FlameOptions = spec.options if spec.options is not None else FlameOptions()
        self.per_engine = self.o.per_engine(spec.engine.max_num_seqs)
        self.allow_prefix_caching = bool(spec.allow_prefix_caching or self.o.allow_prefix_caching)
        self.dataset = None  # sut.data.dataset.Dataset when the caller has one (payload fit check, indices mode)
        self.counters = FlameStats(self.o.record_tasks)
        self.conn = None
        self.endpoint: Optional[str] = None
        self.exposure: Optional[dict] = None  # sut.flame.endpoint.endpoint_exposure, once connected
        self.control_plane: Optional[str] = None  # sut.flame.endpoint.control_plane_kind, once connected
        self.watcher = None
        self.sessions: list[ReplicaSession] = []
        self.batchers: list[Batcher] = []
        self.trackers: list[TaskTracker] = []
        self.warmup: list[dict] = []
        self.health: Optional[ExecutorHealth] = None

    @property
    def replicas(self) -> int:
        return self.o.engines

    @property
    def halted(self) -> bool:
        """True once the transport is stopping or has reported a fatal event: no new task, no retry."""
        return self._stopped or self.fatal_event is not None

    def use_dataset(self, dataset) -> None:
        """The run's ``sut.data.dataset.Dataset``: the start refuses a batch size whose longest prompts would not fit
        one Flame message, and ``payload=indices`` sends its path, hash and size to the services."""
        self.dataset = dataset

    # -- start ------------------------------------------------------------------------------
    def start(self, sink) -> list[ReplicaRecord]:
        self.sink = sink
        if self.spec.stream:
            raise TransportError("the flame transport cannot stream first tokens (Flame 0.6 has no first-token event)")
        try:
            if self.dataset is not None:
                check_fits(self.dataset.prompts, self.o, self.spec.generation.max_tokens)
            self._connect()
            self.records = []
            for group in self._start_groups():
                self._open_sessions(group)
                self.records += self._warm_up([self.sessions[r] for r in group])
        except RunFailed as e:
            self.stop()
            raise TransportError(str(e)) from None
        except BaseException:
            self.stop()
            raise
        for r, rs in enumerate(self.sessions):
            tracker = TaskTracker(rs, self.counters, self, done_cb=None)
            batcher = Batcher(tracker, self.o, self.spec.generation.max_tokens,
                              self.per_engine * self.o.inflight_per_executor, self.counters, self)
            tracker.done_cb = batcher.release
            self.trackers.append(tracker)
            self.batchers.append(batcher)
            batcher.start()
        self.health = ExecutorHealth(self.conn, self.sessions, lambda r: self.trackers[r].inflight(),
                                     self.o.health_check_s, self._executors_lost)
        self.health.start()
        return self.records

    def _executors_lost(self, replica: int, message: str) -> None:
        """``ExecutorHealth``'s report: fail the run; closing the sessions will not wait for the lost tasks."""
        for rs in self.sessions:
            rs.abandon_close = message
        self.fatal(replica, message)

    def _connect(self) -> None:
        self.conn, self.endpoint = connect(self.o.endpoint)
        log.info("flame: connected to %s", self.endpoint)
        self.control_plane = control_plane_kind(self.conn)
        if self.control_plane == "stand-in":
            log.warning("flame: %s: %s", self.endpoint, STANDIN_NOTE)
        self.exposure = endpoint_exposure(self.endpoint)
        ensure_app(self.conn, self.endpoint, self.o, self.spec.run_dir)
        if self.o.aio_watch:
            import flamepy

            from sut.flame.watch import AioWatcher

            try:
                tls = flamepy.FlameContext().tls if self.endpoint.startswith("https://") else None
                self.watcher = AioWatcher(self.endpoint, tls.ca_file if tls else None)
            except Exception as e:  # noqa: BLE001 - the synchronous path works everywhere
                log.warning("flame: asyncio watcher unavailable (%s); watching with one thread per task", e)

    def _start_groups(self) -> list[list[int]]:
        """Replicas whose sessions open and warm up together: all at once, except when engines share a
        device (``engines_per_device`` > 1) and size their KV cache by memory profiling: then one after the
        other, as ``EnginePool`` starts them, so that each engine's profiling sees the previous one's final
        footprint (with ``kv_cache_memory_bytes`` there is no profiling, and all start together)."""
        es = self.spec.engine
        if es.engines_per_device > 1 and es.kv_cache_memory_bytes is None:
            return [[r] for r in range(self.replicas)]
        return [list(range(self.replicas))]

    def _open_sessions(self, replicas: Sequence[int]) -> None:
        o = self.o
        for r in replicas:
            rs = ReplicaSession(r, self.conn, self.endpoint, o, self.watcher)
            self.sessions.append(rs)
            sid = o.session_id if (o.session_id is None or self.replicas == 1) else f"{o.session_id}-r{r}"
            rs.open(self.common_data(r), self.per_engine, sid)
            log.info("flame: replica %d = session %s (application %s, engine slot %d), %d executor(s), batch %d, "
                     "window %.0f ms, at most %d task(s) in flight", r, rs.id, o.app, r, self.per_engine, o.batch_size,
                     o.batch_window_ms, self.per_engine * o.inflight_per_executor)

    def common_data(self, replica: int) -> bytes:
        """The common data of replica ``replica``'s session (``sut.flame.service_config``)."""
        o, es = self.o, self.spec.engine
        if os.path.exists(es.model):
            es = dataclasses.replace(es, model=str(Path(es.model).resolve()))
        log_dir = self.service_log_dir()
        return make_common_data(
            es, self.spec.generation, slot=replica, payload=o.payload, compress=o.compress, gc_freeze=o.gc_freeze,
            detail=self.spec.detail, dataset=self._dataset_record(), lock_dir=o.lock_dir,
            engine_start_timeout_s=o.engine_start_timeout_s, slot_wait_s=o.slot_wait_s,
            engine_stall_s=o.engine_stall_s or self.spec.stall_timeout_s, allow_prefix_caching=self.allow_prefix_caching,
            log_dir=log_dir, client_host=socket.gethostname() if log_dir else None, engine_factory=o.engine_factory,
            engine_factory_args=o.engine_factory_args, service_hooks=o.service_hooks, service_hooks_args=o.service_hooks_args)

    def _dataset_record(self) -> Optional[dict]:
        if self.o.payload != "indices":
            return None
        ds = self.dataset
        if ds is not None:
            return {"path": str(Path(ds.path).resolve()), "sha256": ds.sha256,
                    "max_samples": len(ds) if len(ds) < ds.total_in_file else None}
        if not self.spec.dataset_path:
            raise RunFailed("payload=indices needs the dataset file (the services load prompts by index)")
        return {"path": str(Path(self.spec.dataset_path).resolve()), "sha256": sha256_file(self.spec.dataset_path)}

    def service_log_dir(self) -> Optional[str]:
        """Where the services write their output: ``service_log_dir``, else ``<run folder>/flame-service``;
        None (``none``, or no run folder) = the application's working directory only. Services on other
        hosts than the client always keep theirs."""
        o = self.o
        if o.service_log_dir:
            return None if o.service_log_dir.lower() == "none" else str(Path(o.service_log_dir).resolve())
        return str(Path(self.spec.run_dir).resolve() / "flame-service") if self.spec.run_dir else None

    def _warm_up(self, sessions: list) -> list[ReplicaRecord]:
        """Warm ``sessions`` up at once; one ``ReplicaRecord`` per replica (its first shard's engine record)."""
        need = self.o.min_executors or self.per_engine
        firsts: dict[int, dict] = {}

        def answer(r: int, meta: dict) -> None:
            self.counters.note_ping(meta)
            firsts.setdefault(r, meta)

        abort = threading.Event()
        with cf.ThreadPoolExecutor(len(sessions), thread_name_prefix="flame-warmup") as pool:
            try:
                log_dir = self.service_log_dir()
                mine = frozenset(rs.id for rs in sessions)
                futs = [pool.submit(Warmup(rs, need, lambda m, r=rs.replica: answer(r, m), abort, log_dir, mine).run)
                        for rs in sessions]
                done, _ = cf.wait(futs, return_when=cf.FIRST_EXCEPTION)
            except BaseException:  # Ctrl-C / SIGTERM: the pool's exit joins the warm-ups, so stop them first
                abort.set()
                raise
            failed = [f for f in futs if f in done and f.exception() is not None]
            if failed:
                abort.set()
                raise failed[0].exception()
            self.warmup += [f.result() for f in futs]
        self._check_engines({rs.replica for rs in sessions})
        records = []
        for rs in sessions:
            meta = firsts[rs.replica]
            sh = meta.get("shard") or {}
            info = dict(meta.get("engine") or {})
            info["device"] = dict(info.get("device") or {}, shard=f"{sh.get('node')}/{sh.get('key')}", node=sh.get("node"))
            info.update(replica=rs.replica, session_id=rs.id)
            records.append(ReplicaRecord(rs.replica, info))
        return records

    def _check_engines(self, replicas: set) -> None:
        """``RunFailed`` when an engine a warm-up answer of ``replicas`` read back reports prefix caching on, or not at
        all (``guard.refusal``): every engine of a replica, one per node its executors reached, not only the first
        answer's, which alone becomes the replica's record (``guard.check_replicas``)."""
        for key, shard in self.counters.shards_of(replicas):
            on = (shard.get("engine") or {}).get("enable_prefix_caching")
            why = guard.refusal(None if on is None else bool(on), self.allow_prefix_caching)
            where = f"engine shard {key} of replica {shard.get('replica')}"
            if why == "on":
                raise RunFailed(f"{where} reports enable_prefix_caching=True; refusing to run (cross-query KV reuse "
                                "is prohibited in MLPerf runs)")
            if why:
                raise RunFailed(f"{where}: prefix caching could not be confirmed off (its read-back has no "
                                "enable_prefix_caching); refusing to run")

    # -- requests and results ---------------------------------------------------------------
    def submit(self, replica: int, requests: Sequence) -> None:
        failed = self.fatal_event
        if failed is not None:
            raise TransportError(f"flame replica {replica}: {failed.message}")
        if self._stopped or not self.batchers:
            raise TransportError(f"flame replica {replica}: the transport is not running")
        self.batchers[replica].put(requests)

    def flush(self) -> None:
        for b in self.batchers:
            b.flush()

    def deliver(self, replica: int, completions: list) -> None:
        self.sink.on_results(replica, completions)

    def fatal(self, replica: Optional[int], message: str, after_stop: bool = False) -> None:
        """Report the first fatal event (``Transport._report_fatal``: quiet after ``stop`` unless
        ``after_stop``); later ones are logged only."""
        if not self._report_fatal(replica, message, after_stop=after_stop):
            log.warning("flame: after the failure or stop: %s", message)

    # -- stop and record ------------------------------------------------------------------------
    def stop(self) -> None:
        if not self._mark_stopped():
            return
        if self.health is not None:
            self.health.stop()
        for b in self.batchers:
            b.close()
        errors = []
        try:
            if self.sessions:
                ours = executors_of(self.conn, [rs.id for rs in self.sessions]) if self.fatal_event is None else {}
                with cf.ThreadPoolExecutor(len(self.sessions), thread_name_prefix="flame-close") as pool:
                    errors = [e for e in pool.map(lambda rs: rs.close(), self.sessions) if e]
                    abandoned = [rs for rs in self.sessions if rs.abandon_close and not rs.closed]
                    for rs, out in zip(abandoned, pool.map(lambda rs: release_survivors(rs, self.o.leave_wait_s),
                                                           abandoned)):
                        rs.close_info["survivors"] = out
                if ours and not errors and self.fatal_event is None:  # a failed run already says what died
                    stuck = stuck_after_close(self.conn, ours, self.o.unbind_wait_s)
                    errors = [stuck] if stuck else []
        finally:
            quick = stopped_again() or (self.health is not None and self.health.lost)  # their tasks may run on
            for t in self.trackers:
                t.join(2 if quick else 30)
            if self.watcher is not None:
                self.watcher.close()
            if self.conn is not None:
                try:
                    self.conn.close()
                except Exception:  # noqa: BLE001
                    pass
        if errors and self.sink is not None:
            self.fatal(None, errors[0], after_stop=True)

    def noncompliance_reasons(self) -> list[str]:
        """The stand-in control plane (``sut.flame.endpoint.control_plane_kind``) makes the run a rehearsal."""
        return [f"Flame control plane at {self.endpoint}: {STANDIN_NOTE}"] if self.control_plane == "stand-in" else []

    def mark_timed(self) -> None:
        """Batches sent so far were warm-ups: ``stats`` reports them under ``untimed`` (``sut.flame.stats``)."""
        self.counters.mark_timed()

    def stats(self) -> dict:
        o = self.o
        closes = [rs.close_info for rs in self.sessions if rs.close_info]
        close = {}
        if closes:
            close = {"closed": all(c["closed"] for c in closes), "attempts": sum(c["attempts"] for c in closes),
                     "seconds": max(c["seconds"] for c in closes), "sessions": closes}
            err = next((c["error"] for c in closes if c.get("error")), None)
            if err:
                close["error"] = err
        rec = {"endpoint": self.endpoint, "control_plane": self.control_plane,
               "exposure": self.exposure, "application": o.app,
               "session_id": self.sessions[0].id if self.sessions else None,
               "session_ids": [rs.id for rs in self.sessions], "options": o.asdict(), "batch_size": o.batch_size,
               "batch_window_ms": o.batch_window_ms, "engines": o.engines, "executors_per_engine": self.per_engine,
               "executors": o.engines * self.per_engine,
               "max_inflight_tasks": o.engines * self.per_engine * o.inflight_per_executor,
               "payload": o.payload, "engine_backend": o.engine_factory or "vllm",
               "warmup": _merge_warmups(self.warmup), "close": close}
        rec.update(self.counters.record())
        return {"flame": rec}


def _merge_warmups(parts: list[dict]) -> dict:
    """One warm-up record over every replica (the per-replica ones under ``replicas``)."""
    if not parts:
        return {}
    return {"executors": sum(p["executors"] for p in parts), "pings": sum(p["pings"] for p in parts),
            "seconds": max(p["seconds"] for p in parts),
            "bind_failures_retried": [m for p in parts for m in p["bind_failures_retried"]], "replicas": parts}
