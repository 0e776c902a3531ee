"""Flame plumbing of the flame transport: register the application, one replica's session.

``ensure_app`` registers the application when it is missing (``register_app=if_missing``); the endpoint,
``connect`` and the control plane's reachability are ``sut.flame.endpoint``'s.
``ReplicaSession`` is one Flame session (replica r: ``min_instances = max_instances`` = its
executors, common data naming its engine slot): task creation, watching one task until it ends
(``await_terminal``: through the shared ``sut.flame.watch.AioWatcher``, else flamepy's synchronous
stream), the executors Flame lists for it, its bind failures, and ``close``, which retries while
Flame refuses because tasks are still Running (Flame 0.6 has no task cancel) until the session
manager has been unreachable for ``unreachable_timeout_s`` or ``close_timeout_s`` has passed.
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures as cf
import logging
import os
import time
from pathlib import Path
from typing import Callable, Optional

from sut.constants import REPO
from sut.errors import RunFailed
from sut.exits import stopped_again
from sut.flame.endpoint import no_answer, reachable
from sut.flame.options import FlameOptions

log = logging.getLogger("sut.flame.transport")

SESSION_BIND_FAILED = 1001
SESSION_RETRY_LIMIT_REACHED = 1002
SUCCEED, FAILED, CANCELLED, LOST = "succeed", "failed", "cancelled", "lost"
_ST_SUCCEED, _ST_FAILED, _ST_CANCELLED = 2, 3, 4  # flame.v1 TaskState on the wire


def ensure_app(conn, endpoint: str, o: FlameOptions, run_dir: Optional[str]) -> None:
    """Register application ``o.app`` unless it exists; ``RunFailed`` when it is missing and may not be registered."""
    import flamepy

    from sut.flame import app as app_mod

    try:
        found = conn.get_application(o.app)
    except flamepy.FlameError as e:
        raise RunFailed(f"cannot read application {o.app} from Flame at {endpoint}: {e.message}"
                        f"{backend_port_hint(e.message, 'failed to get application')}") from None
    if found is not None:
        _warn_if_other_service(found, o.app, endpoint)
        return
    if o.register_app == "never":
        raise RunFailed(f"application {o.app} is not registered at {endpoint}; register it first "
                        "(python -m sut.flame register, or flmctl register -f app.yaml)")
    workdir = o.app_workdir
    if workdir is None and run_dir:  # next to the run folders, not under the repository
        workdir = str(Path(run_dir).resolve().parent / "flame-service")
    doc = app_mod.render(workdir=workdir, name=o.app)
    try:
        app_mod.register(conn, doc)
    except flamepy.FlameError as e:
        raise RunFailed(f"cannot register application {o.app}: {e.message}") from None
    log.info("flame: registered application %s (%s %s)", o.app, doc["spec"]["command"], " ".join(doc["spec"]["arguments"]))


def _warn_if_other_service(found, name: str, endpoint: str) -> None:
    """Warn when the registered application ``name`` would not start this checkout's service: another command or
    arguments than ``python -m sut.flame register`` would register from here, or another repository first on its
    PYTHONPATH (e.g. a registration left from an older checkout). Only a warning: a wrapper script or another
    interpreter on the executor hosts can be right; the run uses the registration as it is."""
    from sut.flame import app as app_mod

    want = app_mod.render(name=name)["spec"]
    have_path = ((getattr(found, "environments", None) or {}).get("PYTHONPATH") or "").split(os.pathsep)[0]
    have = (getattr(found, "command", None), list(getattr(found, "arguments", None) or []), have_path)
    mine = (want["command"], [str(a) for a in want.get("arguments") or []], str(REPO))
    if have != mine:
        log.warning("flame: application %s at %s is registered as `%s %s` (PYTHONPATH starting %s); from this checkout "
                    "it would be `%s %s` (%s). The run uses the registration as it is: if it is stale, register again "
                    "(python -m sut.flame register --replace --endpoint %s --name %s) or use another application name",
                    name, endpoint, have[0], " ".join(have[1]), have[2] or "(none)", mine[0], " ".join(mine[1]),
                    mine[2], endpoint, name)


#: Executor states (flamepy ``ExecutorState`` names without the prefix) of an executor that holds or can still run
#: a session's tasks.
LIVE_STATES = frozenset({"Idle", "Binding", "Bound", "Unbinding"})


def backend_port_hint(message: Optional[str], generic: str) -> str:
    """A hint for a Flame error without a cause (``message`` empty or only ``generic``, flamepy's wording): the
    executor managers' backend port (frontend + 1) answers that way, so the endpoint may name the wrong port."""
    if (message or "").strip(": ") not in ("", generic):
        return ""
    return (" (no cause given: is that the session manager's frontend port? the executor managers' backend port, "
            "frontend + 1, answers so)")


def executor_state(executor) -> str:
    """An executor's state as Flame lists it (``list_executors``), without the prefix: ``Bound``, ``Void``, ..."""
    from flamepy.proto import types_pb2

    return types_pb2.ExecutorState.Name(executor.status.state).removeprefix("Executor")


def _is_cancelled_error(e: BaseException) -> bool:
    # flamepy 0.6.0 has no TaskState.CANCELLED: parsing state 4 raises ValueError("4 is not a valid
    # TaskState"), which watch_task wraps in FlameError(INTERNAL, "failed to watch task: ...").
    return "4 is not a valid TaskState" in str(e)


class ReplicaSession:
    """The Flame session of replica ``replica`` (see the module docstring). ``open`` raises ``RunFailed``."""

    def __init__(self, replica: int, conn, endpoint: str, o: FlameOptions, watcher=None):
        self.replica, self.conn, self.endpoint, self.o, self.watcher = replica, conn, endpoint, o, watcher
        self.session = None
        self.closed = False
        self.close_info: dict = {}
        self.bind_warnings: list[str] = []
        self.abandon_close: Optional[str] = None  # why closing must not wait for running tasks (lost executors)

    @property
    def id(self) -> Optional[str]:
        return self.session.id if self.session is not None else None

    def open(self, common_data: bytes, executors: int, session_id: Optional[str] = None) -> None:
        import flamepy

        o = self.o
        attrs = flamepy.SessionAttributes(
            application=o.app, id=session_id, common_data=common_data, min_instances=executors, max_instances=executors,
            resreq=flamepy.ResourceRequirement.from_string(o.resreq) if o.resreq else None)
        try:
            self.session = self.conn.create_session(attrs)
        except flamepy.FlameError as e:
            raise RunFailed(f"cannot create the Flame session of replica {self.replica} (application {o.app}): "
                            f"{e.message}") from None
        atexit.register(self._atexit_close)

    def create_task(self, data: bytes) -> str:
        return self.session.create_task(data).id

    # -- watching one task -------------------------------------------------------------------
    def await_terminal(self, task_id: str, on_running: Optional[Callable[[], None]] = None):
        """Watch one task until it ends: ``(state, output, failure message)``; states ``SUCCEED``,
        ``FAILED`` (message from ``get_task``'s events: watch messages carry none), ``CANCELLED``, ``LOST``."""
        import flamepy

        quiet_ends = errors = 0
        while True:
            try:
                state, output = self._watch_once(task_id, on_running)
            except Exception as e:  # noqa: BLE001 - RPC errors of either watch path
                errors += 1
                if errors > 3:
                    return LOST, None, f"watching task {task_id} failed {errors} times: {e}"
                time.sleep(0.5 * errors)
                state, output = None, None
            if state == _ST_SUCCEED:
                return SUCCEED, output, None
            if state == _ST_FAILED:
                return FAILED, None, self.failure_message(task_id)
            if state == _ST_CANCELLED:
                return CANCELLED, None, "task was cancelled (its session was closed)"
            # The stream ended without a terminal message: the task or its session may be gone.
            try:
                t = self.session.get_task(task_id)
            except ValueError as e:
                if _is_cancelled_error(e):
                    return CANCELLED, None, "task was cancelled (its session was closed)"
                return LOST, None, f"task {task_id}: {e}"
            except flamepy.FlameError as e:
                return LOST, None, f"task {task_id} of session {self.id} is gone: {e.message}"
            if t.state == flamepy.TaskState.SUCCEED:
                return SUCCEED, t.output, None
            if t.state == flamepy.TaskState.FAILED:
                return FAILED, None, self.failure_message(task_id, t)
            quiet_ends += 1
            if quiet_ends > 3:
                return LOST, None, f"the watch of task {task_id} keeps ending while the task is {t.state.name}"
            time.sleep(0.2)

    def _watch_once(self, task_id: str, on_running) -> tuple[Optional[int], Optional[bytes]]:
        """One WatchTask stream: ``(terminal state as int, output)``, or ``(None, None)`` if it ended without one."""
        import flamepy

        running = on_running or (lambda: None)
        if self.watcher is not None:
            try:
                return self.watcher.watch(self.id, task_id, running).result()
            except cf.CancelledError:  # the watcher closed: the transport stops
                return _ST_CANCELLED, None
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

    def failure_message(self, task_id: str, task=None) -> str:
        try:
            task = task or self.session.get_task(task_id)
        except Exception as e:  # noqa: BLE001
            return f"(failure message unavailable: {e})"
        msgs = [ev.message for ev in task.events if ev.code == 3 and ev.message]
        return msgs[-1] if msgs else "task failed without an error message"

    # -- what Flame says about the session -----------------------------------------------------
    def executors(self) -> Optional[tuple[collections.Counter, list]]:
        """``(states of this session's executors, [(id, state) of executors stuck in Unbinding without a
        session])`` as Flame lists them now; None if Flame cannot be asked."""
        try:
            listed = self.conn.list_executors()
        except Exception:  # noqa: BLE001 - diagnostics only
            return None
        ours, stuck = collections.Counter(), []
        for e in listed:
            state = executor_state(e)
            if e.status.session_id == self.id:
                ours[state] += 1
            elif state == "Unbinding" and not e.status.session_id:
                stuck.append((e.metadata.id, state))
        return ours, stuck

    def other_sessions(self, exclude: frozenset) -> dict[str, int]:
        """Sessions other than ``exclude`` (this run's) that hold live executors (Idle/Binding/Bound/Unbinding),
        with their counts: what keeps executors from this run, e.g. the session a killed run left open ({} when
        Flame cannot be asked)."""
        try:
            listed = self.conn.list_executors()
        except Exception:  # noqa: BLE001 - diagnostics only
            return {}
        held = collections.Counter(e.status.session_id for e in listed if e.status.session_id
                                   and e.status.session_id not in exclude
                                   and executor_state(e) in LIVE_STATES)
        return dict(held)

    def check_bind_failures(self) -> None:
        """``RunFailed`` on a bind failure that Flame's retries cannot fix: the service's own
        ``on_session_enter`` failed (the same on every executor), or the session's retry limit was reached.
        Other bind failures (the executor manager could not start or reach a service process) are retried
        by Flame with a new process, up to ``cluster.recovery.session.retry_limits``: logged once each."""
        try:
            ssn = self.conn.get_session(self.id)
        except Exception as e:  # noqa: BLE001
            raise RunFailed(f"warm-up: cannot read session {self.id} (replica {self.replica}): {e}") from None
        events = [ev for ev in (ssn.events or []) if ev.code in (SESSION_BIND_FAILED, SESSION_RETRY_LIMIT_REACHED)]
        fatal = [ev for ev in events if ev.code == SESSION_RETRY_LIMIT_REACHED or "on_session_enter" in (ev.message or "")]
        if fatal:
            first = next((ev for ev in events if "on_session_enter" in (ev.message or "")), fatal[0])
            why = first.message
            binds = [ev.message for ev in events if ev.code == SESSION_BIND_FAILED and ev.message]
            if first.code == SESSION_RETRY_LIMIT_REACHED and binds:  # say why the attempts failed, not only how many
                why += f" The last attempt failed with: {binds[-1]}"
            raise RunFailed(f"a Flame executor failed to enter session {self.id} (replica {self.replica}): {why}")
        for ev in events[len(self.bind_warnings):]:
            self.bind_warnings.append(ev.message)
            log.warning("flame: an executor failed to bind session %s (Flame retries it): %s", self.id, ev.message)

    def _exists(self) -> bool:
        try:
            return any(x.id == self.id for x in self.conn.list_sessions())
        except Exception:  # noqa: BLE001 - cannot tell: keep trying to close
            return True

    # -- close ---------------------------------------------------------------------------------
    def close(self) -> Optional[str]:
        """Close the session, retrying while Flame refuses (tasks Running). Returns None, or why it stays open."""
        import flamepy

        if self.closed or self.session is None:
            return None
        t0, attempts, unreachable_since, error = time.monotonic(), 0, None, None
        while True:
            attempts += 1
            try:
                self.conn.close_session(self.id)
                self.closed = True
                break
            except flamepy.FlameError as e:
                msg = e.message
            except Exception as e:  # noqa: BLE001
                msg = str(e)
            error, unreachable_since = self._close_refused(msg, t0, unreachable_since)
            if error:
                break
            if attempts == 1 or attempts % 20 == 0:
                log.info("flame: session %s not closed yet (%s); waiting for running tasks (Flame 0.6 cannot cancel "
                         "them; after a Ctrl-C, a second one leaves the session open)", self.id, msg)
            time.sleep(0.5)
        self.close_info = {"closed": self.closed, "attempts": attempts, "seconds": round(time.monotonic() - t0, 3)}
        if error:
            self.close_info["error"] = error
        try:
            atexit.unregister(self._atexit_close)
        except Exception:  # noqa: BLE001
            pass
        if self.closed:
            log.info("flame: session %s closed (%d attempt(s), %.1f s)", self.id, attempts, self.close_info["seconds"])
        else:
            log.error("flame: %s", error)
        return error

    def _close_refused(self, msg: str, t0: float, unreachable_since: Optional[float]):
        """``(error or None, unreachable_since)`` after a refused close: give up when the session manager has
        been unreachable (or answered no call within its deadline) too long, the session is gone, its executors are
        lost (``abandon_close``: their tasks stay Running, so Flame refuses for good), or ``close_timeout_s`` has
        passed."""
        o = self.o
        if self.abandon_close:
            return f"session {self.id} was not closed ({msg}): {self.abandon_close}", unreachable_since
        if stopped_again():
            return (f"session {self.id} was left open at a second stop signal ({msg}); its running tasks end on "
                    f"their own, then close it: python -m sut.flame close --endpoint {self.endpoint} {self.id}"), \
                unreachable_since
        if no_answer(msg) or not reachable(self.endpoint):  # a stopped or hung one accepts TCP, answers nothing
            unreachable_since = unreachable_since or time.monotonic()
            if time.monotonic() - unreachable_since >= o.unreachable_timeout_s:
                return (f"the Flame session manager at {self.endpoint} has been unreachable for "
                        f"{o.unreachable_timeout_s:.0f} s; session {self.id} was not closed: {msg}"), unreachable_since
        else:
            unreachable_since = None
            if not self._exists():
                return f"session {self.id} is gone (lost by Flame): {msg}", None
        if time.monotonic() - t0 > o.close_timeout_s:
            return f"session {self.id} could not be closed within {o.close_timeout_s:.0f} s: {msg}", unreachable_since
        return None, unreachable_since

    def _atexit_close(self) -> None:
        if self.session is not None and not self.closed:
            try:
                self.conn.close_session(self.id)
                self.closed = True
            except Exception:  # noqa: BLE001
                pass
