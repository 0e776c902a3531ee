"""One stand-in executor = the FEM's executor state machine for ONE binding, run on a thread.

Binding:   spawn ``command`` + ``arguments`` (no shell) in a new process group, cwd = working_directory,
           stdout/stderr -> ``<process dir>/<executor_id>.out|.err``; wait for the Unix socket; connect
           ``InstanceStub``; ``OnSessionEnter``.  Any failure = bind failure (session event 1001, retry count
           +1, event 1002 when the limit is crossed).
Bound:     loop { LaunchTask (lowest Pending id, long poll up to the app's delay_release, none at once when
           the session is closed) -> Running -> OnTaskInvoke -> Succeed / Failed }, strictly serial.
Unbinding: ``OnSessionLeave``; then SIGTERM to the process group (SIGKILL after ``kill_grace_s`` -- the real
           FEM never escalates, see ``sigkill_needed``).  If OnSessionLeave fails, the real FEM retries
           Unbinding forever (tight loop, process left alone); by default the stand-in does the same
           ("stuck"), with a 1 s pause instead of a busy loop.
Released:  socket removed, ``<process dir>/work/<app>`` removed (the real ExecutorWorkDir drop), auto process
           dir removed.  A new binding always means a new process.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Dict, Optional

import grpc
from flamepy.proto import shim_pb2, shim_pb2_grpc, types_pb2

from ._store import (
    BIND_RESULT_ON_SESSION_ENTER_FAILED,
    BIND_RESULT_SHIM_CREATE_FAILED,
    FAILED,
    SESSION_BIND_FAILED,
    SESSION_CLOSED,
    SESSION_RETRY_LIMIT_REACHED,
    SUCCEED,
    EventRec,
    TaskRec,
    now_ms,
)

if TYPE_CHECKING:  # pragma: no cover
    from ._cluster import StandinCluster

log = logging.getLogger("flame_standin.executor")

_VAR_RE = re.compile(r"\$(?:\{([A-Za-z0-9_]+)(?::-([^}]*))?\}|([A-Za-z0-9_]+))")


def expand_strict(value: str, env: Dict[str, str]) -> str:
    """``shellexpand::env``: expand $VAR / ${VAR} / ${VAR:-default}; if any variable is missing the whole
    value is returned unexpanded (that is how the FEM treats application ``environments``)."""
    missing = False

    def sub(m):
        nonlocal missing
        name = m.group(1) or m.group(3)
        if name in env:
            return env[name]
        if m.group(2) is not None:
            return m.group(2)
        missing = True
        return m.group(0)

    out = _VAR_RE.sub(sub, value)
    return value if missing else out


def expand_lenient(value: str, env: Dict[str, str]) -> str:
    """``env_with_context_no_errors``: unknown variables are left as they are (command and arguments)."""

    def sub(m):
        name = m.group(1) or m.group(3)
        if name in env:
            return env[name]
        if m.group(2) is not None:
            return m.group(2)
        return m.group(0)

    return _VAR_RE.sub(sub, value)


def _varint_len(n: int) -> int:
    size = 1
    while n >= 0x80:
        n >>= 7
        size += 1
    return size


def _field_len(payload: int) -> int:
    """Bytes a length-delimited field with a 1-byte tag takes."""
    return 1 + _varint_len(payload) + payload


def group_members(pgid: int) -> list:
    """Live (non-zombie) processes of a process group, from /proc."""
    members = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return members
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read().decode("ascii", "replace")
        except OSError:
            continue
        rest = stat[stat.rfind(")") + 2:].split()
        # rest: state ppid pgrp ...
        if len(rest) >= 3 and rest[0] not in ("Z", "X") and int(rest[2]) == pgid:
            members.append(int(name))
    return members


class Executor:
    def __init__(self, cluster: "StandinCluster", session_id: str, node: str, slot: Optional[str], resreq: tuple):
        self.cluster = cluster
        self.store = cluster._store
        self.id = str(uuid.uuid4())
        self.node = node
        self.slot = slot
        self.resreq = resreq
        self.session_id: Optional[str] = session_id  # cleared when stuck/released (as the FSM does)
        self.bound_session_id = session_id  # kept for history
        self.state = "Binding"
        self.pid: Optional[int] = None
        self.proc: Optional[subprocess.Popen] = None
        self.returncode: Optional[int] = None
        self.socket_path = os.path.join(cluster._socket_dir, f"{self.id}.sock")
        self.process_dir: Optional[Path] = None
        self.app_dir: Optional[Path] = None
        self.auto_dir = False
        self.channel: Optional[grpc.Channel] = None
        self.stub: Optional[shim_pb2_grpc.InstanceStub] = None
        self.connected = False
        self.created_at = time.time()
        self.bound_at: Optional[float] = None
        self.released_at: Optional[float] = None
        self.bind_error: Optional[str] = None
        self.leave_error: Optional[str] = None
        self.stuck = False
        self.service_lost = False  # an invoke already failed because the service process was gone
        self.restart_requested = False  # restart_executor_manager()
        self.wedged: Optional[str] = None
        self.sigkill_needed = False
        self.tasks_run = 0
        self.current_task: Optional[int] = None
        self._kill_lock = threading.Lock()
        self._killed = False
        self.thread = threading.Thread(target=self._run, name=f"standin-exec-{self.id[:8]}", daemon=True)

    # ----------------------------------------------------------------- helpers
    @property
    def stopping(self) -> bool:
        return self.cluster._stop_event.is_set()

    def _set_state(self, state: str, **attrs) -> None:
        with self.store.cond:
            self.state = state
            for k, v in attrs.items():
                setattr(self, k, v)
            self.store.cond.notify_all()

    def start(self) -> None:
        self.thread.start()

    def info(self) -> dict:
        return {
            "id": self.id,
            "session_id": self.session_id if self.state != "Released" else None,
            "bound_session_id": self.bound_session_id,
            "state": self.state,
            "pid": self.pid,
            "slot": self.slot,
            "node": self.node,
            "returncode": self.returncode,
            "created_at": self.created_at,
            "bound_at": self.bound_at,
            "released_at": self.released_at,
            "tasks_run": self.tasks_run,
            "current_task": self.current_task,
            "bind_error": self.bind_error,
            "leave_error": self.leave_error,
            "stuck": self.stuck,
            "wedged": self.wedged,
            "sigkill_needed": self.sigkill_needed,
            "log_out": str(self.process_dir / f"{self.id}.out") if self.process_dir else None,
            "log_err": str(self.process_dir / f"{self.id}.err") if self.process_dir else None,
        }

    def proto_state(self) -> int:
        return {
            "Binding": types_pb2.ExecutorBinding,
            "Bound": types_pb2.ExecutorBound,
            "Unbinding": types_pb2.ExecutorUnbinding,
            "Released": types_pb2.ExecutorReleased,
        }[self.state]

    # -------------------------------------------------------------------- main
    def _run(self) -> None:
        try:
            if self._bind():
                self._set_state("Bound", bound_at=time.time())
                self._serve()
            self._unbind()
        except Exception:  # pragma: no cover - defensive
            log.exception("executor %s crashed", self.id)
        finally:
            self._release()

    # ----------------------------------------------------------------- binding
    def _bind(self) -> bool:
        c = self.cluster
        if c.bind_delay_s > 0 and c._stop_event.wait(c.bind_delay_s):
            return False
        with self.store.lock:
            ssn = self.store.sessions.get(self.session_id)
            if ssn is None or ssn.state == SESSION_CLOSED:
                return False  # wait_for_session() gives None: the executor is released
            app = self.store.apps.get(ssn.application)
            if app is None:
                return False
            app_name = app.name
            spec = types_pb2.ApplicationSpec()
            spec.CopyFrom(app.spec)
            common_data = ssn.common_data
        try:
            self._spawn(app_name, spec)
        except OSError as e:
            cmd = spec.command if spec.HasField("command") else ""
            self._bind_failed(
                BIND_RESULT_SHIM_CREATE_FAILED, f"shim creation failed: failed to start service by command <{cmd}>: {e}"
            )
            return False
        err = self._connect()
        if err is not None and self.stopping:
            return False  # teardown, not a bind failure
        if err is not None:
            self._bind_failed(BIND_RESULT_SHIM_CREATE_FAILED, f"shim creation failed: {err}")
            return False
        self.connected = True
        ctx = shim_pb2.SessionContext(
            session_id=self.session_id,
            application=shim_pb2.ApplicationContext(
                name=app_name,
                shim=spec.shim,
                image=spec.image if spec.HasField("image") else None,
                command=spec.command if spec.HasField("command") else None,
                working_directory=spec.working_directory if spec.HasField("working_directory") else None,
                url=spec.url if spec.HasField("url") else None,
                installer=spec.installer if spec.HasField("installer") else None,
            ),
            common_data=common_data,
        )
        try:
            res = self.stub.OnSessionEnter(ctx)  # no deadline, as the FEM
        except grpc.RpcError as e:
            self._bind_failed(BIND_RESULT_ON_SESSION_ENTER_FAILED, f"on_session_enter failed: {_details(e)}")
            return False
        if res.return_code != 0:
            self._bind_failed(BIND_RESULT_ON_SESSION_ENTER_FAILED, f"on_session_enter failed: {res.message}")
            return False
        return True

    def _bind_failed(self, code: int, detail: str) -> None:
        c = self.cluster
        log.warning("executor %s failed to bind session %s: %s", self.id, self.session_id, detail)
        with self.store.cond:
            self.bind_error = detail
            ssn = self.store.sessions.get(self.session_id)
            if ssn is not None:
                ssn.events.append(
                    EventRec(
                        SESSION_BIND_FAILED,
                        f"Executor <{self.id}> on node <{self.node}> failed to bind session with return_code "
                        f"<{code}>: {detail}",
                        now_ms(),
                    )
                )
                prev = ssn.retry_count
                ssn.retry_count += 1
                if prev < c.bind_retry_limit <= ssn.retry_count:
                    ssn.events.append(
                        EventRec(
                            SESSION_RETRY_LIMIT_REACHED,
                            f"Session retry limit reached after {ssn.retry_count}/{c.bind_retry_limit} failed "
                            "attempts; new executor assignment is paused for this session; existing executors "
                            "are unchanged.",
                            now_ms(),
                        )
                    )
            self.store.cond.notify_all()

    def _spawn(self, app_name: str, spec: types_pb2.ApplicationSpec) -> None:
        c = self.cluster
        if spec.HasField("working_directory") and spec.working_directory:
            top = Path(spec.working_directory)
            self.auto_dir = False
        else:
            top = c.workdir / self.id
            self.auto_dir = True
            top.mkdir(parents=True, exist_ok=True)
        work = top / "work"
        app_dir = work / app_name
        tmp_dir = app_dir / "tmp"
        tmp_dir.mkdir(parents=True, exist_ok=True)
        self.process_dir, self.app_dir = top, app_dir

        # The FEM's own environment: the stand-in's environment + `env` + the per-executor slot variables.
        base = dict(os.environ)
        base.update(c.env)
        if self.slot is not None:
            base["CUDA_VISIBLE_DEVICES"] = str(self.slot)
            base["FLAME_STANDIN_SLOT"] = str(self.slot)
        envs = {e.name: expand_strict(e.value, base) for e in spec.environments}
        level = base.get("RUST_LOG", "info")
        envs["RUST_LOG"] = level
        envs["FLAME_LOG"] = level
        envs["FLAME_INSTANCE_ENDPOINT"] = self.socket_path
        envs["FLAME_ENDPOINT"] = c.endpoint
        if "HOME" in base:
            envs.setdefault("HOME", base["HOME"])
        for k in ("TMPDIR", "TEMP", "TMP"):
            envs.setdefault(k, str(tmp_dir))
        context = dict(base)
        context.update(envs)
        command = expand_lenient(spec.command if spec.HasField("command") else "", context)
        args = [expand_lenient(a, context) for a in spec.arguments]
        full_env = dict(base)
        full_env.update(envs)

        out = open(top / f"{self.id}.out", "w+b")
        err = open(top / f"{self.id}.err", "w+b")
        try:
            kwargs = {"process_group": 0} if sys.version_info >= (3, 11) else {"start_new_session": True}
            self.proc = subprocess.Popen(
                [command, *args],
                cwd=str(top),
                env=full_env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                close_fds=True,
                **kwargs,
            )
        finally:
            out.close()
            err.close()
        with self.store.cond:
            self.pid = self.proc.pid
            self.store.cond.notify_all()
        log.info("executor %s spawned pid %s (slot %s): %s %s", self.id, self.pid, self.slot, command, args)

    def _connect(self) -> Optional[str]:
        c = self.cluster
        deadline = time.monotonic() + c.socket_timeout_s
        while not os.path.exists(self.socket_path):
            rc = self.proc.poll()
            if rc is not None:
                self.returncode = rc
                return (
                    f"service process exited with code {rc} before creating its socket <{self.socket_path}> "
                    "(stand-in only: the real FEM would wait for the socket forever)"
                )
            if self.stopping:
                return "cluster stopping"
            if time.monotonic() > deadline:
                return (
                    f"timed out after {c.socket_timeout_s}s waiting for socket <{self.socket_path}> "
                    "(stand-in only: the real FEM waits forever)"
                )
            time.sleep(0.02)
        self.channel = grpc.insecure_channel(
            "unix:" + self.socket_path,
            options=[
                # tonic defaults on the FEM side: 4 MiB decode, unlimited encode.
                ("grpc.max_receive_message_length", c.max_message_bytes),
                ("grpc.max_send_message_length", -1),
                ("grpc.initial_reconnect_backoff_ms", 100),
                ("grpc.min_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 1000),
                ("grpc.enable_retries", 0),
            ],
        )
        try:
            grpc.channel_ready_future(self.channel).result(timeout=10)
        except grpc.FutureTimeoutError:
            return f"failed to connect to service at <{self.socket_path}>"
        self.stub = shim_pb2_grpc.InstanceStub(self.channel)
        return None

    # ------------------------------------------------------------------- bound
    def _serve(self) -> None:
        c = self.cluster
        while not self.stopping:
            task = self._launch()
            if task is None:
                return
            with self.store.cond:
                self.current_task = task.id
            # LaunchTaskResponse{task: Task} is decoded by the FEM with the 4 MiB limit. If it does not fit,
            # the FEM retries forever and the task stays Running (the session can never be closed).
            with self.store.lock:
                launch_size = _field_len(task.to_proto().ByteSize())
            if launch_size > c.max_message_bytes:
                self.wedged = (
                    f"LaunchTaskResponse for task {task.id} is {launch_size} bytes > {c.max_message_bytes}: the real "
                    "FEM cannot decode it and retries forever; task stays Running"
                )
                log.error("executor %s wedged: %s", self.id, self.wedged)
                c._stop_event.wait()
                return
            while True:
                state, output, message = self._invoke(task)
                # CompleteTaskRequest{executor_id, task_result} is decoded by the session manager (4 MiB).
                tr = types_pb2.TaskResult(return_code=0 if state == SUCCEED else -1, output=output, message=message)
                complete_size = _field_len(len(self.id.encode())) + _field_len(tr.ByteSize())
                if complete_size <= c.max_message_bytes:
                    break
                # The FSM rejects CompleteTask; the FEM retries Bound, LaunchTask re-launches the same task,
                # so the service is invoked again, forever.
                self.wedged = (
                    f"CompleteTaskRequest for task {task.id} is {complete_size} bytes > {c.max_message_bytes}: "
                    "the real FEM re-invokes the same task forever"
                )
                log.error("executor %s: %s", self.id, self.wedged)
                if c._stop_event.wait(0.1):
                    return
            self.store.complete_task(task, state, output, message)
            with self.store.cond:
                self.current_task = None
                self.tasks_run += 1
            if self.proc is not None and self.proc.poll() is not None:
                self.returncode = self.proc.returncode

    def _launch(self) -> Optional[TaskRec]:
        store = self.store
        with store.cond:
            ssn = store.sessions.get(self.session_id)
            if ssn is None:
                return None
            app = store.apps.get(ssn.application)
            delay = max(0, app.delay_release if app is not None else 60)
            deadline = time.monotonic() + delay
            while True:
                if self.stopping:
                    return None
                ssn = store.sessions.get(self.session_id)
                if ssn is None:
                    return None
                t = store.pop_pending_task(self.session_id, self.id, self.node)
                if t is not None:
                    return t
                if ssn.state == SESSION_CLOSED:
                    return None
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                store.cond.wait(min(remaining, 1.0))

    def _invoke(self, task: TaskRec):
        ctx = shim_pb2.TaskContext(task_id=str(task.id), session_id=task.session_id, input=task.input)
        gone_before = self.service_lost or (self.proc is not None and self.proc.poll() is not None)
        try:
            r = self.stub.OnTaskInvoke(ctx)  # no deadline, as the FEM
        except grpc.RpcError as e:
            # The FEM turns the shim error into a Failed result carrying tonic's error text (checked with
            # the real binaries): the task running when the service died gets "transport error", every later
            # task on that executor "Connection refused (os error 111)". Python gRPC's own text for a later
            # call depends on when its channel noticed the dead socket ("Socket closed", "Connection reset",
            # "failed to connect"), so a call made after the loss is classified by that fact, not the text.
            message = _fem_invoke_error(e, gone_before=gone_before)
            if message in ("transport error", _REFUSED):
                self.service_lost = True
            return FAILED, None, message
        output = r.output if r.HasField("output") else None
        message = r.message if r.HasField("message") else None
        if r.return_code != 0:
            return FAILED, output, message
        return SUCCEED, output, message

    # --------------------------------------------------------------- unbinding
    def _unbind(self) -> None:
        c = self.cluster
        with self.store.cond:
            self.state = "Unbinding"
            self.store.cond.notify_all()
        if not self.connected or self.stopping:
            return
        while True:
            try:
                r = self.stub.OnSessionLeave(types_pb2.EmptyRequest())
                err = None if r.return_code == 0 else (r.message or f"return_code {r.return_code}")
            except grpc.RpcError as e:
                err = _details(e)
            if err is None:
                if self.stuck:
                    with self.store.cond:
                        self.stuck = False
                        self.store.cond.notify_all()
                return
            self.leave_error = err
            if c.leave_failure == "release":
                return
            if not self.stuck:
                log.error(
                    "executor %s: OnSessionLeave failed (%s); the real FEM retries Unbinding forever and leaves "
                    "the process alone -- so does the stand-in (leave_failure='stuck')",
                    self.id,
                    err,
                )
                with self.store.cond:
                    self.stuck = True
                    self.session_id = None  # the repeated UnbindExecutor clears it on the FSM side
                    self.store.cond.notify_all()
            if c._stop_event.wait(c.leave_retry_interval_s) or self.restart_requested:
                return  # stand-in stop, or restart_executor_manager(): what restarting the real FEM does

    # ---------------------------------------------------------------- release
    def terminate(self, grace: float) -> None:
        """SIGTERM the process group; SIGKILL whatever is left after ``grace`` seconds. Idempotent."""
        with self._kill_lock:
            if self.proc is None or self._killed:
                return
            self._killed = True
            pgid = self.proc.pid
            try:
                os.killpg(pgid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass
            deadline = time.monotonic() + grace
            while True:
                self.proc.poll()
                if self.proc.returncode is not None and not group_members(pgid):
                    break
                if time.monotonic() >= deadline:
                    if group_members(pgid) or self.proc.returncode is None:
                        self.sigkill_needed = True
                        log.warning("executor %s: process group %s survived SIGTERM for %.1fs; SIGKILL", self.id, pgid, grace)
                        try:
                            os.killpg(pgid, signal.SIGKILL)
                        except (ProcessLookupError, PermissionError):
                            pass
                    break
                time.sleep(0.05)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:  # pragma: no cover
                pass
            self.returncode = self.proc.returncode

    def _release(self) -> None:
        c = self.cluster
        if self.channel is not None:
            try:
                self.channel.close()
            except Exception:  # pragma: no cover
                pass
        self.terminate(c.kill_grace_s if not self.stopping else min(c.kill_grace_s, 2.0))
        try:
            os.unlink(self.socket_path)
        except OSError:
            pass
        if self.app_dir is not None:
            shutil.rmtree(self.app_dir, ignore_errors=True)
        if self.auto_dir and self.process_dir is not None and not c.keep_auto_dirs:
            shutil.rmtree(self.process_dir, ignore_errors=True)
        with self.store.cond:
            self.state = "Released"
            self.session_id = None
            self.current_task = None
            self.released_at = time.time()
            self.store.cond.notify_all()
        c._executor_released(self)


_REFUSED = "Connection refused (os error 111)"


def _fem_invoke_error(e: grpc.RpcError, gone_before: bool = False) -> str:
    """tonic's text for a failed OnTaskInvoke: ``_REFUSED`` when the service was already gone when the call
    was made (``gone_before``) or the connect failed, "transport error" when it died during the call, else
    gRPC's own details."""
    d = _details(e)
    if "Connection refused" in d or "failed to connect" in d or "No such file" in d:
        return _REFUSED
    try:
        unavailable = e.code() == grpc.StatusCode.UNAVAILABLE
    except Exception:  # pragma: no cover
        unavailable = False
    if not unavailable:
        return d
    return _REFUSED if gone_before else "transport error"


def _details(e: grpc.RpcError) -> str:
    try:
        d = e.details()
    except Exception:  # pragma: no cover
        d = None
    if not d:
        try:
            d = str(e.code())
        except Exception:  # pragma: no cover
            d = str(e)
    return d
