"""Warm-up of one replica session: PING tasks until every executor of the session has answered.

Flame gives a session its executors one by one, and a tiny task can be eaten by the first one, so
PING tasks (``sut.flame.payload.encode_ping``, each held ``warmup_hold_ms`` by the service) are kept
pending until ``need`` distinct executors have answered; each answer names the executor, its engine
shard (slot, GPU UUID) and the engine's read-back record. The start fails at once on a bind failure
that Flame cannot retry (``ReplicaSession.check_bind_failures``), on a ping that does not succeed, and
on a stall: fewer executors than needed and no new one from Flame for ``warmup_stall_s`` (e.g. a dead
service's executor stuck in Unbinding, which in Flame v0.6.0 keeps every new session from getting
executors). What the warm-up waits for is logged every ``warmup_log_s``.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
import time
from pathlib import Path
from typing import Optional

from sut.errors import RunFailed
from sut.flame import payload as pl
from sut.flame.endpoint import lost_cause
from sut.flame.session import LOST, SUCCEED, ReplicaSession

log = logging.getLogger("sut.flame.transport")

PING_BATCH_BASE = 1 << 40


@dataclasses.dataclass
class _Progress:
    """Executors Flame listed for the session and executors that answered, and when either last grew."""

    t0: float
    need: int
    listed: int = 0
    answered: int = 0
    progress_t: float = 0.0
    log_t: float = 0.0

    def __post_init__(self):
        self.progress_t = self.log_t = self.t0


class Warmup:
    """Warm up ``rs`` until ``need`` executors answered; ``on_answer(meta)`` sees each new executor's
    PING result meta (``executor``, ``shard``, ``engine``). ``run`` returns the record and raises ``RunFailed``,
    also soon after ``abort`` is set (another replica's warm-up failed)."""

    def __init__(self, rs: ReplicaSession, need: int, on_answer, abort: Optional[threading.Event] = None,
                 service_log_dir: Optional[str] = None, run_sessions: frozenset = frozenset()):
        self.rs, self.need, self.on_answer = rs, need, on_answer
        self.run_sessions = run_sessions | {rs.id}  # this run's sessions: their executors are no competition
        self.service_log_dir = service_log_dir  # where this host's services log (slot waits show there)
        self.abort = abort or threading.Event()
        self.o = rs.o
        self.seen: dict[str, dict] = {}
        self.pending: dict[str, threading.Thread] = {}
        self.results: dict[str, tuple] = {}
        self.lock = threading.Lock()
        self.pings = 0

    def run(self) -> dict:
        t0 = time.monotonic()
        deadline = t0 + self.o.warmup_timeout_s
        progress = _Progress(t0, self.need)
        last_check = 0.0
        while len(self.seen) < self.need:
            while len(self.pending) < self.need:
                self._ping()
            if self.abort.wait(0.05):
                raise RunFailed(f"warm-up of replica {self.rs.replica} stopped: another replica failed")
            self._collect()
            now = time.monotonic()
            if now - last_check > 1.0:
                last_check = now
                self.rs.check_bind_failures()
                self._progress(progress, now)
            if now > deadline:
                raise RunFailed(f"only {len(self.seen)} of {self.need} Flame executors answered within "
                                f"{self.o.warmup_timeout_s:.0f} s (session {self.rs.id}, replica {self.rs.replica})"
                                f"{self._held_elsewhere()}; check the cluster's capacity, the session's max_instances "
                                "and the service logs (<working_directory>/<executor id>.err)")
        for th in list(self.pending.values()):  # let the last pings finish: no warm-up task is left behind
            th.join(max(1.0, deadline - time.monotonic()))
        rec = {"executors": len(self.seen), "pings": self.pings, "seconds": round(time.monotonic() - t0, 3),
               "bind_failures_retried": list(self.rs.bind_warnings)}
        log.info("flame: replica %d: %d executor(s) of session %s ready after %.1f s", self.rs.replica, len(self.seen),
                 self.rs.id, rec["seconds"])
        return rec

    def _ping(self) -> None:
        enc = pl.encode_ping(PING_BATCH_BASE + self.pings, meta={"hold_ms": self.o.warmup_hold_ms})
        self.pings += 1
        try:
            tid = self.rs.create_task(enc.data)
        except Exception as e:  # noqa: BLE001
            raise RunFailed(f"warm-up: cannot create a task in session {self.rs.id}: {e}") from None

        def watch() -> None:
            res = self.rs.await_terminal(tid)
            with self.lock:
                self.results[tid] = res

        th = threading.Thread(target=watch, name=f"flame-ping-{self.rs.replica}-{tid}", daemon=True)
        self.pending[tid] = th
        th.start()

    def _collect(self) -> None:
        with self.lock:
            done = [(tid, self.results.pop(tid)) for tid in list(self.results)]
        for tid, (state, out, msg) in done:
            self.pending.pop(tid, None)
            if state != SUCCEED:
                raise RunFailed(f"warm-up task {tid} of session {self.rs.id} {state}: "
                                f"{lost_cause(self.rs.endpoint, msg, self.rs.id) if state == LOST else msg}")
            meta = self._answer_meta(tid, out)
            ex = meta.get("executor") or {}
            key = f"{ex.get('node')}/{ex.get('id')}"
            if key in self.seen:
                continue
            self.seen[key] = ex
            self.on_answer(meta)
            sh = meta.get("shard") or {}
            log.info("flame: replica %d: executor %d/%d up: %s pid %s (%s, seat %s) -> shard %s on %s (%s)",
                     self.rs.replica, len(self.seen), self.need, ex.get("id"), ex.get("pid"), ex.get("role"),
                     ex.get("seat"), sh.get("key"), sh.get("node") or ex.get("node") or "an unnamed node",
                     sh.get("gpu_uuid") or sh.get("device_name"))

    def _answer_meta(self, tid: str, out: Optional[bytes]) -> dict:
        """The meta of warm-up task ``tid``'s answer ``out``; ``RunFailed`` naming the task when it is unreadable."""
        why = None
        try:
            meta = pl.decode_result(out).meta
        except pl.PayloadError as e:
            why = str(e)
        else:
            if not isinstance(meta, dict):
                why = f"its meta is a {type(meta).__name__}, not an object"
        if why:
            raise RunFailed(f"warm-up task {tid} of session {self.rs.id} returned an unreadable answer: {why}")
        return meta

    def _progress(self, w: _Progress, now: float) -> None:
        """Log what the warm-up waits for every ``warmup_log_s``; ``RunFailed`` when Flame has not given the
        session a new executor for ``warmup_stall_s`` while it has fewer than needed."""
        o, rs, answered = self.o, self.rs, len(self.seen)
        got = rs.executors()
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
                     "(replica %d: %s)%s; %d ping task(s) so far%s", now - w.t0, answered, w.need, n_ours, rs.id,
                     rs.replica, states, f", {len(stuck)} stuck in Unbinding without a session" if stuck else "",
                     self.pings, slot_wait_note(self.service_log_dir, o.slot_wait_s))
        if n_ours < w.need and now - w.progress_t > o.warmup_stall_s:
            msg = (f"warm-up: only {answered} of {w.need} Flame executors answered, and Flame has given session "
                   f"{rs.id} {n_ours} executor(s) ({states}), none new for {o.warmup_stall_s:.0f} s")
            held = self._held_elsewhere()
            msg += held
            if stuck:
                msg += (f"; the cluster has {len(stuck)} executor(s) stuck in Unbinding without a session "
                        f"({', '.join(i for i, _ in stuck[:4])}): in Flame v0.6.0 an executor whose service died stays "
                        "Unbinding for good, and Flame gives new sessions no executor while it exists -- restart the "
                        "executor manager")
            elif held:  # other sessions hold the executors: the capacity advice below would not help
                raise RunFailed(msg)
            elif n_ours:
                msg += (f"; check the cluster's capacity (executor managers, their resources) and the session's resreq: "
                        f"if the cluster holds no more, ask for what it gave with --option executors_per_engine={n_ours} "
                        f"(the session asks for {w.need}; by default ceil(engine_fill x max_num_seqs / batch_size) + "
                        "executor_slack per engine: a small --batch-size asks for many), or go on with those it has: "
                        f"--option min_executors={n_ours}")
            else:
                msg += ("; check the cluster's capacity (executor managers, their resources), the session's resreq and "
                        "max_instances, and the service logs")
            raise RunFailed(msg)

    def _held_elsewhere(self) -> str:
        """``"; ... held by other open sessions ..."`` naming the sessions (not this run's) that hold executors."""
        others = self.rs.other_sessions(frozenset(self.run_sessions))
        if not others:
            return ""
        named = ", ".join(f"{sid} ({n})" for sid, n in sorted(others.items(), key=lambda kv: -kv[1])[:4])
        return (f"; {sum(others.values())} executor(s) are held by other open session(s): {named} -- another run "
                "using this cluster, or one killed without its stop (SIGKILL, OOM), which leaves its session open: "
                "close that with `python -m sut.flame close SESSION_ID --endpoint ...`, or restart the cluster (a session whose "
                "executor manager died mid-run can only go that way)")


#: What a service logs while it waits for an engine slot held by another session (``sut.flame.service``).
_SLOT_WAIT = re.compile(r"slot (\S+) is held by another session's engine host")


def slot_wait_note(log_dir: Optional[str], slot_wait_s: float, recent_s: float = 30.0) -> str:
    """``"; ... wait for engine slot KEY ..."`` when a service log in ``log_dir`` (this host's services, written
    within ``recent_s`` seconds) says it waits for a slot held by another session's engine host, else ``""``."""
    if not log_dir:
        return ""
    now, keys = time.time(), set()
    try:
        logs = [p for p in Path(log_dir).glob("*.log") if now - p.stat().st_mtime <= recent_s]
        for p in logs:
            with open(p, "rb") as f:
                f.seek(max(0, p.stat().st_size - 8192))
                keys |= set(_SLOT_WAIT.findall(f.read().decode("utf-8", "replace")))
    except OSError:
        return ""
    if not keys:
        return ""
    return (f"; services wait for engine slot(s) {', '.join(sorted(keys))} held by another session's engine host "
            f"(a run stopping, or another run on this host; at most slot_wait_s, {slot_wait_s:.0f} s)")
