"""StandinCluster: the Frontend server + in-memory store + scheduler + executors, in one process."""

from __future__ import annotations

import atexit
import logging
import os
import platform
import shutil
import signal
import socket
import tempfile
import threading
import time
from concurrent import futures
from pathlib import Path
from typing import Dict, List, Optional, Union

import grpc
from flamepy.proto import frontend_pb2_grpc, types_pb2

from sut.flame.endpoint import STANDIN_MARK

from ._executor import Executor
from ._frontend import FrontendServicer
from ._store import (
    SESSION_OPEN,
    TASK_STATE_NAMES,
    Store,
    default_applications,
    now_ms,
)

log = logging.getLogger("flame_standin")


def _detect_gpus(env: Dict[str, str]) -> int:
    """The node's GPU count as the FEM reports it: entries of CUDA_VISIBLE_DEVICES (NVML is not consulted)."""
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    if cvd is None:
        return 0
    return len([x for x in cvd.split(",") if x.strip() and x.strip() != "-1"])


def _total_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover
        return 0


class StandinCluster:
    """A single-process stand-in for a Flame v0.6.0 cluster (session manager + one FEM per node).

    Contract (used by the Flame SUT's integration tests): see docs/flame_standin.md.
    Keyword-only arguments after ``env`` are stand-in extras (fault injection and fidelity knobs).
    """

    def __init__(
        self,
        workdir: Union[str, Path],
        max_executors: int = 8,
        schedule_interval_ms: int = 100,
        bind_retry_limit: int = 5,
        max_message_bytes: int = 4 * 1024 * 1024,
        gpu_slots: Optional[List[str]] = None,
        socket_timeout_s: float = 120.0,
        env: Optional[dict] = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        bind_delay_s: float = 0.0,
        kill_grace_s: float = 5.0,
        time_resolution_ms: int = 1000,
        leave_failure: str = "stuck",
        leave_retry_interval_s: float = 1.0,
        seed_default_apps: bool = True,
        keep_auto_dirs: bool = False,
        frontend_threads: int = 512,
        node_name: Optional[str] = None,
    ):
        if leave_failure not in ("stuck", "release"):
            raise ValueError("leave_failure must be 'stuck' or 'release'")
        self.workdir = Path(workdir).resolve()
        self.max_executors = int(max_executors)
        self.schedule_interval_ms = int(schedule_interval_ms)
        self.bind_retry_limit = int(bind_retry_limit)
        self.max_message_bytes = int(max_message_bytes)
        self.gpu_slots = [str(s) for s in gpu_slots] if gpu_slots else None
        self.socket_timeout_s = float(socket_timeout_s)
        self.env = {str(k): str(v) for k, v in (env or {}).items()}
        self.host = host
        self.port = int(port)
        self.bind_delay_s = float(bind_delay_s)
        self.kill_grace_s = float(kill_grace_s)
        self.leave_failure = leave_failure
        self.leave_retry_interval_s = float(leave_retry_interval_s)
        self.seed_default_apps = seed_default_apps
        self.keep_auto_dirs = keep_auto_dirs
        self.frontend_threads = int(frontend_threads)
        self.node_name = node_name or socket.gethostname()

        self._store = Store(time_resolution_ms=time_resolution_ms)
        self._executors: List[Executor] = []
        self._slot_owner: Dict[str, Optional[str]] = {s: None for s in (self.gpu_slots or [])}
        self._node_gpus = _detect_gpus({**os.environ, **self.env})
        self._stop_event = threading.Event()
        self._paused = False
        self._server: Optional[grpc.Server] = None
        self._scheduler: Optional[threading.Thread] = None
        self._socket_dir: Optional[str] = None
        self._started = False
        self._stopped = False
        self.endpoint = ""

    # ----------------------------------------------------------------- lifecycle
    def start(self) -> "StandinCluster":
        if self._started:
            return self
        self.workdir.mkdir(parents=True, exist_ok=True)
        # Unix socket paths must stay short (108 bytes), so they live in their own temp dir.
        self._socket_dir = tempfile.mkdtemp(prefix="flsa-")
        if self.seed_default_apps:
            for name, spec in default_applications().items():
                self._store.register_application(name, spec)
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=self.frontend_threads, thread_name_prefix="standin-frontend"),
            options=[
                # tonic default: 4 MiB decode, unlimited encode.
                ("grpc.max_receive_message_length", self.max_message_bytes),
                ("grpc.max_send_message_length", -1),
                ("grpc.so_reuseport", 0),
            ],
        )
        frontend_pb2_grpc.add_FrontendServicer_to_server(FrontendServicer(self), self._server)
        bound = self._server.add_insecure_port(f"{self.host}:{self.port}")
        if not bound:
            raise RuntimeError(f"cannot bind {self.host}:{self.port}")
        self.port = bound
        self.endpoint = f"http://{self.host}:{bound}"
        self._server.start()
        self._scheduler = threading.Thread(target=self._schedule_loop, name="standin-scheduler", daemon=True)
        self._scheduler.start()
        self._started = True
        atexit.register(self.stop)
        log.info("flame stand-in serving on %s (workdir %s)", self.endpoint, self.workdir)
        return self

    def stop(self) -> None:
        if not self._started or self._stopped:
            return
        self._stopped = True
        self._stop_event.set()
        store = self._store
        with store.cond:
            store.stopping = True
            store.cond.notify_all()
            executors = list(self._executors)
        # Kill every service process group first (this also unblocks RPCs stuck in the services).
        grace = min(self.kill_grace_s, 2.0)
        killers = [threading.Thread(target=e.terminate, args=(grace,), daemon=True) for e in executors]
        for t in killers:
            t.start()
        for t in killers:
            t.join(timeout=grace + 15)
        for e in executors:
            e.thread.join(timeout=5)
        if self._scheduler is not None:
            self._scheduler.join(timeout=5)
        if self._server is not None:
            self._server.stop(grace=0.5).wait(timeout=5)
        if self._socket_dir:
            shutil.rmtree(self._socket_dir, ignore_errors=True)
        try:
            atexit.unregister(self.stop)
        except Exception:  # pragma: no cover
            pass

    def __enter__(self) -> "StandinCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ----------------------------------------------------------------- scheduler
    def _schedule_loop(self) -> None:
        interval = max(self.schedule_interval_ms, 1) / 1000.0
        while not self._stop_event.wait(interval):
            if self._paused:
                continue
            try:
                self._schedule_once()
            except Exception:  # pragma: no cover - defensive
                log.exception("scheduling cycle failed")

    def _schedule_once(self) -> None:
        """One cycle: every Open session with Pending tasks that is under its max_instances gets at most ONE new
        executor, while the cluster has room (max_executors, and a free GPU slot when gpu_slots is set)."""
        store = self._store
        created = []
        with store.cond:
            live = [e for e in self._executors if e.state != "Released"]
            # Real v0.6.0: the allocate action first "pipelines" Unbinding executors onto a session that needs
            # executors (matched by shim only), so a stuck one (§3.8) is offered to every such session each cycle,
            # never binds, and no new executor is created while it exists (checked with the real binaries).
            starve = any(e.stuck for e in live)
            for ssn in sorted(store.sessions.values(), key=lambda s: s.seq):
                if starve:
                    break
                if ssn.state != SESSION_OPEN or not ssn.pending:
                    continue
                if ssn.retry_count >= self.bind_retry_limit:
                    continue  # starved: stays Open, tasks stay Pending
                if ssn.application not in store.apps:
                    continue
                mine = sum(1 for e in live if e.session_id == ssn.id)
                if ssn.max_instances is not None and mine >= ssn.max_instances:
                    continue
                if len(live) >= self.max_executors:
                    break
                gpu = ssn.resreq[2]
                slot = None
                if self.gpu_slots is not None:
                    if gpu > 1:
                        continue  # one GPU per node (one FEM per GPU): never fits
                    free = [s for s in self.gpu_slots if self._slot_owner[s] is None]
                    if not free:
                        break
                    slot = free[0]
                    node = f"{self.node_name}-slot{slot}"
                else:
                    if gpu > 0 and sum(e.resreq[2] for e in live) + gpu > self._node_gpus:
                        continue  # DRF: a GPU session never fits a node without (enough) GPUs
                    node = self.node_name
                ex = Executor(self, ssn.id, node, slot, ssn.resreq)
                if slot is not None:
                    self._slot_owner[slot] = ex.id
                self._executors.append(ex)
                live.append(ex)
                created.append(ex)
            if created:
                store.cond.notify_all()
        for ex in created:
            log.info("scheduler: new executor %s for session %s (slot %s)", ex.id, ex.session_id, ex.slot)
            ex.start()

    def _executor_released(self, ex: Executor) -> None:
        with self._store.cond:
            if ex.slot is not None and self._slot_owner.get(ex.slot) == ex.id:
                self._slot_owner[ex.slot] = None
            self._store.cond.notify_all()

    # ------------------------------------------------------------ wire helpers
    def _executor_protos(self) -> List[types_pb2.Executor]:
        out = []
        with self._store.lock:
            for e in self._executors:
                if e.state == "Released":
                    continue
                cpu, mem, gpu = e.resreq
                out.append(
                    types_pb2.Executor(
                        metadata=types_pb2.Metadata(id=e.id, name=e.id),
                        spec=types_pb2.ExecutorSpec(
                            node=e.node, resreq=types_pb2.ResourceRequirement(cpu=cpu, memory=mem, gpu=gpu), shim=0
                        ),
                        status=types_pb2.ExecutorStatus(state=e.proto_state(), session_id=e.session_id),
                    )
                )
        return out

    def _node_protos(self) -> List[types_pb2.Node]:
        cpu = os.cpu_count() or 1
        mem = _total_memory()
        if self.gpu_slots is not None:
            nodes = [(f"{self.node_name}-slot{s}", 1) for s in self.gpu_slots]
        else:
            nodes = [(self.node_name, self._node_gpus)]
        out = []
        for name, gpus in nodes:
            cap = types_pb2.ResourceRequirement(cpu=cpu, memory=mem, gpu=gpus)
            out.append(
                types_pb2.Node(
                    metadata=types_pb2.Metadata(id=name, name=name),
                    spec=types_pb2.NodeSpec(hostname=name),
                    status=types_pb2.NodeStatus(
                        state=types_pb2.Ready,
                        capacity=cap,
                        allocatable=cap,
                        # the mark a run against this stand-in records (sut.flame.endpoint.control_plane_kind)
                        info=types_pb2.NodeInfo(arch=platform.machine(),
                                                os=f"{platform.system().lower()} {STANDIN_MARK}"),
                        last_heartbeat_time=now_ms(),
                    ),
                )
            )
        return out

    # ------------------------------------------------------------- inspection
    def executors(self) -> List[dict]:
        """Every executor ever created, oldest first (Released ones included; filter on "state").

        Keys: id, session_id (None once Released or stuck), state ("Binding" | "Bound" | "Unbinding" |
        "Released"), pid (service process), slot, plus extras: bound_session_id, node, returncode,
        created_at/bound_at/released_at, tasks_run, current_task, bind_error, leave_error, stuck, wedged,
        sigkill_needed, log_out, log_err.
        """
        with self._store.lock:
            return [e.info() for e in self._executors]

    def kill_service(self, executor_id: Optional[str] = None, sig: int = signal.SIGKILL) -> int:
        """Send ``sig`` to one service process (not its group): the first Bound executor's if ``executor_id``
        is None. Returns the pid. The executor is not told; like the real FEM it finds out on the next RPC."""
        with self._store.lock:
            cands = [e for e in self._executors if e.pid is not None and e.state != "Released"]
            if executor_id is not None:
                cands = [e for e in cands if e.id == executor_id]
            else:
                cands = [e for e in cands if e.state == "Bound"]
            if not cands:
                raise LookupError(f"no live service process for executor {executor_id!r}")
            pid = cands[0].pid
        os.kill(pid, sig)
        return pid

    def session_events(self, session_id: str) -> List[tuple]:
        with self._store.lock:
            ssn = self._store.sessions.get(session_id)
            if ssn is None:
                raise KeyError(session_id)
            return [(e.code, e.message) for e in ssn.events]

    def tasks(self, session_id: str) -> List[dict]:
        """Tasks of a session in id order: id (str), state (name), state_code, creation_time/completion_time
        (wire values, ms), created_at/started_at/completed_at (precise wall-clock seconds, stand-in only),
        executor_id, input_len, output_len, message (failure text)."""
        with self._store.lock:
            ssn = self._store.sessions.get(session_id)
            if ssn is None:
                raise KeyError(session_id)
            return [
                {
                    "id": str(t.id),
                    "state": TASK_STATE_NAMES[t.state],
                    "state_code": t.state,
                    "creation_time": t.creation_ms,
                    "completion_time": t.completion_ms,
                    "created_at": t.created_at,
                    "started_at": t.started_at,
                    "completed_at": t.completed_at,
                    "executor_id": t.executor_id,
                    "input_len": None if t.input is None else len(t.input),
                    "output_len": None if t.output is None else len(t.output),
                    "message": t.message,
                }
                for _, t in sorted(ssn.tasks.items())
            ]

    def session_state(self, session_id: str) -> dict:
        """Open/Closed, task counts by state name, bind retry count."""
        with self._store.lock:
            ssn = self._store.sessions.get(session_id)
            if ssn is None:
                raise KeyError(session_id)
            counts = ssn.counts()
            return {
                "state": "Open" if ssn.state == SESSION_OPEN else "Closed",
                "counts": {TASK_STATE_NAMES[k]: v for k, v in counts.items()},
                "retry_count": ssn.retry_count,
            }

    # --------------------------------------------------------- fault injection
    def pause_scheduler(self) -> None:
        """No new executors until resume_scheduler() (existing ones keep running)."""
        self._paused = True

    def resume_scheduler(self) -> None:
        self._paused = False

    def restart_executor_manager(self, timeout: float = 15.0) -> int:
        """What restarting the real executor manager does for executors stuck in Unbinding (§3.8, §7 of
        docs/flame_standin.md): they are dropped, their processes ended, and new executors can be created
        again. Returns how many were stuck."""
        with self._store.cond:
            stuck = [e for e in self._executors if e.stuck]
            for e in stuck:
                e.restart_requested = True
        self.wait_until(lambda: all(e.state == "Released" for e in stuck), timeout)
        return len(stuck)

    def watchers(self, session_id: str, task_id: str) -> int:
        """How many WatchTask streams are waiting on this task now (a test can then act knowing a watch is
        under way, instead of sleeping)."""
        with self._store.lock:
            return self._store.watching.get((session_id, int(task_id)), 0)

    def drop_session(self, session_id: str) -> None:
        """Make a session vanish from memory (what storage `none` does on UnregisterApplication or eviction):
        its watch streams end silently, so flamepy futures never complete; bound executors unbind."""
        self._store.drop_session(session_id)

    def wait_until(self, predicate, timeout: float = 30.0, interval: float = 0.05) -> bool:
        """Poll ``predicate()`` until true or ``timeout``; returns the last value (handy in tests)."""
        deadline = time.monotonic() + timeout
        while True:
            v = predicate()
            if v or time.monotonic() >= deadline:
                return v
            time.sleep(interval)
