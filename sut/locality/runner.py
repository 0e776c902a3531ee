"""Drive engine replicas through a synthetic-locality trace with one routing policy, and measure.

One ``EnginePool`` (prefix caching ON, per-request detail results) serves every policy of a run:
before each policy the pool's prefix caches are emptied, so policies start equally cold and are
measured side by side on the same engines and the same trace.

Per policy the record has: wall time, output tokens/s, requests/s, TTFT and end-to-end latency
percentiles (engine-side, from ``add_request``), the engine-reported prefix-cache hit rate
(``cached prompt tokens / prompt tokens``) overall and per replica, requests and prompt tokens per
replica with their skew (max / mean), how many replicas served the hottest document, and the
router's own counters. Every request is answered exactly once or the run fails (``RunFailed``):
an engine death, an unknown or duplicate result, or no completion for ``stall_timeout_s``.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import logging
import math
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from sut.base import RunFailed
from sut.engine import EnginePool
from sut.locality import NOTICE, RUN_SUFFIX
from sut.core.routing import AffinitySettings, Router, make_router
from sut.locality.trace import TraceRequest

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LocalityRunSettings:
    """How a trace is replayed.

    Attributes:
        policies: routing policies measured in this order, each on an emptied prefix cache.
        rounds: repeat the policy list this many times, rotating its order each round.
        rate: arrivals per second (Poisson, seeded); 0 = every request at once.
        arrival_seed: seed of the arrival times.
        stall_timeout_s: fail if no request completes for this long while some are outstanding.
        output_dir: base folder; the run folder name ends in ``-SYNTHETIC-LOCALITY-NOT-MLPERF``.
        run_name: run folder name prefix (default: time + policies).
        progress: progress bar per policy.
        warmup_requests: before the first policy, this many requests of the trace (under other ids)
            go round-robin through the engines and the caches are emptied again, so the first
            policy does not pay for first-use costs (kernel compilation, allocator growth).
    """

    policies: tuple = ("round_robin", "least_loaded", "prefix_affinity")
    rounds: int = 1
    rate: float = 0.0
    arrival_seed: int = 0
    stall_timeout_s: float = 900.0
    output_dir: str = "results/locality"
    run_name: Optional[str] = None
    progress: bool = True
    warmup_requests: int = 8

    def __post_init__(self):
        if not self.policies:
            raise ValueError("at least one policy is needed")
        if len(set(self.policies)) != len(self.policies):
            raise ValueError(f"policies must be distinct (use --rounds to repeat them), got {list(self.policies)}")
        if self.rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {self.rounds}")
        if not (math.isfinite(self.rate) and self.rate >= 0):
            raise ValueError(f"rate must be a finite number >= 0 (arrivals/s; 0 = all at once), got {self.rate}")
        if not (math.isfinite(self.stall_timeout_s) and self.stall_timeout_s > 0):
            raise ValueError(f"stall_timeout_s must be a finite number > 0, got {self.stall_timeout_s}")
        if self.warmup_requests < 0:
            raise ValueError(f"warmup_requests must be >= 0, got {self.warmup_requests}")


def _pct(values: Sequence[float], q: float) -> Optional[float]:
    return round(float(np.percentile(values, q)), 4) if len(values) else None


class _Replay:
    """One policy over the trace: dispatch in arrival order, collect results exactly once."""

    def __init__(self, pool: EnginePool, trace: list[TraceRequest], router: Router, rs: LocalityRunSettings,
                 id_base: int):
        self.pool, self.trace, self.router, self.rs, self.id_base = pool, trace, router, rs, id_base
        self.lock = threading.Lock()
        self.pending: dict[int, int] = {}  # rid -> replica
        self.results: dict[int, tuple[int, int, dict]] = {}  # rid -> (replica, output tokens, info)
        self.fatal: Optional[str] = None
        self.all_done = threading.Event()
        self.last_progress = time.monotonic()
        self.bar = None

    def on_done(self, engine_index: int, payload: list) -> None:
        with self.lock:
            for item in payload:
                if len(item) != 3:
                    self.fatal = "engine results carry no detail (the pool must be started with detail=True)"
                    break
                rid, ids, info = item
                rep = self.pending.pop(rid, None)
                if rep is None:
                    self.fatal = f"result for request {rid} that is not outstanding (unknown or answered twice)"
                    break
                if rep != engine_index:
                    self.fatal = f"request {rid} was routed to replica {rep} but answered by engine {engine_index}"
                    break
                self.results[rid] = (rep, len(ids), info)
                self.router.done(rid)
                self.last_progress = time.monotonic()
                if self.bar is not None:
                    self.bar.update(1)
            if self.fatal or (not self.pending and len(self.results) == len(self.trace)):
                self.all_done.set()

    def on_fatal(self, msg: str) -> None:
        with self.lock:
            self.fatal = self.fatal or msg
        self.all_done.set()

    def run(self) -> dict:
        engines = self.pool.engines
        for e in engines:
            e.watch(self.on_done, self.on_fatal)
        if self.rs.progress:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=len(self.trace), desc=self.router.name, unit="req", leave=False)
            except ImportError:
                self.bar = None
        rng = np.random.default_rng(self.rs.arrival_seed)
        arrivals = (np.cumsum(rng.exponential(1.0 / self.rs.rate, size=len(self.trace)))
                    if self.rs.rate > 0 else np.zeros(len(self.trace)))
        t0 = time.monotonic()
        self.last_progress = t0
        # Stage 1: dispatch in arrival order.
        for req, at in zip(self.trace, arrivals):
            delay = t0 + at - time.monotonic()
            if delay > 0:
                if self.all_done.wait(delay):
                    break  # a fatal error ended the replay early
            rid = self.id_base + req.rid
            with self.lock:
                if self.fatal:
                    break
                r = self.router.route(rid, req.prompt)
                self.pending[rid] = r
            engines[r].submit([(rid, req.prompt)])
        # Stage 2: wait for every result.
        while not self.all_done.wait(1.0):
            if time.monotonic() - self.last_progress > self.rs.stall_timeout_s:
                with self.lock:
                    self.fatal = (f"no request finished for {self.rs.stall_timeout_s:.0f} s; "
                                  f"{len(self.pending)} outstanding")
                break
        wall = time.monotonic() - t0
        if self.bar is not None:
            self.bar.close()
        if self.fatal:
            raise RunFailed(f"{self.router.name}: {self.fatal}")
        return self._record(wall)

    def _record(self, wall: float) -> dict:
        n = len(self.pool)
        by_rid = {self.id_base + r.rid: r for r in self.trace}
        reqs = [0] * n
        prompt = [0] * n
        cached = [0] * n
        out_tokens = 0
        ttft, e2e = [], []
        hot_doc = Counter(r.document for r in self.trace).most_common(1)[0][0]
        hot_replicas = set()
        for rid, (rep, n_out, info) in self.results.items():
            req = by_rid[rid]
            reqs[rep] += 1
            prompt[rep] += len(req.prompt)
            cached[rep] += info["cached_tokens"]
            out_tokens += n_out
            ttft.append(info["ttft_s"])
            e2e.append(info["e2e_s"])
            if req.document == hot_doc:
                hot_replicas.add(rep)
        mean_req = sum(reqs) / n
        mean_tok = sum(prompt) / n
        return {
            "policy": self.router.name,
            "wall_s": round(wall, 3),
            "requests": len(self.results),
            "output_tokens": out_tokens,
            "output_tokens_per_s": round(out_tokens / wall, 2),
            "requests_per_s": round(len(self.results) / wall, 4),
            "prompt_tokens": sum(prompt),
            "cached_prompt_tokens": sum(cached),
            "cache_hit_rate": round(sum(cached) / max(1, sum(prompt)), 4),
            "ttft_s": {"p50": _pct(ttft, 50), "p90": _pct(ttft, 90), "p99": _pct(ttft, 99)},
            "e2e_s": {"p50": _pct(e2e, 50), "p99": _pct(e2e, 99)},
            "per_replica": [{"replica": i, "requests": reqs[i], "prompt_tokens": prompt[i], "cached_tokens": cached[i],
                             "cache_hit_rate": round(cached[i] / max(1, prompt[i]), 4)} for i in range(n)],
            "request_skew": round(max(reqs) / mean_req, 4) if mean_req else None,
            "prompt_token_skew": round(max(prompt) / mean_tok, 4) if mean_tok else None,
            "hot_document_replicas": len(hot_replicas),
            "router": self.router.stats(),
        }


def reset_prefix_caches(pool: EnginePool, timeout_s: float = 120.0) -> None:
    """Empty every engine's prefix cache (engines must be idle). Raises ``RunFailed`` if one refuses."""
    answers: dict[int, bool] = {}
    done = threading.Event()
    fatal: list[str] = []

    def on_stats(engine_index):
        def cb(payload):
            answers[engine_index] = bool(payload.get("reset_prefix_cache"))
            if len(answers) == len(pool.engines):
                done.set()
        return cb

    for e in pool.engines:
        e.watch(lambda *_: None, lambda msg: (fatal.append(msg), done.set()), on_stats(e.slot.index))
        e.reset_prefix_cache()
    if not done.wait(timeout_s) or fatal:
        raise RunFailed(f"prefix-cache reset did not finish: {fatal or 'timeout'}")
    refused = [i for i, ok in answers.items() if not ok]
    if refused:
        raise RunFailed(f"engine(s) {refused} refused to reset their prefix cache (requests still running?)")


def replay(pool: EnginePool, trace: list[TraceRequest], rs: LocalityRunSettings, max_tokens: int,
           affinity: AffinitySettings = AffinitySettings()) -> list[dict]:
    """Every policy of ``rs`` (x ``rounds``) over ``trace`` on the started ``pool``; one record each."""
    out = []
    k = 0
    if rs.warmup_requests:
        warm = trace[: rs.warmup_requests]
        log.info("warm-up: %d request(s) round-robin", len(warm))
        _Replay(pool, warm, make_router("round_robin", len(pool), max_tokens, affinity),
                dataclasses.replace(rs, rate=0.0, progress=False), id_base=900_000_000).run()
    for rnd in range(rs.rounds):
        order = list(rs.policies[rnd % len(rs.policies):]) + list(rs.policies[: rnd % len(rs.policies)])
        for name in order:
            reset_prefix_caches(pool)
            router = make_router(name, len(pool), max_tokens, affinity)
            log.info("round %d: %s over %d requests on %d replica(s)", rnd, name, len(trace), len(pool))
            rec = _Replay(pool, trace, router, rs, id_base=k * 10_000_000).run()
            rec["round"] = rnd
            log.info("  %s: %.1f output tok/s, cache hit rate %.3f, TTFT p50 %.3f s, request skew %.2f",
                     name, rec["output_tokens_per_s"], rec["cache_hit_rate"], rec["ttft_s"]["p50"] or 0,
                     rec["request_skew"] or 0)
            out.append(rec)
            k += 1
    return out


def summarize(records: list[dict]) -> dict:
    """Mean output tokens/s, hit rate and TTFT p50 per policy, and ratios to ``round_robin`` (or the first policy)."""
    by: dict[str, list[dict]] = {}
    for r in records:
        by.setdefault(r["policy"], []).append(r)
    summary = {}
    for name, rs in by.items():
        summary[name] = {"runs": len(rs),
                         "output_tokens_per_s": round(float(np.mean([r["output_tokens_per_s"] for r in rs])), 2),
                         "cache_hit_rate": round(float(np.mean([r["cache_hit_rate"] for r in rs])), 4),
                         "ttft_p50_s": round(float(np.mean([r["ttft_s"]["p50"] for r in rs])), 4)}
    base = "round_robin" if "round_robin" in summary else next(iter(summary))
    for name, s in summary.items():
        s["throughput_ratio_to_" + base] = round(s["output_tokens_per_s"] / summary[base]["output_tokens_per_s"], 4)
    return summary


def make_run_dir(rs: LocalityRunSettings) -> Path:
    """Create the run folder (name ends in ``-SYNTHETIC-LOCALITY-NOT-MLPERF``) before any engine starts.

    Raises ``FileExistsError`` for a folder that exists, ``OSError`` when it cannot be created.
    """
    name = rs.run_name or (_dt.datetime.now().strftime("%Y%m%d-%H%M%S") + "-" + "-".join(rs.policies))
    d = Path(rs.output_dir) / (name + RUN_SUFFIX)
    d.mkdir(parents=True, exist_ok=False)
    return d


def write_record(d: Path, record: dict) -> Path:
    """Write ``locality.json`` into the run folder ``d`` (from ``make_run_dir``)."""
    record = dict({"kind": "synthetic-locality", "mlperf": False, "notice": NOTICE}, **record)
    (d / "locality.json").write_text(json.dumps(record, indent=2, default=_json_default))
    return d


def _json_default(o):
    if dataclasses.is_dataclass(o):
        return dataclasses.asdict(o)
    if isinstance(o, (np.integer, np.floating)):
        return o.item()
    return str(o)


def kv_cache_summary(engines: Sequence[dict], shape: dict) -> dict:
    """``locality.json``'s ``kv_cache``: each replica's KV-cache capacity as vLLM reports it (tokens,
    blocks, block size; from the engines' read-back ``kv_cache``), the total, and the trace's distinct
    document tokens (``shape["document_tokens"]``) that the caches would need to hold at once."""
    unknown = {"blocks": None, "block_size": None, "tokens": None, "tokens_from": None}
    per = [dict({"replica": e.get("engine")}, **(e.get("kv_cache") or unknown)) for e in engines]
    known = [p["tokens"] for p in per if p.get("tokens") is not None]
    return {"per_replica": per, "tokens_total": sum(known) if len(known) == len(per) else None,
            "trace_document_tokens": shape.get("document_tokens")}
