"""What the flame transport records for ``run.json``'s ``flame`` entry (thread-safe).

Per task: batch, replica, task id, attempts, executor, shard, and its times in seconds (``created_s``
since the first task; ``queue_s`` = total - the service's own time; ``exec_s`` the service's time,
``engine_s`` the engine's, ``running_seen_s`` until the watch saw Running, ``total_s`` create to
done) and payload bytes (raw and on the wire). Overall: batch-size distribution, bytes and
compression ratios, retries and failed attempts, peak tasks in flight, executors and engine shards
as the warm-up and the results name them, with their largest GC pauses.

Timed and untimed batches: ``mark_timed`` (a caller that sends warm-up requests over the started
transport, e.g. the locality runner's warm-up bursts) makes every batch made so far untimed. The
batch-size distribution, ``tasks`` (completed, times), ``per_task`` and each executor's ``tasks``
then count timed batches only; ``untimed`` counts the others (batches, their sizes, completed
tasks). The warm-up PING tasks are never batches: the transport reports them under ``warmup``.
Bytes, retries and failed attempts cover every task.
"""

from __future__ import annotations

import collections
import statistics
import threading
import time
from typing import Optional

from sut.flame import payload as pl


class FlameStats:
    """Counters and per-task records of one transport."""

    def __init__(self, record_tasks: bool = True):
        self.record_tasks = record_tasks
        self.lock = threading.Lock()
        self.task_log: list[dict] = []
        self.batch_sizes: dict[tuple[int, int], int] = {}  # (replica, batch id) -> requests in it
        self.untimed: set[tuple[int, int]] = set()  # batches made before the last mark_timed
        self.completed: list[tuple[tuple[int, int], str]] = []  # ((replica, batch id), executor key) per result
        self.bytes = {"in_raw": 0, "in_wire": 0, "out_raw": 0, "out_wire": 0}
        self.retries = 0
        self.failed_attempts: list[dict] = []
        self.executors: dict[str, dict] = {}
        self.shards: dict[str, dict] = {}
        self.engine_gc: dict[str, float] = {}
        self.t_first_task: Optional[float] = None
        self.inflight = 0
        self.peak_inflight = 0

    def note_batch(self, replica: int, batch_id: int, n: int) -> None:
        """Batch ``batch_id`` of ``replica`` (``n`` requests) goes out as a task."""
        with self.lock:
            self.batch_sizes[(replica, batch_id)] = n

    def mark_timed(self) -> None:
        """Every batch made so far was warm-up (not timed): from now on it counts under ``untimed``."""
        with self.lock:
            self.untimed.update(self.batch_sizes)

    def inflight_change(self, delta: int) -> None:
        """Tasks in flight over every replica go up or down by ``delta`` (the peak is recorded)."""
        with self.lock:
            self.inflight += delta
            self.peak_inflight = max(self.peak_inflight, self.inflight)

    def note_sent(self, raw: int, wire: int, t: float) -> None:
        with self.lock:
            self.bytes["in_raw"] += raw
            self.bytes["in_wire"] += wire
            if self.t_first_task is None:
                self.t_first_task = t

    def note_failure(self, replica: int, batch_id: int, task_id: str, attempt: int, message: str, retry: bool) -> None:
        with self.lock:
            self.failed_attempts.append({"replica": replica, "batch_id": batch_id, "task_id": task_id,
                                         "attempt": attempt, "message": message})
            self.retries += int(retry)

    def failed_task_ids(self, batch_id: int, replica: int) -> list[str]:
        with self.lock:
            return [e["task_id"] for e in self.failed_attempts if (e["batch_id"], e["replica"]) == (batch_id, replica)]

    def note_executor(self, ex: dict, shard: Optional[str]) -> None:
        key = f"{ex.get('node')}/{ex.get('id')}"
        with self.lock:
            e = self.executors.setdefault(key, {"id": ex.get("id"), "node": ex.get("node"), "pid": ex.get("pid"),
                                                "role": ex.get("role"), "seat": ex.get("seat"), "shard": shard})
            e["gc_max_pause_ms"] = max(e.get("gc_max_pause_ms") or 0.0, ex.get("gc_max_pause_ms") or 0.0)

    def note_ping(self, meta: dict) -> None:
        """A warm-up answer: its executor and its engine shard."""
        sh = meta.get("shard") or {}
        key = f"{sh.get('node')}/{sh.get('key')}"
        self.note_executor(meta.get("executor") or {}, key)
        with self.lock:
            if key not in self.shards:
                self.shards[key] = dict(sh, engine=meta.get("engine"))

    def shard(self, key: str) -> Optional[dict]:
        """Engine shard ``key`` (``node/slot key``) as the first warm-up answer that named it read it back (its
        ``replica``, ``engine`` record, ...), else None: no warm-up answer came from that engine."""
        with self.lock:
            return self.shards.get(key)

    def shards_of(self, replicas) -> list[tuple[str, dict]]:
        """``(key, shard)`` of every engine shard the warm-up read back for one of ``replicas``, in key order."""
        with self.lock:
            return [(k, sh) for k, sh in sorted(self.shards.items()) if sh.get("replica") in replicas]

    def note_result(self, replica: int, tb, res: pl.TaskResult) -> None:
        """A finished task ``tb`` (``sut.flame.tasks.Batch``) and its decoded result."""
        meta, t = res.meta, res.meta.get("t") or {}
        ex = meta.get("executor") or {}
        total = (tb.t_done or time.monotonic()) - tb.t_create
        exec_s = t.get("service_s")
        shard_key = f"{meta.get('node')}/{meta.get('shard')}"
        self.note_executor(ex, shard_key)
        with self.lock:
            self.completed.append(((replica, tb.batch_id), f"{ex.get('node')}/{ex.get('id')}"))
            if meta.get("engine_gc_max_pause_ms") is not None:
                self.engine_gc[shard_key] = max(self.engine_gc.get(shard_key, 0.0), meta["engine_gc_max_pause_ms"])
            self.bytes["out_raw"] += res.raw_bytes
            self.bytes["out_wire"] += res.wire_bytes
            if self.record_tasks:
                self.task_log.append({
                    "batch_id": tb.batch_id, "replica": replica, "task_id": tb.task_id, "n": len(tb.requests),
                    "attempts": tb.attempts, "executor": ex.get("id"), "pid": ex.get("pid"), "shard": shard_key,
                    "created_s": round(tb.t_create - (self.t_first_task or tb.t_create), 4),
                    "queue_s": round(total - exec_s, 4) if exec_s is not None else None,
                    "exec_s": exec_s, "engine_s": t.get("engine_s"),
                    "running_seen_s": round(tb.t_running - tb.t_create, 4) if tb.t_running else None,
                    "total_s": round(total, 4),
                    "in_raw": tb.raw_bytes, "in_wire": len(tb.data), "out_raw": res.raw_bytes, "out_wire": res.wire_bytes})

    def record(self) -> dict:
        """The counters as ``run.json`` keeps them (``tasks``, ``bytes``, ``shards``, ``executor_list``, ...)."""
        with self.lock:
            untimed = self.untimed
            tasks = [x for x in self.task_log if (x["replica"], x["batch_id"]) not in untimed]
            done = collections.Counter(ex for key, ex in self.completed if key not in untimed)
            sizes = [collections.Counter(n for key, n in self.batch_sizes.items() if (key in untimed) is u)
                     for u in (False, True)]
            return {
                "peak_inflight_tasks": self.peak_inflight,
                "batch_size_distribution": _distribution(sizes[0]),
                "untimed": {"batches": sum(sizes[1].values()), "batch_size_distribution": _distribution(sizes[1]),
                            "tasks_completed": len(self.completed) - sum(done.values())},
                "tasks": {"completed": sum(done.values()), "retries": self.retries,
                          "failed_attempts": list(self.failed_attempts),
                          **{k: summary([x[k] for x in tasks]) for k in ("queue_s", "exec_s", "engine_s", "total_s")}},
                "bytes": dict(self.bytes, in_ratio=_ratio(self.bytes["in_wire"], self.bytes["in_raw"]),
                              out_ratio=_ratio(self.bytes["out_wire"], self.bytes["out_raw"])),
                "shards": [dict({k: v for k, v in sh.items() if k != "engine"}, shard=key,
                                engine_gc_max_pause_ms=self.engine_gc.get(key))
                           for key, sh in sorted(self.shards.items())],
                "executor_list": sorted((dict(e, tasks=done[k]) for k, e in self.executors.items()),
                                        key=lambda e: (str(e["shard"]), e["seat"] or 0)),
                "per_task": tasks,
            }


def summary(values) -> dict:
    """``n``, mean and p50/p90/p99/max of the non-None values (rounded to 0.1 ms); {} when there are none."""
    v = sorted(x for x in values if x is not None)
    if not v:
        return {}
    pick = lambda q: v[min(len(v) - 1, int(round(q * (len(v) - 1))))]  # noqa: E731
    return {"n": len(v), "mean": round(statistics.fmean(v), 4), "p50": round(pick(0.5), 4), "p90": round(pick(0.9), 4),
            "p99": round(pick(0.99), 4), "max": round(v[-1], 4)}


def _distribution(sizes: collections.Counter) -> dict:
    """``{"<batch size>": batches}``, by size."""
    return {str(k): v for k, v in sorted(sizes.items())}


def _ratio(a: int, b: int) -> Optional[float]:
    return round(a / b, 4) if b else None
