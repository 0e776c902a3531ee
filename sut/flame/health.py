"""Executor health during a Flame run: fail the run when the executors of a replica session are lost.

Flame v0.6.0 never fails a task whose executor manager has died. Measured on the real control plane (one
host, ``tests/test_flame_real.py``): after SIGKILL of the executor manager the session manager still lists
the session's executors as Bound for ~30 s (its heartbeat timeout), then the node NotReady and no executor
of the session; the session's Running tasks stay Running for good (their watch streams never end) and
``close_session`` is refused ("Cannot close session with running tasks") for good. Without this check a
run waited for its 30-min stall limit, and its stop for ``close_timeout_s`` (600 s).

``ExecutorHealth`` polls every ``FlameOptions.health_check_s`` (default 5 s) while the transport runs: a
replica with tasks in flight whose executors sat on a node that Flame now lists as NotReady, or for which
Flame lists no live executor (Idle/Binding/Bound/Unbinding) in two polls running, or whose session Flame no
longer lists in two polls running, is lost. The first loss is reported once through ``on_lost(replica,
message)`` (the transport's fatal event, which fails the run), and ``lost`` is set so that closing the session
does not wait for tasks that can never end. A poll that cannot reach the session manager does nothing: that
loss has its own checks (``sut.flame.session``, ``sut.flame.endpoint``).

A session manager that answers no listing within its deadline (``sut.flame.endpoint.RPC_TIMEOUT_S``: stopped or
hung; it still accepts connections, so nothing else notices) in :data:`UNANSWERED_POLLS` polls running while tasks
are in flight loses the first such replica, with that cause (found by a fault test: a SIGSTOPped session manager held
the run until its stall limit, then its stop for good).

A session can vanish while the session manager stays up: with storage ``none``, Flame v0.6.0 lets its
application be unregistered under it and drops the session (measured, ``tests/test_flame_real.py``). Its watch
streams then never end, its executor stays Bound to it (the session manager re-launches its task in a busy
loop), so neither the watches nor the executor listing show the loss: without the session check the run
waited for its stall limit.

A service process that dies while its executor waits for a task (a forwarder with nothing to do) fails no
task: the run completes on the other executors. Its executor stays Bound until the session closes, then
Unbinding for good (its ``OnSessionLeave`` cannot reach the dead process), and Flame v0.6.0 gives later
sessions no executor while it lasts (measured, ``tests/test_flame_real_cluster.py``). ``stuck_after_close``
finds that after the close: an executor of the run (``executors_of``, listed just before the close) still
Unbinding ``FlameOptions.unbind_wait_s`` (20 s) later fails the run, naming it and its node (a normal unbind
takes well under a second: ``OnSessionLeave`` only logs).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional, Sequence

from sut.flame.endpoint import RPC_TIMEOUT_S, no_answer
from sut.flame.session import LIVE_STATES, executor_state

log = logging.getLogger("sut.flame.transport")
#: Polls in a row with no live executor before a replica counts as lost (a single empty listing is no proof).
EMPTY_POLLS = 2
#: Polls in a row that the session manager left unanswered (a call past its deadline) before the run is lost.
UNANSWERED_POLLS = 2


class ExecutorHealth:
    """Polls Flame for ``sessions`` (``ReplicaSession``s) and their executors; ``inflight(replica)`` gives the
    replica's tasks in flight. ``start()`` / ``stop()``; ``lost`` holds the first loss's message (or None)."""

    def __init__(self, conn, sessions: Sequence, inflight: Callable[[int], int], interval_s: float,
                 on_lost: Callable[[int, str], None]):
        self.conn, self.sessions, self.inflight, self.interval_s = conn, list(sessions), inflight, interval_s
        self.on_lost = on_lost
        self.lost: Optional[str] = None
        self._stop = threading.Event()
        self._empty = [0] * len(self.sessions)
        self._unlisted = [0] * len(self.sessions)  # polls in a row in which Flame did not list the session
        self._unanswered = 0  # polls in a row whose listing got no answer within its deadline
        self._nodes: list[set] = [set() for _ in self.sessions]  # nodes where each replica's executors were seen
        self._thread = threading.Thread(target=self._loop, name="flame-health", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(5)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s) and self.lost is None:
            try:
                message = self.check()
            except Exception as e:  # noqa: BLE001 - a diagnostic poll must never end the run by itself
                log.debug("flame: executor health poll failed: %s", e)
                continue
            if message is not None:
                self.lost = message[1]
                self.on_lost(*message)

    def check(self) -> Optional[tuple[int, str]]:
        """One poll: ``(replica, message)`` for the first lost replica, else None."""
        try:
            executors = list(self.conn.list_executors())
            not_ready = _not_ready_nodes(self.conn.list_nodes())
            listed = {x.id for x in self.conn.list_sessions()}
        except Exception as e:  # noqa: BLE001 - an unreachable session manager is handled elsewhere
            return self._unanswered_poll(getattr(e, "message", None) or str(e))
        self._unanswered = 0
        for i, rs in enumerate(self.sessions):
            mine = [e for e in executors if e.status.session_id == rs.id]
            live = [e for e in mine if executor_state(e) in LIVE_STATES]
            self._nodes[i] |= {e.spec.node for e in mine if e.spec.node}
            n = self.inflight(rs.replica)
            if not n:
                self._empty[i] = self._unlisted[i] = 0
                continue
            self._unlisted[i] = 0 if rs.id in listed else self._unlisted[i] + 1
            if self._unlisted[i] >= EMPTY_POLLS:
                return rs.replica, (
                    f"session {rs.id} (replica {rs.replica}) is gone: Flame no longer lists it while {n} task(s) ran "
                    "(with storage none, Flame v0.6.0 drops a session whose application is unregistered); its tasks "
                    "can never finish")
            gone = sorted(self._nodes[i] & not_ready)
            self._empty[i] = 0 if live else self._empty[i] + 1
            if gone or self._empty[i] >= EMPTY_POLLS:
                return rs.replica, _executors_lost_message(rs, n, len(live), gone, not_ready)
        return None


    def _unanswered_poll(self, msg: str) -> Optional[tuple[int, str]]:
        """After a failed poll: ``(replica, message)`` once :data:`UNANSWERED_POLLS` in a row got no answer within
        their deadline while a replica had tasks in flight, else None (a refused connection counts nothing)."""
        busy = [(rs.replica, n) for rs in self.sessions if (n := self.inflight(rs.replica))]
        self._unanswered = self._unanswered + 1 if no_answer(msg) and busy else 0
        if self._unanswered < UNANSWERED_POLLS:
            return None
        replica, n = busy[0]
        return replica, (f"the Flame session manager answered none of {self._unanswered} polls in a row (each call "
                         f"waited {RPC_TIMEOUT_S:.0f} s) while {n} task(s) of replica {replica} ran: it is stopped or "
                         f"hung, so no task can be seen to end ({msg}); restart the cluster before the next run")


def _executors_lost_message(rs, n: int, live: int, gone: list, not_ready: set) -> str:
    where = f"node(s) {', '.join(gone)} NotReady" if gone else f"nodes NotReady: {', '.join(sorted(not_ready)) or 'none'}"
    return (f"Flame lost the executors of session {rs.id} (replica {rs.replica}) while {n} task(s) ran "
            f"({live} live executor(s) listed; {where}): the executor manager of their node stopped, "
            "and Flame v0.6.0 keeps such tasks Running for good: the session can never be closed, and a "
            "restarted executor manager gives it new executors, so restart the whole cluster (session manager "
            "included) before the next run (the service processes of the dead executor manager stop by "
            "themselves)")


def _not_ready_nodes(nodes) -> set:
    from flamepy.proto import types_pb2

    return {n.metadata.name for n in nodes if n.status.state == types_pb2.NodeState.Value("NotReady")}


def executors_of(conn, session_ids: Sequence[str]) -> dict[str, str]:
    """``{executor id: node}`` of the executors Flame lists for ``session_ids`` now ({} if it cannot be asked)."""
    try:
        listed = list(conn.list_executors())
    except Exception:  # noqa: BLE001 - diagnostics only
        return {}
    wanted = set(session_ids)
    return {e.metadata.id: e.spec.node for e in listed if e.status.session_id in wanted}


def stuck_after_close(conn, ours: dict[str, str], wait_s: float, poll_s: float = 0.5) -> Optional[str]:
    """After the run's sessions closed: the message when executors of ``ours`` (``executors_of``) are still
    Unbinding ``wait_s`` seconds on (their service died during the run), else None (also when Flame cannot be
    asked). Returns as soon as none of them is Bound or Unbinding: right after the close Flame may still list them
    Bound (a healthy one then goes Unbinding and is gone within ~0.5 s; seen 2026-12-02: the check ended at that
    first look and missed a dead service's executor in ~3 of 10 runs)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            listed = list(conn.list_executors())
        except Exception:  # noqa: BLE001 - the close itself worked; nothing to tell
            return None
        stuck = {e.metadata.id: (ours[e.metadata.id], executor_state(e)) for e in listed
                 if e.metadata.id in ours and executor_state(e) in ("Bound", "Unbinding")}
        if not stuck:
            return None
        if time.monotonic() >= deadline:
            nodes = ", ".join(sorted({n or "?" for n, _ in stuck.values()}))
            states = " or ".join(sorted({st for _, st in stuck.values()}))
            return (f"{len(stuck)} executor(s) of this run ({', '.join(sorted(stuck)[:4])}) are still {states} "
                    f"{wait_s:.0f} s after the close: their service process died during the run (its tasks were "
                    "done by other executors), and Flame v0.6.0 never finishes such an unbind and gives later sessions "
                    f"no executor while it lasts; restart the executor manager of node(s) {nodes} before the next run")
        time.sleep(poll_s)


def release_survivors(rs, wait_s: float, poll_s: float = 0.2) -> dict:
    """Ask the live executors of ``rs`` (a ``ReplicaSession`` whose close Flame refuses for good: tasks of a lost
    node stay Running) to end their service processes: ``leave`` pings (``sut.flame.payload.LEAVE``), one per
    executor not yet answered, sent again while some remain, for at most ``wait_s`` seconds. Flame v0.6.0 keeps
    such a session Open and its executors on the surviving nodes Bound, so without this their services (and
    engines) lived until the cluster restarted. Returns ``{"released": [executor ids that answered], "left":
    [executor ids Flame still lists live that did not], "seconds": s}``; never raises."""
    from sut.flame import payload as pl

    t0 = time.monotonic()
    released: set = set()
    sent: list = []
    live: set = set()
    while True:
        try:
            live = {e.metadata.id for e in rs.conn.list_executors()
                    if e.status.session_id == rs.id and executor_state(e) in ("Bound", "Binding")}
            if not live - released or time.monotonic() - t0 >= wait_s:
                break
            if not sent:
                sent = [rs.create_task(pl.encode_ping(0, {pl.LEAVE: True}).data) for _ in live - released]
            sent = [t for t in sent if not _answered(rs, t, released)]
        except Exception as e:  # noqa: BLE001 - best effort: the run has failed already
            log.warning("flame: asking the executors of session %s to leave failed: %s", rs.id, e)
            break
        time.sleep(poll_s)
    out = {"released": sorted(released), "left": sorted(live - released), "seconds": round(time.monotonic() - t0, 3)}
    log.info("flame: session %s: %d service(s) asked to leave and ended, %d left", rs.id, len(released), len(out["left"]))
    return out


def _answered(rs, task_id: str, released: set) -> bool:
    """True once ``task_id`` (a leave ping) has ended; a service that answered goes into ``released``."""
    from sut.flame import payload as pl

    try:
        t = rs.session.get_task(task_id)
    except ValueError:  # Cancelled (flamepy 0.6.0 cannot parse state 4)
        return True
    state = int(t.state)
    if state == 2 and t.output:  # Succeed
        ident = (pl.decode_result(t.output).meta or {}).get("executor") or {}
        if ident.get("id"):
            released.add(ident["id"])
    return state in (2, 3)

