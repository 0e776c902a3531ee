"""In-memory state of the stand-in session manager, with sqlite-mode semantics of Flame v0.6.0.

Everything here runs under one lock; every change does ``notify_all`` on one condition, which is what
watchers (WatchTask), executors (the LaunchTask long poll) and the scheduler wait on.

Behaviour reproduced from the v0.6.0 session manager (see docs/flame_standin.md for the sources):
  * task ids are sequential integers per session, starting at 1 (string on the wire);
  * task/session ``creation_time``/``completion_time`` travel in ms but the sqlite engine stores whole
    seconds, so by default the values are multiples of 1000 (``time_resolution_ms``); event times are ms;
  * CreateTask on a closed (or unknown) session fails (sqlite NOT NULL constraint), duplicate
    RegisterApplication fails, UnregisterApplication with open sessions fails;
  * CloseSession fails while a task is Running; Pending tasks become Cancelled (no event recorded);
  * task events: 0 "created", 1 "Running", 2 "completed" or 3 <failure message>; they are only
    returned by GetTask (watch/list/create messages carry none);
  * session events: 1001 bind failure, 1002 retry limit reached; returned by GetSession/ListSession.
"""

from __future__ import annotations

import heapq
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from flamepy.proto import types_pb2

# Wire enums (flame.v1).
PENDING, RUNNING, SUCCEED, FAILED, CANCELLED = 0, 1, 2, 3, 4
TASK_STATE_NAMES = {PENDING: "Pending", RUNNING: "Running", SUCCEED: "Succeed", FAILED: "Failed", CANCELLED: "Cancelled"}
TERMINAL = (SUCCEED, FAILED, CANCELLED)
SESSION_OPEN, SESSION_CLOSED = 0, 1

# Session event codes (common/src/apis/types.rs in v0.6.0).
SESSION_BIND_FAILED = 1001
SESSION_RETRY_LIMIT_REACHED = 1002
# BindExecutorCompleted result codes.
BIND_RESULT_SHIM_CREATE_FAILED = 11
BIND_RESULT_ON_SESSION_ENTER_FAILED = 12

DEFAULT_MAX_INSTANCES = 1_000_000  # application max_instances default (stored, not enforced)
DEFAULT_DELAY_RELEASE = 60  # seconds
# Session resreq applied when the client sends none and no cluster default is configured.
FALLBACK_RESREQ = (1, 1024 * 1024 * 1024, 0)  # cpu, memory, gpu


class StoreError(Exception):
    """A storage/controller error; ``kind`` follows the Rust FlameError variant it stands for."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind  # "not_found" | "invalid_config" | "invalid_state" | "storage" | "internal"
        self.message = message


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass
class EventRec:
    code: int
    message: Optional[str]
    creation_ms: int

    def to_proto(self) -> types_pb2.Event:
        return types_pb2.Event(code=self.code, message=self.message, creation_time=self.creation_ms)


@dataclass
class AppRec:
    name: str
    spec: types_pb2.ApplicationSpec  # normalised copy (defaults filled in)
    creation_ms: int

    @property
    def delay_release(self) -> int:
        return int(self.spec.delay_release)

    def to_proto(self) -> types_pb2.Application:
        return types_pb2.Application(
            metadata=types_pb2.Metadata(id=self.name, name=self.name),
            spec=self.spec,
            status=types_pb2.ApplicationStatus(state=types_pb2.Enabled, creation_time=self.creation_ms),
        )


@dataclass
class TaskRec:
    id: int
    session_id: str
    input: Optional[bytes]
    creation_ms: int
    state: int = PENDING
    output: Optional[bytes] = None
    completion_ms: Optional[int] = None
    events: List[EventRec] = field(default_factory=list)
    # Stand-in diagnostics (precise wall-clock seconds; not on the wire).
    created_at: float = 0.0
    started_at: Optional[float] = None
    completed_at: Optional[float] = None
    executor_id: Optional[str] = None
    message: Optional[str] = None

    def to_proto(self, with_events: bool = False) -> types_pb2.Task:
        status = types_pb2.TaskStatus(state=self.state, creation_time=self.creation_ms, completion_time=self.completion_ms)
        if with_events:
            status.events.extend(e.to_proto() for e in self.events)
        return types_pb2.Task(
            metadata=types_pb2.Metadata(id=str(self.id), name=str(self.id)),
            spec=types_pb2.TaskSpec(session_id=self.session_id, input=self.input, output=self.output),
            status=status,
        )


@dataclass
class SessionRec:
    id: str
    application: str
    common_data: Optional[bytes]
    min_instances: int
    max_instances: Optional[int]
    batch_size: int
    priority: int
    resreq: tuple  # (cpu, memory, gpu)
    creation_ms: int
    seq: int
    state: int = SESSION_OPEN
    completion_ms: Optional[int] = None
    tasks: Dict[int, TaskRec] = field(default_factory=dict)
    pending: List[int] = field(default_factory=list)  # heap of Pending task ids (FIFO = lowest id first)
    next_task_id: int = 1
    events: List[EventRec] = field(default_factory=list)
    retry_count: int = 0

    def counts(self) -> Dict[int, int]:
        c = {s: 0 for s in TASK_STATE_NAMES}
        for t in self.tasks.values():
            c[t.state] += 1
        return c

    def to_proto(self, with_events: bool = False) -> types_pb2.Session:
        c = self.counts()
        status = types_pb2.SessionStatus(
            state=self.state,
            creation_time=self.creation_ms,
            completion_time=self.completion_ms,
            pending=c[PENDING],
            running=c[RUNNING],
            succeed=c[SUCCEED],
            failed=c[FAILED],
            cancelled=c[CANCELLED],
        )
        if with_events:
            status.events.extend(e.to_proto() for e in self.events)
        cpu, mem, gpu = self.resreq
        spec = types_pb2.SessionSpec(
            application=self.application,
            common_data=self.common_data,
            min_instances=self.min_instances,
            max_instances=self.max_instances,
            batch_size=self.batch_size,
            priority=self.priority,
            resreq=types_pb2.ResourceRequirement(cpu=cpu, memory=mem, gpu=gpu),
        )
        return types_pb2.Session(metadata=types_pb2.Metadata(id=self.id, name=self.id), spec=spec, status=status)


def _sqlite_error(code: int, text: str) -> str:
    # The shape sqlx gives a constraint violation.
    return f"error returned from database: ({code}) {text}"


# Applications the v0.6.0 session manager seeds at start-up (common::default_applications()).
def default_applications() -> Dict[str, types_pb2.ApplicationSpec]:
    return {
        "flmexec": types_pb2.ApplicationSpec(
            description="The Flame Executor application, which is used to run scripts.",
            command="${FLAME_HOME}/bin/flmexec-service",
        ),
        "flmping": types_pb2.ApplicationSpec(
            command="${FLAME_HOME}/bin/flmping-service", url="file://${FLAME_HOME}/bin/flmping-service"
        ),
        "flmrun": types_pb2.ApplicationSpec(
            description="The Flame Runner application for executing customized Python applications.",
            command="${FLAME_HOME}/bin/uv",
            arguments=["run", "--python", "python${FLAME_PYTHON_VERSION}", "python", "-m", "flamepy.runner.runpy"],
            installer="python",
        ),
    }


class Store:
    def __init__(self, time_resolution_ms: int = 1000):
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)
        self.apps: Dict[str, AppRec] = {}
        self.sessions: Dict[str, SessionRec] = {}
        self.time_resolution_ms = max(1, int(time_resolution_ms))
        self._seq = 0
        self.stopping = False
        self.watching: Dict[tuple, int] = {}  # (session id, task id) -> WatchTask streams waiting on that task

    # ------------------------------------------------------------------ helpers
    def stamp(self) -> int:
        """A creation/completion time as the sqlite engine keeps it (whole seconds by default), in ms."""
        r = self.time_resolution_ms
        return (now_ms() // r) * r

    def changed(self) -> None:
        with self.cond:
            self.cond.notify_all()

    # ------------------------------------------------------------- applications
    @staticmethod
    def normalise_app_spec(spec: types_pb2.ApplicationSpec) -> types_pb2.ApplicationSpec:
        s = types_pb2.ApplicationSpec()
        s.CopyFrom(spec)
        if not s.HasField("max_instances"):
            s.max_instances = DEFAULT_MAX_INSTANCES
        if not s.HasField("delay_release"):
            s.delay_release = DEFAULT_DELAY_RELEASE
        if s.HasField("working_directory") and not s.working_directory:
            s.ClearField("working_directory")
        return s

    def register_application(self, name: str, spec: types_pb2.ApplicationSpec) -> None:
        with self.cond:
            if name in self.apps:
                raise StoreError(
                    "storage",
                    "failed to register application: "
                    + _sqlite_error(1555, "UNIQUE constraint failed: applications.name"),
                )
            self.apps[name] = AppRec(name, self.normalise_app_spec(spec), self.stamp())
            self.cond.notify_all()

    def update_application(self, name: str, spec: types_pb2.ApplicationSpec) -> None:
        with self.cond:
            if name not in self.apps:
                raise StoreError("storage", f"application <{name}> not found")
            self.apps[name].spec = self.normalise_app_spec(spec)
            self.cond.notify_all()

    def unregister_application(self, name: str) -> None:
        with self.cond:
            if name not in self.apps:
                raise StoreError("not_found", f"application <{name}> not found")
            open_count = sum(1 for s in self.sessions.values() if s.application == name and s.state == SESSION_OPEN)
            if open_count > 0:
                raise StoreError("storage", f"{open_count} open sessions in the application")
            # sqlite engine deletes the application's (closed) sessions too; their watchers end silently.
            for sid in [s.id for s in self.sessions.values() if s.application == name]:
                del self.sessions[sid]
            del self.apps[name]
            self.cond.notify_all()

    def get_application(self, name: str) -> AppRec:
        with self.lock:
            app = self.apps.get(name)
            if app is None:
                raise StoreError("not_found", f"application <{name}> not found")
            return app

    # ----------------------------------------------------------------- sessions
    def create_session(self, sid: str, spec: types_pb2.SessionSpec, resreq: tuple) -> SessionRec:
        with self.cond:
            if sid in self.sessions:
                raise StoreError("storage", _sqlite_error(1555, "UNIQUE constraint failed: sessions.id"))
            if spec.application not in self.apps:
                raise StoreError("storage", _sqlite_error(1299, "NOT NULL constraint failed: sessions.application"))
            self._seq += 1
            ssn = SessionRec(
                id=sid,
                application=spec.application,
                common_data=spec.common_data if spec.HasField("common_data") else None,
                min_instances=spec.min_instances,
                max_instances=spec.max_instances if spec.HasField("max_instances") else None,
                batch_size=max(1, spec.batch_size),
                priority=spec.priority,
                resreq=resreq,
                creation_ms=self.stamp(),
                seq=self._seq,
            )
            self.sessions[sid] = ssn
            self.cond.notify_all()
            return ssn

    def get_session(self, sid: str) -> SessionRec:
        with self.lock:
            ssn = self.sessions.get(sid)
            if ssn is None:
                raise StoreError("not_found", sid)
            return ssn

    def close_session(self, sid: str) -> SessionRec:
        with self.cond:
            ssn = self.sessions.get(sid)
            if ssn is None:
                raise StoreError("not_found", f"session <{sid}>")
            if any(t.state == RUNNING for t in ssn.tasks.values()):
                raise StoreError("storage", "Cannot close session with running tasks")
            stamp = self.stamp()
            ssn.state = SESSION_CLOSED
            ssn.completion_ms = stamp
            for tid in ssn.pending:
                t = ssn.tasks[tid]
                if t.state == PENDING:
                    t.state = CANCELLED
                    t.completion_ms = stamp
                    t.completed_at = time.time()
            ssn.pending = []
            self.cond.notify_all()
            return ssn

    def delete_session(self, sid: str) -> SessionRec:
        with self.cond:
            ssn = self.sessions.get(sid)
            if ssn is None:
                raise StoreError("not_found", f"session <{sid}>")
            open_tasks = sum(1 for t in ssn.tasks.values() if t.state in (PENDING, RUNNING))
            if open_tasks > 0:
                raise StoreError("storage", f"{open_tasks} open tasks in the session")
            del self.sessions[sid]
            self.cond.notify_all()
            return ssn

    def drop_session(self, sid: str) -> None:
        """Fault injection: the session vanishes from memory (as with storage `none` when its application
        is unregistered). Watchers end silently; executors bound to it unbind."""
        with self.cond:
            self.sessions.pop(sid, None)
            self.cond.notify_all()

    def add_session_event(self, sid: str, code: int, message: str) -> None:
        with self.cond:
            ssn = self.sessions.get(sid)
            if ssn is not None:
                ssn.events.append(EventRec(code, message, now_ms()))
            self.cond.notify_all()

    # -------------------------------------------------------------------- tasks
    def create_task(self, sid: str, data: Optional[bytes]) -> TaskRec:
        with self.cond:
            ssn = self.sessions.get(sid)
            if ssn is None or ssn.state != SESSION_OPEN:
                raise StoreError("storage", _sqlite_error(1299, "NOT NULL constraint failed: tasks.ssn_id"))
            tid = ssn.next_task_id
            ssn.next_task_id += 1
            t = TaskRec(id=tid, session_id=sid, input=data, creation_ms=self.stamp(), created_at=time.time())
            t.events.append(EventRec(PENDING, "Task was created with state <Pending>", now_ms()))
            ssn.tasks[tid] = t
            heapq.heappush(ssn.pending, tid)
            self.cond.notify_all()
            return t

    def get_task(self, sid: str, tid: int) -> TaskRec:
        with self.lock:
            ssn = self.sessions.get(sid)
            if ssn is None:
                raise StoreError("not_found", sid)
            t = ssn.tasks.get(tid)
            if t is None:
                raise StoreError("not_found", str(tid))
            return t

    def find_task(self, sid: str, tid: int) -> Optional[TaskRec]:
        ssn = self.sessions.get(sid)
        return None if ssn is None else ssn.tasks.get(tid)

    def pop_pending_task(self, sid: str, executor_id: str, host: str) -> Optional[TaskRec]:
        """LaunchTask: lowest Pending id -> Running. Caller holds the lock."""
        ssn = self.sessions.get(sid)
        if ssn is None:
            return None
        while ssn.pending:
            tid = heapq.heappop(ssn.pending)
            t = ssn.tasks[tid]
            if t.state != PENDING:
                continue
            t.state = RUNNING
            t.started_at = time.time()
            t.executor_id = executor_id
            t.events.append(EventRec(RUNNING, "Task state was updated to <Running>", now_ms()))
            self.cond.notify_all()
            return t
        return None

    def complete_task(self, t: TaskRec, state: int, output: Optional[bytes], message: Optional[str]) -> None:
        with self.cond:
            t.state = state
            t.output = output
            t.completion_ms = self.stamp()
            t.completed_at = time.time()
            if state == FAILED:
                t.message = message if message is not None else "Task failed with state <Failed>"
                ev = t.message
            else:
                t.message = message
                ev = f"Task was completed with state <{TASK_STATE_NAMES[state]}>"
            t.events.append(EventRec(state, ev, now_ms()))
            self.cond.notify_all()
