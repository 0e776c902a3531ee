"""``replica-loss``: one replica killed mid-trace; each system's outcome recorded (answered, failed,
re-routed, recovery time); nothing lost silently, and the run says what happened.

Algorithm (``sut.locality.failover``)
---------
1. **Kill.** In the timed burst of every case (not in the warm-ups), replica ``--kill-replica`` (0) is killed
   ``--kill-after`` (0.5) x the case's last warm-up wall time after the burst starts (``--kill-when time``, the
   default; never before the burst's first requests were sent: a kill before them would only find every request
   refused): mid-work on every system, whatever it does with answers; or earlier, once every request is routed
   and it has answered ``(1 + --kill-after) / 2`` of those routed to it and still holds some (a warm-up slowed
   by something else, e.g. another job on the host, would otherwise put the kill after the burst: on a shared
   2-core machine one warm-up took 21.8 s, the timed burst 3.9 s; the record's ``fired_by`` and the report say
   which fired). (``--kill-when answers``: once the
   replica has answered ``--kill-after`` of the requests routed to it. On one H100 this missed Flame: a Flame
   task returns its batch's answers together, so when half of them were back its engine had generated the
   rest, and the kill cost nothing.) ``SIGKILL`` to the engine process its
   own record names (standalone: the vLLM worker this harness started; Flame: the engine process of that
   replica's service). Both systems lose the same replica at the same point of the same trace.
2. **Detection** only as a client would see it: the system's transport reports the replica failed, or a
   request sent to it is refused. **Re-route**: the router marks the replica down (``Router.mark_down``:
   no later request goes there; ``prefix_affinity`` gives its documents new owners), and each request that
   was outstanding on it is sent again among the others, ``--retries`` times at most (1); else it fails.
3. **Settling.** The trace ends when every request is answered or failed: ``--loss-timeout-s`` (60) after
   the kill without any answer fails what is still outstanding (a system that stops serving altogether
   after one loss ends the trace that way, never with a hang).
4. **Record** (``failover`` of every case): the kill (replica, its answers and requests then, the burst's
   answers then, when, how), when the
   loss was detected and how (the transport's own words), counts of requests ``answered`` (by the replica
   first chosen), ``rerouted`` (answered by another after the loss) and ``failed`` (each with its reason),
   ``recovery_s`` (kill to the first re-routed answer), ``drained_s`` (to the last), late answers of the lost
   replica dropped. Every request has exactly one outcome, or the case fails. Throughput counts answered
   requests only; answered requests are validated like any other (input hash, length, replica that
   answered = the one routed to last), a failed one must have been answered empty with its reason.

What to expect: the standalone system's other engine keeps serving, so its requests are answered or
re-routed; Flame 0.6's transport halts on any fatal event of a session (``sut.flame.transport``), so its
re-routes are refused and the rest fails after the timeout: the record says which happened.

Knobs: ``--kill-after`` (0.5), ``--kill-when`` (time), ``--kill-replica`` (0), ``--retries`` (1),
``--loss-timeout-s`` (60); the
trace's. At least two replicas.

Shape on a GPU (preset): 32 news documents of ~8K tokens x 4 questions = 128 requests of 64 new tokens, one
shuffled burst; about 2 minutes a case on one H100/H200 with two engines (plus up to ``--loss-timeout-s``
for a system that stops serving).
"""

from __future__ import annotations

from typing import Optional, Sequence

from sut.engine.logs import without_log_pointer
from sut.errors import RunFailed

NAME = "replica-loss"
_TRACE = {"doc_tokens": 8192, "documents": 32, "questions": 4, "max_tokens": 64, "zipf_s": 0.0, "order": "shuffled",
          "text": "news"}
PRESET = {"trace": _TRACE, "run": {"rate": 0.0, "policies": ("prefix_affinity", "round_robin")},
          "routing": {"release_gate": "never"}, "workload": {"kill_after": 0.5}}


def kill_plan(ws, warmups: Sequence[dict] = ()) -> Optional[object]:
    """The ``failover.KillPlan`` of the settings (None: no kill). ``warmups``: the case's warm-up records
    (``wall_s`` each); with ``kill_when`` time the kill fires ``kill_after`` x the last one's wall time after
    the timed burst starts.

    Raises:
        RunFailed: a time trigger without a warm-up to time it by.
    """
    from sut.locality.failover import KillPlan

    if not ws.kill_after:
        return None
    at_s = None
    if ws.kill_when == "time":
        if not warmups:
            raise RunFailed("--kill-when time needs a warm-up burst to time the kill by (--warmups 1 or more)")
        at_s = ws.kill_after * float(warmups[-1]["wall_s"])
    return KillPlan(ws.kill_replica, ws.kill_after, ws.retries, ws.loss_timeout_s, at_s)


def kill_words(kill) -> str:
    """How the kill of ``kill`` (a ``KillPlan``) fires, for the console."""
    if kill.at_s is not None:
        return (f" (replica {kill.replica} killed {kill.at_s:.2f} s in: {kill.after:.0%} of the last warm-up's time, "
                f"or once it answered {(1 + kill.after) / 2:.0%} of its requests and holds some, if that comes first)")
    return f" (replica {kill.replica} killed once it answered {kill.after:.0%} of its requests)"


def check_killable(transport, replica: int) -> None:
    """Before a case's timed burst: ``RunFailed`` when its replica cannot be killed (no such replica, no pid
    and no ``kill_replica`` of the transport)."""

    if not 0 <= replica < transport.replicas:
        raise RunFailed(f"--kill-replica {replica}: the system has replicas 0..{transport.replicas - 1}")
    if callable(getattr(transport, "kill_replica", None)):
        return
    pid = (transport.records[replica].info or {}).get("pid")
    if not isinstance(pid, int) or pid <= 1:
        raise RunFailed(f"replica {replica} reported no engine pid: it cannot be killed")


def _s(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def _short(text: Optional[str], width: int = 100) -> str:
    """A reason for the table: its pointer to the engine log left out (the record keeps it), the first line, at
    most ``width`` characters ("..." when cut)."""
    t = without_log_pointer((text or "").partition("\n")[0])
    return t if len(t) <= width else t[:width - 3] + "..."


def report_lines(record: dict) -> list[str]:
    """Per case: the kill, its detection, the outcome counts, recovery times and the first failure reason."""
    lines = [f"{'pair':>4}  {'system':<11} {'policy':<22} {'killed at s':>11} {'detected s':>10} {'answered':>8} "
             f"{'rerouted':>8} {'failed':>6} {'recovery s':>10} {'drained s':>9}  how detected / first failure"]
    for c in record.get("cases", []):
        f = c.get("failover")
        if not f:
            continue
        why = next(iter((f.get("requests_failed") or {}).values()), None)
        lines.append(f"{c['pair']:>4}  {c['system']:<11} {c['policy']:<22} {_s(f['killed'].get('at_s')):>11} "
                     f"{_s(f.get('detected_after_s')):>10} {f['answered']:>8} {f['rerouted']:>8} {f['failed']:>6} "
                     f"{_s(f.get('recovery_s')):>10} {_s(f.get('drained_s')):>9}  "
                     f"{_short(f.get('detected_how')) or 'not detected'}" + (f" / {_short(why)}" if why else ""))
    return lines + _unmeasured(record.get("cases", []))


def _unmeasured(cases: Sequence[dict]) -> list[str]:
    """Notes on cases whose kill measured no loss: it never fired (the burst ended first), or it fired and
    nothing was lost (nothing re-routed or failed, whether or not its loss reached the harness: the replica had
    done its work, or had been sent no request yet)."""
    fo = [(c, c["failover"]) for c in cases if c.get("failover")]
    unfired = [c for c, f in fo if f["killed"].get("fired") is False]
    unfelt = [c for c, f in fo if f["killed"].get("fired") is not False and not f["rerouted"] and not f["failed"]]
    idle = [c for c in unfelt if c["failover"]["killed"].get("replica_routed") == 0]
    early = [c for c, f in fo if f["killed"].get("fired_by") == "answers" and f["killed"]["trigger"]["when"] == "time"]
    out = []
    if early:
        out.append(f"note: {len(early)} case(s) killed the replica when it had answered its share, before the kill "
                   f"time (the last warm-up was slower than the timed burst): "
                   f"{', '.join(sorted({c['system'] for c in early}))}")
    if unfired:
        out.append(f"note: {len(unfired)} case(s) ended before the kill time; they measure no loss "
                   f"({', '.join(sorted({c['system'] for c in unfired}))})")
    for which, when in ((idle, "before it was sent any request"),
                        ([c for c in unfelt if c not in idle], "after it had done its work")):
        if which:
            out.append(f"note: {len(which)} case(s) killed the replica {when} (nothing re-routed or failed): they "
                       f"measure no loss ({', '.join(sorted({c['system'] for c in which}))})")
    return out
