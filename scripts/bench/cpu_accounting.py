"""CPU accounting of a benchmark script and its child processes, from ``/proc`` (Linux).

Used by ``scripts/bench/bench_flame.py``: which share of the machine each kind of our processes used
inside LoadGen's timed window (:func:`window_cpu`), how much CPU other users' jobs took during a
run (:func:`foreign_cpu_s`), and waiting for a shared machine to be idle (:func:`wait_idle`).
Times are ``utime + stime + cutime + cstime`` of ``/proc/<pid>/stat`` in seconds.
"""

from __future__ import annotations

import os
import time
from pathlib import Path


def cpu_times(pids=None) -> dict[int, tuple[int, float, float]]:
    """pid -> (parent pid, utime+stime+cutime+cstime seconds, utime+stime seconds) for every process, or for
    ``pids`` only (those still there: a cheap sample inside a timed window)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for name in (os.listdir("/proc") if pids is None else map(str, pids)):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_text()
        except OSError:
            continue
        rest = stat[stat.rfind(")") + 2:].split()
        out[int(name)] = (int(rest[1]), sum(int(x) for x in rest[11:15]) / tick, sum(int(x) for x in rest[11:13]) / tick)
    return out


def _ours(times: dict) -> set[int]:
    """This script and its descendants (the runs, the stand-in, the services, the engines)."""
    mine, changed = {os.getpid()}, True
    while changed:
        changed = False
        for pid, (ppid, *_) in times.items():
            if ppid in mine and pid not in mine:
                mine.add(pid)
                changed = True
    return mine


def foreign_cpu_s(before: dict, after: dict) -> float:
    """CPU seconds used by processes that are not ours between two snapshots (other users' jobs).

    A process's time includes its reaped children's, so a child that exits inside the window adds its
    whole life to its parent: what it had used before the window (its time in ``before``) is taken
    off again, or one long job of another user ending in the window reads as many times the machine.
    """
    ours = _ours(before) | _ours(after)
    grown = sum(v[1] - (before[pid][1] if pid in before else 0.0) for pid, v in after.items() if pid not in ours)
    ended = sum(v[1] for pid, v in before.items() if pid not in after and pid not in ours)
    return max(0.0, grown - ended)


#: (category, a substring of /proc/<pid>/cmdline); the first match wins. vLLM renames its own processes
#: (``vllm.utils.system_utils.set_process_title``: "VLLM::EngineCore", "VLLM::Worker..."), the harness its engine
#: workers ("sut-engine-N", sut/engine/worker.py).
_CATEGORIES = (("engine", "spawn_main"), ("engine", "sut-engine-"), ("engine", "VLLM::"), ("flame service", "sut.flame.serve"), ("flame stand-in", "tests.flame_standin"),
               ("flame control plane", "flame-session-manager"), ("flame control plane", "flame-executor-manager"),
               ("harness + client", "-m sut run"))


def _category(pid: int) -> str:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "other"
    for name, needle in _CATEGORIES:
        if needle in cmd:
            return name
    return "other"


def categories(times: dict) -> dict[int, str]:
    """pid -> category (``_CATEGORIES``) of our processes in a ``cpu_times`` snapshot, read now: at the window's
    start, while they run (an engine that exits at the window's end has no command line left to read then)."""
    return {pid: _category(pid) for pid in _ours(times) if pid != os.getpid()}


def window_cpu(before: dict, after: dict, seconds: float, cats: dict[int, str] | None = None) -> dict:
    """CPU share of the machine per process category inside the LoadGen window (ours only), from each process's
    own time (utime + stime: a child reaped inside the window would otherwise add its whole life to its parent).
    ``cats``: :func:`categories` of ``before``, taken when it was; missing pids are read now."""
    ours = _ours(after)
    cats = cats or {}
    out: dict = {}
    for pid, (_, _, own) in after.items():
        if pid in ours and pid in before and pid != os.getpid():
            cat = cats.get(pid) or _category(pid)
            out[cat] = out.get(cat, 0.0) + own - before[pid][2]
    total = seconds * (os.cpu_count() or 1)
    return {k: round(v / total, 4) for k, v in sorted(out.items())}


def proc_stat() -> list[int]:
    """The machine's CPU time counters (user nice system idle iowait irq softirq steal ...)."""
    return [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]


def wait_idle(max_wait_s: float, busy_threshold: float = 0.10) -> float:
    """Wait until the machine's CPUs are at most ``busy_threshold`` busy over 10 s; returns the last load."""
    deadline = time.monotonic() + max_wait_s
    while True:
        a = proc_stat()
        time.sleep(10)
        b = proc_stat()
        d = [y - x for x, y in zip(a, b)]
        busy = 1.0 - (d[3] + d[4]) / max(1, sum(d))
        if busy <= busy_threshold or time.monotonic() > deadline:
            return busy
        print(f"  machine {busy:.0%} busy (other jobs); waiting", flush=True)
