"""The Flame-batched SUT (``--sut flame``): LoadGen samples -> batches -> Flame tasks -> vLLM.

Algorithm
---------
``start`` connects to Flame (option ``endpoint``, else ``FLAME_ENDPOINT``, else
``~/.flame/flame.yaml``), registers the application if it is missing, and opens one session
for the whole run with ``min_instances = max_instances = engines x executors_per_engine``. The
session's common data carries the engine and sampling settings, so every service builds the same
engine as the standalone SUT. Warm-up: PING tasks are kept pending until that many distinct
executors have answered (each answer names its engine shard and GPU UUID); a bind failure in the
session's events fails the start at once, and so does a stall: fewer executors than needed and no new
one from Flame for ``warmup_stall_s`` (e.g. a dead service's executor stuck in Unbinding, which in Flame
v0.6.0 keeps every new session from getting executors). What the warm-up waits for is logged every
``warmup_log_s``.

``issue_queries`` only registers the samples with the ledger and appends them to the inbox; it
never blocks. One dispatcher thread cuts the inbox into batches of ``batch_size`` (a partial
batch waits at most ``batch_window_ms`` for more arrivals, or until ``flush_queries``), encodes
each (``sut.flame.payload``; a batch that would not fit Flame's 4 MiB messages fails the run
with a clear error), waits for a credit (at most ``inflight_per_executor`` tasks per executor
are in flight: Flame has no back-pressure) and creates the task. Every task has its own
``WatchTask`` stream, all of them on one ``grpc.aio`` loop (``sut.flame.watch``; flamepy's
``Session.run`` would share 10 threads, and its synchronous streams poll every 100 ms), and its own
thread that waits on that stream's future and handles the outcome. A finished task's outputs go
to the ledger (cut at the first EOS, int32, ``n_tokens`` = length: exactly the standalone SUT's
path).

Why several executors per engine: a Flame executor runs one task at a time, and a task returns
only when its last sample is done. With ``executors_per_engine = ceil(engine_fill x
max_num_seqs / batch_size) + executor_slack`` (default fill 2) executors feeding each engine, the
engine always holds more sequences than it can run, as the standalone SUT's engine does with a
whole Offline query (see ``executors_per_engine`` and ``sut.flame.service``).

Failures: a Failed task is read back with ``get_task`` (watch messages carry no events) and
created again once; a second failure, a Cancelled task the SUT did not cause, a lost session or
watch, or a per-sample error fails the run through the ledger (every outstanding sample is
answered exactly once, empty). ``stop`` always closes the session, retrying while Flame refuses
because tasks are still Running, so no task is left behind -- unless the session manager itself is
gone (its port refuses connections for ``unreachable_timeout_s``), which the failure message names.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import logging
import math
import os
import socket
import statistics
import threading
import time
from pathlib import Path
from typing import Optional, Sequence
from urllib.parse import urlparse

from sut.base import InputError, RunFailed, SUTContext, SystemUnderTest, register_sut
from sut.flame import payload as pl
from sut.flame.service import make_common_data

log = logging.getLogger("sut.flame.client")

PING_BATCH_BASE = 1 << 40
SESSION_BIND_FAILED = 1001
SESSION_RETRY_LIMIT_REACHED = 1002
_SUCCEED, _FAILED, _CANCELLED, _LOST = "succeed", "failed", "cancelled", "lost"
_ST_SUCCEED, _ST_FAILED, _ST_CANCELLED = 2, 3, 4  # flame.v1 TaskState on the wire


@dataclasses.dataclass(frozen=True)
class FlameOptions:
    """Options of the flame SUT (``--option KEY=VALUE`` or ``[options]`` in a preset)."""

    batch_size: int = 32
    batch_window_ms: float = 20.0
    endpoint: Optional[str] = None
    app: str = "sut-vllm"
    register_app: str = "if_missing"  # if_missing | never
    app_workdir: Optional[str] = None
    engines: int = 1
    executors_per_engine: Optional[int] = None
    engine_fill: float = 2.0
    executor_slack: int = 0
    min_executors: Optional[int] = None
    inflight_per_executor: int = 2
    payload: str = "tokens"  # tokens | indices
    resreq: Optional[str] = None
    session_id: Optional[str] = None
    lock_dir: Optional[str] = None
    warmup_timeout_s: float = 1800.0
    warmup_stall_s: float = 120.0  # fail the warm-up when Flame gives the session no new executor for this long
    warmup_log_s: float = 10.0  # how often the warm-up logs what it waits for
    warmup_hold_ms: float = 200.0
    engine_start_timeout_s: float = 1800.0
    close_timeout_s: float = 600.0
    unreachable_timeout_s: float = 15.0  # give up closing when the session manager stays unreachable this long
    service_log_dir: Optional[str] = None  # default: <run folder>/flame-service (services on this host); "none"
    engine_backend: str = "vllm"  # vllm | fake (protocol tests only)
    fake_step_s: float = 0.05
    fake_start_s: float = 0.0
    allow_prefix_caching: bool = False
    record_tasks: bool = True
    aio_watch: bool = True  # all watch streams on one grpc.aio loop; false: flamepy's Session.watch_task per thread

    def __post_init__(self):
        if int(self.batch_size) < 1:
            raise ValueError(f"batch_size must be a positive integer, got {self.batch_size}")
        if self.batch_window_ms < 0:
            raise ValueError("batch_window_ms must be >= 0")
        if self.payload not in ("tokens", "indices"):
            raise ValueError(f"payload must be tokens or indices, got {self.payload!r}")
        if self.register_app not in ("if_missing", "never"):
            raise ValueError(f"register_app must be if_missing or never, got {self.register_app!r}")
        if self.engine_backend not in ("vllm", "fake"):
            raise ValueError(f"engine_backend must be vllm or fake, got {self.engine_backend!r}")
        for name in ("engines", "inflight_per_executor"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.executors_per_engine is not None and int(self.executors_per_engine) < 1:
            raise ValueError("executors_per_engine must be >= 1")
        if self.executor_slack < 0:
            raise ValueError("executor_slack must be >= 0")
        if self.engine_fill <= 0:
            raise ValueError("engine_fill must be > 0")
        for name in ("warmup_stall_s", "warmup_log_s", "unreachable_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")

    @classmethod
    def from_mapping(cls, values: dict) -> "FlameOptions":
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - set(fields))
        if unknown:
            raise ValueError(f"unknown flame option(s) {unknown}; known: {sorted(fields)}")
        conv = {}
        for k, v in values.items():
            default = fields[k].default
            if v is None:
                conv[k] = None
            elif isinstance(default, bool):
                conv[k] = v if isinstance(v, bool) else str(v).lower() in ("1", "true", "yes", "on")
            elif isinstance(default, int) or k in ("executors_per_engine", "min_executors"):
                conv[k] = int(v)
            elif isinstance(default, float):
                conv[k] = float(v)
            else:
                conv[k] = str(v)
        return cls(**conv)


def executors_per_engine(max_num_seqs: int, batch_size: int, fill: float = 2.0, slack: int = 0) -> int:
    """Executors one engine needs so that it always holds more sequences than it can run.

    A task returns only when its longest sample is done, so the finished samples of a running
    batch hold no engine slot while the batch waits for its last one. With executors holding
    ``fill`` x ``max_num_seqs`` sequences the engine stays full even when output lengths vary
    (``python scripts/bench_flame.py --simulate-fill``: 1x + one batch keeps it 67-82 % busy
    with 20..128-token outputs, 2x keeps it >= 99.9 % busy).
    """
    return max(1, math.ceil(fill * max_num_seqs / batch_size)) + slack


def resolve_endpoint(endpoint: Optional[str] = None) -> str:
    """Option, else ``FLAME_ENDPOINT``, else ``~/.flame/flame.yaml``; ``RunFailed`` if none."""
    if endpoint:
        return endpoint
    from flamepy import FlameContext

    ctx = FlameContext()  # reads ~/.flame/flame.yaml, then FLAME_ENDPOINT overrides it
    if not ctx._endpoint:
        raise RunFailed("no Flame endpoint: pass --flame-endpoint / --option endpoint=http://HOST:8080, set "
                        "FLAME_ENDPOINT, or write ~/.flame/flame.yaml")
    return ctx._endpoint


def connect(endpoint: Optional[str] = None):
    """``(flamepy Connection, endpoint)``; ``RunFailed`` with the reason if Flame cannot be reached."""
    import flamepy

    ep = resolve_endpoint(endpoint)
    tls = None
    if ep.startswith("https://"):
        tls = flamepy.FlameContext().tls
    try:
        return flamepy.connect(ep, tls), ep
    except flamepy.FlameError as e:
        raise RunFailed(f"cannot connect to Flame at {ep}: {e.message}") from None


def _is_cancelled_error(e: BaseException) -> bool:
    # flamepy 0.6.0 has no TaskState.CANCELLED: parsing state 4 raises ValueError("4 is not a valid
    # TaskState"), which watch_task wraps in FlameError(INTERNAL, "failed to watch task: ...").
    return "4 is not a valid TaskState" in str(e)


@dataclasses.dataclass
class _WarmupWatch:
    """Progress of the warm-up: executors Flame listed for the session, executors that answered."""

    t0: float
    need: int
    listed: int = 0
    answered: int = 0
    progress_t: float = 0.0
    log_t: float = 0.0

    def __post_init__(self):
        self.progress_t = self.log_t = self.t0


@dataclasses.dataclass
class _Task:
    """One batch and the Flame task(s) that carry it."""

    batch_id: int
    items: list  # [(request id, qsl index)]
    data: bytes
    raw_bytes: int
    task_id: Optional[str] = None
    attempts: int = 0
    errors: list = dataclasses.field(default_factory=list)
    t_create: float = 0.0  # monotonic, last attempt
    t_create_wall: float = 0.0
    t_running: Optional[float] = None
    t_done: Optional[float] = None


@register_sut("flame")
class FlameSUT(SystemUnderTest):
    """LoadGen SUT that sends batches of samples as Flame tasks to vLLM services."""

    @classmethod
    def check_options(cls, options: dict) -> FlameOptions:
        """The options as ``FlameOptions``; ``InputError`` names an unknown or bad one."""
        try:
            return FlameOptions.from_mapping(dict(options))
        except (ValueError, TypeError) as e:
            raise InputError(f"flame SUT options: {e}") from None

    def __init__(self, ctx: SUTContext):
        super().__init__(ctx)
        self.opts = o = self.check_options(ctx.options)
        self.batch_size = int(o.batch_size)
        self.per_engine = int(o.executors_per_engine or executors_per_engine(ctx.engine.max_num_seqs, self.batch_size,
                                                                             o.engine_fill, o.executor_slack))
        self.n_executors = int(o.engines) * self.per_engine
        self.max_inflight = self.n_executors * int(o.inflight_per_executor)
        self.conn = None
        self.endpoint: Optional[str] = None
        self.session = None
        self._aw = None
        self._cv = threading.Condition()
        self._inbox: collections.deque = collections.deque()
        self._flush = False
        self._closing = False
        self._inflight = 0
        self._watchers: set[threading.Thread] = set()
        self._dispatcher = threading.Thread(target=self._dispatch_loop, name="flame-dispatch", daemon=True)
        self._stopped = False
        self._session_closed = False
        self._next_batch = 0
        # statistics for the record
        self._stats_lock = threading.Lock()
        self.task_log: list[dict] = []
        self.batch_sizes: collections.Counter = collections.Counter()
        self.bytes = {"in_raw": 0, "in_wire": 0, "out_raw": 0, "out_wire": 0}
        self.retries = 0
        self.peak_inflight = 0
        self.failed_attempts: list[dict] = []
        self.executors: dict[str, dict] = {}
        self.shards: dict[str, dict] = {}
        self.engine_gc: dict[str, float] = {}
        self.warmup: dict = {}
        self.close_info: dict = {}
        self._bind_warnings: list[str] = []

    # ------------------------------------------------------------------ life cycle
    def start(self) -> dict:
        import flamepy

        o = self.opts
        if self.ctx.engine.enable_prefix_caching and not o.allow_prefix_caching:
            raise RunFailed("enable_prefix_caching=True is not allowed in an MLPerf run (cross-query KV reuse is prohibited)")
        self._check_fits()
        self.conn, self.endpoint = connect(o.endpoint)
        log.info("flame: connected to %s", self.endpoint)
        self._ensure_app()
        attrs = flamepy.SessionAttributes(
            application=o.app, id=o.session_id, common_data=self._common_data(), min_instances=self.n_executors,
            max_instances=self.n_executors, resreq=flamepy.ResourceRequirement.from_string(o.resreq) if o.resreq else None)
        try:
            self.session = self.conn.create_session(attrs)
        except flamepy.FlameError as e:
            raise RunFailed(f"cannot create a Flame session of application {o.app}: {e.message}") from None
        atexit.register(self._atexit_close)
        if o.aio_watch:
            from sut.flame.watch import AioWatcher

            try:
                tls = flamepy.FlameContext().tls if self.endpoint.startswith("https://") else None
                self._aw = AioWatcher(self.endpoint, self.session.id, tls.ca_file if tls else None)
            except Exception as e:  # noqa: BLE001 - the synchronous path works everywhere
                log.warning("flame: asyncio watcher unavailable (%s); watching with one thread per task", e)
        log.info("flame: session %s (application %s), %d executor(s) = %d engine(s) x %d, batch %d, window %.0f ms, "
                 "at most %d task(s) in flight", self.session.id, o.app, self.n_executors, o.engines, self.per_engine,
                 self.batch_size, o.batch_window_ms, self.max_inflight)
        self._warm_up()
        self._dispatcher.start()
        engines = []
        for key in sorted(self.shards):
            info = dict(self.shards[key].get("engine") or {})
            info.setdefault("device", {})
            info["device"] = dict(info["device"], shard=key, node=self.shards[key].get("node"))
            engines.append(info)
        for info in engines:
            if info.get("enable_prefix_caching") and not o.allow_prefix_caching:
                raise RunFailed(f"engine of shard {info['device'].get('shard')} reports enable_prefix_caching=True")
        return {"engines": engines}

    def _check_fits(self) -> None:
        """Refuse a batch size whose worst case cannot fit one Flame message (before any task exists)."""
        ds = self.ctx.dataset
        longest = sorted(ds.prompts, key=len, reverse=True)[: self.batch_size]
        try:
            if self.opts.payload == "indices":
                pl.encode_task(0, list(range(len(longest))), indices=list(range(len(longest))),
                               max_tokens=self.ctx.generation.max_tokens)
            else:
                pl.encode_task(0, list(range(len(longest))), prompts=longest, max_tokens=self.ctx.generation.max_tokens)
        except pl.PayloadTooLarge as e:
            raise RunFailed(f"batch_size {self.batch_size} cannot work with this dataset: {e}") from None

    def _common_data(self) -> bytes:
        o, es = self.opts, self.ctx.engine
        if os.path.exists(es.model):
            es = dataclasses.replace(es, model=str(Path(es.model).resolve()))
        dataset = None
        if o.payload == "indices":
            ds = self.ctx.dataset
            dataset = {"path": str(Path(ds.path).resolve()), "sha256": ds.sha256,
                       "max_samples": len(ds) if len(ds) < ds.total_in_file else None}
        fake = {"step_s": o.fake_step_s, "start_s": o.fake_start_s} if o.engine_backend == "fake" else None
        log_dir = self.service_log_dir()
        return make_common_data(es, self.ctx.generation, payload=o.payload, dataset=dataset, lock_dir=o.lock_dir,
                                engine_backend=o.engine_backend, fake=fake, engine_start_timeout_s=o.engine_start_timeout_s,
                                allow_prefix_caching=o.allow_prefix_caching,
                                log_dir=log_dir, client_host=socket.gethostname() if log_dir else None)

    def service_log_dir(self) -> Optional[str]:
        """Where the services of this session write their output: ``service_log_dir``, else
        ``<run folder>/flame-service``; None (``none``, or no run folder) = the application's working
        directory only. Services on other hosts than the client always keep theirs."""
        o = self.opts
        if o.service_log_dir:
            return None if o.service_log_dir.lower() == "none" else str(Path(o.service_log_dir).resolve())
        return str(Path(self.ctx.run_dir).resolve() / "flame-service") if self.ctx.run_dir else None

    def _ensure_app(self) -> None:
        import flamepy

        from sut.flame import app as app_mod

        o = self.opts
        try:
            found = self.conn.get_application(o.app)
        except flamepy.FlameError as e:
            raise RunFailed(f"cannot read application {o.app} from Flame at {self.endpoint}: {e.message}") from None
        if found is not None:
            return
        if o.register_app == "never":
            raise RunFailed(f"application {o.app} is not registered at {self.endpoint}; register it first "
                            "(python -m sut.flame register, or flmctl register -f app.yaml)")
        workdir = o.app_workdir
        if workdir is None and self.ctx.run_dir:  # next to the run folders, not under the repository
            workdir = str(Path(self.ctx.run_dir).resolve().parent / "flame-service")
        doc = app_mod.render(workdir=workdir, name=o.app)
        try:
            app_mod.register(self.conn, doc)
        except flamepy.FlameError as e:
            raise RunFailed(f"cannot register application {o.app}: {e.message}") from None
        log.info("flame: registered application %s (%s %s)", o.app, doc["spec"]["command"], " ".join(doc["spec"]["arguments"]))

    # ------------------------------------------------------------------ warm-up
    def _warm_up(self) -> None:
        """Keep PING tasks pending until ``min_executors`` distinct executors have answered."""
        o = self.opts
        need = int(o.min_executors or self.n_executors)
        t0 = time.monotonic()
        deadline = t0 + o.warmup_timeout_s
        seen: dict[str, dict] = {}
        pending: dict[str, threading.Thread] = {}
        results: dict[str, tuple] = {}
        lock = threading.Lock()
        n_ping = 0
        last_events = 0.0
        watch = _WarmupWatch(t0, need)

        def watch_ping(task_id: str) -> None:
            res = self._await_terminal(task_id, None)
            with lock:
                results[task_id] = res

        while len(seen) < need:
            while len(pending) < need:
                enc = pl.encode_ping(PING_BATCH_BASE + n_ping, meta={"hold_ms": o.warmup_hold_ms})
                n_ping += 1
                try:
                    t = self.session.create_task(enc.data)
                except Exception as e:  # noqa: BLE001
                    raise RunFailed(f"warm-up: cannot create a task in session {self.session.id}: {e}") from None
                th = threading.Thread(target=watch_ping, args=(t.id,), name=f"flame-ping-{t.id}", daemon=True)
                pending[t.id] = th
                th.start()
            time.sleep(0.05)
            with lock:
                done = [(tid, results.pop(tid)) for tid in list(results)]
            for tid, (state, out, msg) in done:
                pending.pop(tid, None)
                if state == _SUCCEED:
                    meta = pl.decode_result(out).meta
                    ex = meta.get("executor") or {}
                    key = f"{ex.get('node')}/{ex.get('id')}"
                    if key not in seen:
                        seen[key] = ex
                        sh = meta.get("shard") or {}
                        self._note_executor(ex, f"{sh.get('node')}/{sh.get('key')}")
                        self._note_shard(meta)
                        log.info("flame: executor %d/%d up: %s pid %s (%s, seat %s) -> shard %s %s", len(seen), need,
                                 ex.get("id"), ex.get("pid"), ex.get("role"), ex.get("seat"), meta["shard"].get("key"),
                                 meta["shard"].get("gpu_uuid") or meta["shard"].get("device_name"))
                else:
                    raise RunFailed(f"warm-up task {tid} {state}: {self._lost_cause(msg) if state == _LOST else msg}")
            now = time.monotonic()
            if now - last_events > 1.0:
                last_events = now
                self._check_bind_failures()
                self._warmup_progress(watch, len(seen), n_ping, now)
            if now > deadline:
                raise RunFailed(f"only {len(seen)} of {need} Flame executors answered within {o.warmup_timeout_s:.0f} s "
                                f"(session {self.session.id}); check the cluster's capacity, the session's max_instances "
                                "and the service logs (<working_directory>/<executor id>.err)")
        # Let the last pings finish, so no warm-up task is left when LoadGen starts.
        for tid, th in list(pending.items()):
            th.join(max(1.0, deadline - time.monotonic()))
        self.warmup = {"executors": len(seen), "pings": n_ping, "seconds": round(time.monotonic() - t0, 3),
                       "bind_failures_retried": list(self._bind_warnings)}
        log.info("flame: %d executor(s) on %d shard(s) ready after %.1f s", len(seen), len(self.shards), self.warmup["seconds"])

    def _session_executors(self) -> Optional[tuple[collections.Counter, list]]:
        """``(states of this session's executors, [(id, state) of executors stuck in Unbinding without a
        session])`` as Flame lists them now; None if Flame cannot be asked."""
        from flamepy.proto import types_pb2

        try:
            listed = self.conn.list_executors()
        except Exception:  # noqa: BLE001 - diagnostics only
            return None
        ours, stuck = collections.Counter(), []
        for e in listed:
            state = types_pb2.ExecutorState.Name(e.status.state).removeprefix("Executor")
            if e.status.session_id == self.session.id:
                ours[state] += 1
            elif state == "Unbinding" and not e.status.session_id:
                stuck.append((e.metadata.id, state))
        return ours, stuck

    def _warmup_progress(self, w: "_WarmupWatch", answered: int, pings: int, now: float) -> None:
        """Log what the warm-up waits for every ``warmup_log_s``; fail (``RunFailed``) when Flame has not
        given the session a new executor for ``warmup_stall_s`` while it has fewer than needed."""
        o = self.opts
        got = self._session_executors()
        if got is None:
            return
        ours, stuck = got
        n_ours = sum(ours.values())
        if n_ours > w.listed or answered > w.answered:
            w.listed, w.answered, w.progress_t = max(w.listed, n_ours), max(w.answered, answered), now
        states = ", ".join(f"{n} {k}" for k, n in sorted(ours.items())) or "none"
        if now - w.log_t >= o.warmup_log_s:
            w.log_t = now
            log.info("flame: warm-up %.0f s: %d of %d executor(s) answered; Flame lists %d executor(s) for session %s "
                     "(%s)%s; %d ping task(s) so far", now - w.t0, answered, w.need, n_ours, self.session.id, states,
                     f", {len(stuck)} stuck in Unbinding without a session" if stuck else "", pings)
        if n_ours < w.need and now - w.progress_t > o.warmup_stall_s:
            msg = (f"warm-up: only {answered} of {w.need} Flame executors answered, and Flame has given session "
                   f"{self.session.id} {n_ours} executor(s) ({states}), none new for {o.warmup_stall_s:.0f} s")
            if stuck:
                msg += (f"; the cluster has {len(stuck)} executor(s) stuck in Unbinding without a session "
                        f"({', '.join(i for i, _ in stuck[:4])}): in Flame v0.6.0 an executor whose service died stays "
                        "Unbinding for good, and Flame gives new sessions no executor while it exists -- restart the "
                        "executor manager")
            else:
                msg += ("; check the cluster's capacity (executor managers, their resources), the session's resreq and "
                        "max_instances, and the service logs")
            raise RunFailed(msg)

    def _check_bind_failures(self) -> None:
        """Fail the start on a bind failure that Flame's retries cannot fix: the service's own
        ``on_session_enter`` failed (the same on every executor), or the session's retry limit was reached.
        Other bind failures (the executor manager could not start or reach a service process) are retried
        by Flame with a new process, up to ``cluster.recovery.session.retry_limits``: logged once each."""
        try:
            ssn = self.conn.get_session(self.session.id)
        except Exception as e:  # noqa: BLE001
            raise RunFailed(f"warm-up: cannot read session {self.session.id}: {e}") from None
        events = [ev for ev in (ssn.events or []) if ev.code in (SESSION_BIND_FAILED, SESSION_RETRY_LIMIT_REACHED)]
        fatal = [ev for ev in events if ev.code == SESSION_RETRY_LIMIT_REACHED or "on_session_enter" in (ev.message or "")]
        if fatal:
            first = next((ev for ev in events if "on_session_enter" in (ev.message or "")), fatal[0])
            raise RunFailed(f"a Flame executor failed to enter session {self.session.id}: {first.message}")
        for ev in events[len(self._bind_warnings):]:
            self._bind_warnings.append(ev.message)
            log.warning("flame: an executor failed to bind session %s (Flame retries it): %s", self.session.id, ev.message)

    # ------------------------------------------------------------------ LoadGen callbacks
    def issue_queries(self, samples: Sequence) -> None:
        items = self.ledger.issue(samples)
        with self._cv:
            self._inbox.extend(items)
            self._cv.notify_all()

    def flush_queries(self) -> None:
        with self._cv:
            self._flush = True
            self._cv.notify_all()

    # ------------------------------------------------------------------ dispatcher
    def _next_items(self) -> Optional[list]:
        """The next batch: ``batch_size`` items, or fewer after the window / a flush. None = closing."""
        window = self.opts.batch_window_ms / 1000.0
        with self._cv:
            while not self._inbox and not self._closing:
                self._cv.wait()
            if self._closing:
                return None
            t_first = time.monotonic()
            while len(self._inbox) < self.batch_size and not self._flush and not self._closing:
                left = window - (time.monotonic() - t_first)
                if left <= 0:
                    break
                self._cv.wait(left)
            n = min(self.batch_size, len(self._inbox))
            items = [self._inbox.popleft() for _ in range(n)]
            if not self._inbox:
                self._flush = False
            return items

    def _dispatch_loop(self) -> None:
        prompts = self.ctx.dataset.prompts
        max_tokens = self.ctx.generation.max_tokens
        while True:
            items = self._next_items()
            if items is None:
                return
            if self.ledger.error is not None:
                continue  # the run has failed; the ledger already answered these samples
            bid = self._next_batch
            self._next_batch += 1
            rids = [rid for rid, _ in items]
            try:
                if self.opts.payload == "indices":
                    enc = pl.encode_task(bid, rids, indices=[q for _, q in items], max_tokens=max_tokens)
                else:
                    enc = pl.encode_task(bid, rids, prompts=[prompts[q] for _, q in items], max_tokens=max_tokens)
            except pl.PayloadError as e:
                self.ledger.fail(f"cannot build Flame task for batch {bid}: {e}")
                continue
            tb = _Task(bid, items, enc.data, enc.raw_bytes)
            with self._cv:
                while self._inflight >= self.max_inflight and not self._closing:
                    self._cv.wait()
                if self._closing:
                    return
                if self.ledger.error is not None:
                    continue  # failed while waiting for a credit: create nothing more
                self._inflight += 1
                self.peak_inflight = max(self.peak_inflight, self._inflight)
            with self._stats_lock:
                self.batch_sizes[len(items)] += 1
            if not self._create(tb):
                self._release_credit()
                continue
            th = threading.Thread(target=self._track, args=(tb,), name=f"flame-task-{bid}", daemon=True)
            with self._cv:
                self._watchers.add(th)
            th.start()

    def _release_credit(self) -> None:
        with self._cv:
            self._inflight -= 1
            self._cv.notify_all()

    def _create(self, tb: _Task) -> bool:
        tb.attempts += 1
        tb.t_create_wall = time.time()
        tb.t_create = time.monotonic()
        tb.t_running = None
        try:
            tb.task_id = self.session.create_task(tb.data).id
        except Exception as e:  # noqa: BLE001 - any RPC failure here means the session is unusable
            self.ledger.fail(f"cannot create a Flame task for batch {tb.batch_id} in session {self.session.id}: {e}")
            return False
        with self._stats_lock:
            self.bytes["in_raw"] += tb.raw_bytes
            self.bytes["in_wire"] += len(tb.data)
        return True

    # ------------------------------------------------------------------ watching
    def _await_terminal(self, task_id: str, tb: Optional[_Task]) -> tuple[str, Optional[bytes], Optional[str]]:
        """Watch one task until it ends: ``(state, output, failure message)``.

        States: succeed, failed (message from ``get_task``'s events), cancelled, lost.
        """
        import flamepy

        quiet_ends = 0
        errors = 0
        while True:
            try:
                state, output = self._watch_once(task_id, tb)
            except Exception as e:  # noqa: BLE001 - RPC errors of either watch path
                errors += 1
                if errors > 3:
                    return _LOST, None, f"watching task {task_id} failed {errors} times: {e}"
                time.sleep(0.5 * errors)
                state, output = None, None
            if state == _ST_SUCCEED:
                return _SUCCEED, output, None
            if state == _ST_FAILED:
                return _FAILED, None, self._failure_message(task_id)
            if state == _ST_CANCELLED:
                return _CANCELLED, None, "task was cancelled (its session was closed)"
            # The stream ended without a terminal message: the task or its session may be gone.
            try:
                t = self.session.get_task(task_id)
            except ValueError as e:
                if _is_cancelled_error(e):
                    return _CANCELLED, None, "task was cancelled (its session was closed)"
                return _LOST, None, f"task {task_id}: {e}"
            except flamepy.FlameError as e:
                return _LOST, None, f"task {task_id} of session {self.session.id} is gone: {e.message}"
            if t.state == flamepy.TaskState.SUCCEED:
                return _SUCCEED, t.output, None
            if t.state == flamepy.TaskState.FAILED:
                return _FAILED, None, self._failure_message(task_id, t)
            quiet_ends += 1
            if quiet_ends > 3:
                return _LOST, None, f"the watch of task {task_id} keeps ending while the task is {t.state.name}"
            time.sleep(0.2)

    def _watch_once(self, task_id: str, tb: Optional[_Task]) -> tuple[Optional[int], Optional[bytes]]:
        """One WatchTask stream: ``(terminal state as int, output)``, or ``(None, None)`` if it ended
        without one. Through the shared asyncio watcher, else flamepy's synchronous ``watch_task``."""
        import flamepy

        def running():
            if tb is not None and tb.t_running is None:
                tb.t_running = time.monotonic()

        if self._aw is not None:
            return self._aw.watch(task_id, running).result()
        try:
            for t in self.session.watch_task(task_id):
                if t.state == flamepy.TaskState.RUNNING:
                    running()
                if t.state == flamepy.TaskState.SUCCEED:
                    return _ST_SUCCEED, t.output
                if t.state == flamepy.TaskState.FAILED:
                    return _ST_FAILED, None
        except (flamepy.FlameError, ValueError) as e:
            if _is_cancelled_error(e):
                return _ST_CANCELLED, None
            raise
        return None, None

    def _failure_message(self, task_id: str, task=None) -> str:
        try:
            task = task or self.session.get_task(task_id)
        except Exception as e:  # noqa: BLE001
            return f"(failure message unavailable: {e})"
        msgs = [ev.message for ev in task.events if ev.code == 3 and ev.message]
        return msgs[-1] if msgs else "task failed without an error message"

    def _track(self, tb: _Task) -> None:
        try:
            while True:
                state, out, msg = self._await_terminal(tb.task_id, tb)
                tb.t_done = time.monotonic()
                if state == _SUCCEED:
                    self._finish(tb, out)
                    return
                if state == _CANCELLED:
                    if not self._closing and self.ledger.error is None:
                        self.ledger.fail(f"Flame task {tb.task_id} (batch {tb.batch_id}) was cancelled: session "
                                         f"{self.session.id} was closed by someone else")
                    return
                if state == _LOST:
                    self.ledger.fail(f"lost Flame task {tb.task_id} (batch {tb.batch_id}): {self._lost_cause(msg)}")
                    return
                # failed
                tb.errors.append(msg)
                with self._stats_lock:
                    self.failed_attempts.append({"batch_id": tb.batch_id, "task_id": tb.task_id, "attempt": tb.attempts,
                                                 "message": msg})
                if tb.attempts >= 2 or self._closing or self.ledger.error is not None:
                    if self.ledger.error is None:
                        self.ledger.fail(f"Flame task for batch {tb.batch_id} failed {tb.attempts} times (tasks "
                                         f"{', '.join(e['task_id'] for e in self.failed_attempts if e['batch_id'] == tb.batch_id)}"
                                         f"): {' | '.join(tb.errors)}")
                    return
                log.warning("flame: task %s (batch %d) failed: %s; retrying once", tb.task_id, tb.batch_id, msg)
                with self._stats_lock:
                    self.retries += 1
                if not self._create(tb):
                    return
        except Exception as e:  # noqa: BLE001 - never lose a sample silently
            log.exception("flame: watcher of batch %d crashed", tb.batch_id)
            self.ledger.fail(f"watcher of batch {tb.batch_id} crashed: {e!r}")
        finally:
            self._release_credit()
            with self._cv:
                self._watchers.discard(threading.current_thread())

    def _finish(self, tb: _Task, out: Optional[bytes]) -> None:
        try:
            res = pl.decode_result(out)
        except pl.PayloadError as e:
            self.ledger.fail(f"Flame task {tb.task_id} (batch {tb.batch_id}) returned an unreadable result: {e}")
            return
        rids = [rid for rid, _ in tb.items]
        got = [s.request_id for s in res.samples]
        if res.batch_id != tb.batch_id or got != rids:
            self.ledger.fail(f"Flame task {tb.task_id}: result of batch {res.batch_id} with {len(got)} samples does not "
                             f"match batch {tb.batch_id} with {len(rids)} samples")
            return
        ok = [(s.request_id, s.token_ids) for s in res.samples if s.ok]
        bad = [(s.request_id, s.error) for s in res.samples if not s.ok]
        self._note_result(tb, res)
        if ok:
            self.ledger.complete(ok)
        if bad:
            qsl = dict(tb.items)
            rid, err = bad[0]
            self.ledger.fail(f"{len(bad)} sample(s) of batch {tb.batch_id} failed in the service; first: request {rid} "
                             f"(QSL index {qsl.get(rid)}): {err}")

    # ------------------------------------------------------------------ bookkeeping
    def _note_executor(self, ex: dict, shard: Optional[str]) -> None:
        key = f"{ex.get('node')}/{ex.get('id')}"
        with self._stats_lock:
            e = self.executors.setdefault(key, {"id": ex.get("id"), "node": ex.get("node"), "pid": ex.get("pid"),
                                                "role": ex.get("role"), "seat": ex.get("seat"), "shard": shard, "tasks": 0})
            e["gc_max_pause_ms"] = max(e.get("gc_max_pause_ms") or 0.0, ex.get("gc_max_pause_ms") or 0.0)

    def _note_shard(self, meta: dict) -> None:
        sh = meta.get("shard") or {}
        key = f"{sh.get('node')}/{sh.get('key')}"
        with self._stats_lock:
            if key not in self.shards:
                self.shards[key] = dict(sh, engine=meta.get("engine"))
                log.info("flame: shard %s -> %s (%s), engine pid %s on host pid %s", key,
                         sh.get("gpu_uuid") or f"{sh.get('kind')}:{sh.get('device')}", sh.get("device_name"),
                         sh.get("engine_pid"), sh.get("host_pid"))

    def _note_result(self, tb: _Task, res: pl.TaskResult) -> None:
        meta = res.meta
        ex = meta.get("executor") or {}
        t = meta.get("t") or {}
        total = (tb.t_done or time.monotonic()) - tb.t_create
        exec_s = t.get("service_s")
        shard_key = f"{meta.get('node')}/{meta.get('shard')}"
        self._note_executor(ex, shard_key)
        with self._stats_lock:
            self.executors[f"{ex.get('node')}/{ex.get('id')}"]["tasks"] += 1
            if meta.get("engine_gc_max_pause_ms") is not None:
                self.engine_gc[shard_key] = max(self.engine_gc.get(shard_key, 0.0), meta["engine_gc_max_pause_ms"])
            self.bytes["out_raw"] += res.raw_bytes
            self.bytes["out_wire"] += res.wire_bytes
            if self.opts.record_tasks:
                first = self.ledger.first_issue_t or tb.t_create
                self.task_log.append({
                    "batch_id": tb.batch_id, "task_id": tb.task_id, "n": len(tb.items), "attempts": tb.attempts,
                    "executor": ex.get("id"), "pid": ex.get("pid"), "shard": shard_key,
                    "created_s": round(tb.t_create - first, 4),
                    "queue_s": round(total - exec_s, 4) if exec_s is not None else None,
                    "exec_s": exec_s, "engine_s": t.get("engine_s"),
                    "running_seen_s": round(tb.t_running - tb.t_create, 4) if tb.t_running else None,
                    "total_s": round(total, 4),
                    "in_raw": tb.raw_bytes, "in_wire": len(tb.data), "out_raw": res.raw_bytes, "out_wire": res.wire_bytes})

    # ------------------------------------------------------------------ shutdown
    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        if self._dispatcher.is_alive():
            self._dispatcher.join(30)
        try:
            if self.session is not None:
                self._close_session()
        finally:
            with self._cv:
                watchers = list(self._watchers)
            for th in watchers:
                th.join(30)
            if self._aw is not None:
                self._aw.close()
            if self.conn is not None:
                try:
                    self.conn.close()
                except Exception:  # noqa: BLE001
                    pass
            self.ledger.close()

    def _close_session(self) -> None:
        """Close the session; Flame refuses while a task is Running, so retry until it lets us."""
        import flamepy

        if self._session_closed:
            return
        t0 = time.monotonic()
        attempts = 0
        unreachable_since = None
        while True:
            attempts += 1
            try:
                self.conn.close_session(self.session.id)
                self._session_closed = True
                break
            except flamepy.FlameError as e:
                msg = e.message
            except Exception as e:  # noqa: BLE001
                msg = str(e)
            if not self.reachable():
                unreachable_since = unreachable_since or time.monotonic()
                if time.monotonic() - unreachable_since >= self.opts.unreachable_timeout_s:
                    self.close_info["error"] = (f"the Flame session manager at {self.endpoint} has been unreachable for "
                                                f"{self.opts.unreachable_timeout_s:.0f} s; session {self.session.id} "
                                                f"was not closed: {msg}")
                    break
            else:
                unreachable_since = None
                if not self._session_exists():
                    self.close_info["error"] = f"session {self.session.id} is gone (lost by Flame): {msg}"
                    break
            if time.monotonic() - t0 > self.opts.close_timeout_s:
                self.close_info["error"] = (f"session {self.session.id} could not be closed within "
                                            f"{self.opts.close_timeout_s:.0f} s: {msg}")
                break
            if attempts == 1 or attempts % 20 == 0:
                log.info("flame: session %s not closed yet (%s); waiting for running tasks", self.session.id, msg)
            time.sleep(0.5)
        self.close_info.update(closed=self._session_closed, attempts=attempts, seconds=round(time.monotonic() - t0, 3))
        try:
            atexit.unregister(self._atexit_close)
        except Exception:  # noqa: BLE001
            pass
        if self._session_closed:
            log.info("flame: session %s closed (%d attempt(s), %.1f s)", self.session.id, attempts, self.close_info["seconds"])
        else:
            log.error("flame: %s", self.close_info["error"])
            self.ledger.fail(self.close_info["error"])

    def reachable(self, timeout: float = 2.0) -> bool:
        """True if the session manager's frontend port accepts a TCP connection."""
        u = urlparse(self.endpoint or "")
        try:
            with socket.create_connection((u.hostname or "127.0.0.1", u.port or 8080), timeout=timeout):
                return True
        except OSError:
            return False

    def _lost_cause(self, msg: str) -> str:
        if self.endpoint and not self.reachable():
            return (f"the Flame session manager at {self.endpoint} is unreachable (it stopped, or the network failed); "
                    f"with storage none its sessions are lost: {msg}")
        return msg

    def _session_exists(self) -> bool:
        try:
            return any(x.id == self.session.id for x in self.conn.list_sessions())
        except Exception:  # noqa: BLE001 - cannot tell: keep trying to close
            return True

    def _atexit_close(self) -> None:
        if self.session is not None and not self._session_closed:
            try:
                self.conn.close_session(self.session.id)
                self._session_closed = True
            except Exception:  # noqa: BLE001
                pass

    # ------------------------------------------------------------------ record
    def record(self) -> dict:
        o = self.opts
        with self._stats_lock:
            tasks = list(self.task_log)
            rec = {
                "flame": {
                    "endpoint": self.endpoint, "application": o.app, "session_id": self.session.id if self.session else None,
                    "options": dataclasses.asdict(o), "batch_size": self.batch_size, "batch_window_ms": o.batch_window_ms,
                    "engines": o.engines, "executors_per_engine": self.per_engine, "executors": self.n_executors,
                    "max_inflight_tasks": self.max_inflight, "peak_inflight_tasks": self.peak_inflight,
                    "payload": o.payload, "engine_backend": o.engine_backend,
                    "warmup": self.warmup,
                    "batch_size_distribution": {str(k): v for k, v in sorted(self.batch_sizes.items())},
                    "tasks": {"completed": len(tasks), "retries": self.retries, "failed_attempts": self.failed_attempts,
                              "queue_s": _summary([t["queue_s"] for t in tasks]),
                              "exec_s": _summary([t["exec_s"] for t in tasks]),
                              "engine_s": _summary([t["engine_s"] for t in tasks]),
                              "total_s": _summary([t["total_s"] for t in tasks])},
                    "bytes": dict(self.bytes, in_ratio=_ratio(self.bytes["in_wire"], self.bytes["in_raw"]),
                                  out_ratio=_ratio(self.bytes["out_wire"], self.bytes["out_raw"])),
                    "shards": [dict({k: v for k, v in sh.items() if k != "engine"}, shard=key,
                                    engine_gc_max_pause_ms=self.engine_gc.get(key))
                               for key, sh in sorted(self.shards.items())],
                    "executor_list": sorted(self.executors.values(), key=lambda e: (str(e["shard"]), e["seat"] or 0)),
                    "close": self.close_info,
                    "per_task": tasks,
                }
            }
        return rec


def _summary(values) -> dict:
    v = sorted(x for x in values if x is not None)
    if not v:
        return {}
    pick = lambda q: v[min(len(v) - 1, int(round(q * (len(v) - 1))))]  # noqa: E731
    return {"n": len(v), "mean": round(statistics.fmean(v), 4), "p50": round(pick(0.5), 4), "p90": round(pick(0.9), 4),
            "p99": round(pick(0.99), 4), "max": round(v[-1], 4)}


def _ratio(a: int, b: int) -> Optional[float]:
    return round(a / b, 4) if b else None
