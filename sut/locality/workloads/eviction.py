"""``eviction``: a working set 2-4x one replica's KV-cache capacity: cached share and throughput per policy.

Algorithm
---------
1. **Capacity.** One replica's KV-cache tokens: ``--kv-tokens`` if given; else the first system's replicas
   are started once (fresh, not timed; logs in ``RUN/kv-probe/``) and each reports the KV cache vLLM
   allocated (blocks x block size, ``sut.engine.readback.kv_cache_capacity``); the smallest counts. The
   replicas are stopped before the pairs. ``--kv-blocks N`` fixes every engine's blocks (vLLM
   ``num_gpu_blocks_override``), so the capacity is the same on any card and small enough for a CPU.
2. **Sizing.** ``documents = ceil(working_set x kv_tokens / (doc_tokens + 1))`` (``--working-set``, default
   3: within the 2-4x asked; BOS + document per prefix), so the distinct document tokens are about
   ``working_set`` times one replica's cache and ``working_set / replicas`` times the replicas' caches
   together: no replica can hold its share of the documents under any policy. Questions arrive
   shuffled (the study's order), so the reuse distances spread from next to the whole trace: a repeat
   finds its document only if the replica's cache kept it that long (``--order round_robin`` makes every
   repeat wait for the whole working set: the worst case).
3. **Record.** ``workload.working_set``: the capacity and where it came from, the documents, the trace's
   distinct document tokens and their ratio to one replica's cache; per case the KV tokens every replica
   reported and the ratio on them (a replica that reports another capacity than the sizing's is noted).
   Metrics: cached share from the engines' counts next to the router's expected share (an estimating
   router expects hits the engine has evicted), requests/s, TTFT p50 / p99.

Knobs: ``--working-set`` (3), ``--kv-tokens`` (0 = read from the engines), ``--kv-blocks`` (0 = what memory
allows); the trace's (``--questions`` 2).

Shape on a GPU: with ``--kv-blocks 4096`` (65,536 tokens a replica at vLLM's 16-token GPU blocks) 3x is 24
news documents of ~8K tokens x 2 questions = 48 requests of 16 new tokens, one burst; about 2 minutes a
case on one H100/H200 with two engines.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Optional, Sequence

NAME = "eviction"
_TRACE = {"doc_tokens": 8192, "documents": 32, "questions": 2, "max_tokens": 16, "zipf_s": 0.0,
          "order": "shuffled", "text": "news"}
PRESET = {"trace": _TRACE, "run": {"rate": 0.0, "policies": ("prefix_affinity", "round_robin")},
          "routing": {"release_gate": "never"}, "workload": {"working_set": 3.0}}


def size_documents(ts, working_set: float, kv_tokens: int):
    """Step 2: ``ts`` with its documents count sized (``ValueError`` for a capacity < 1 token)."""
    if kv_tokens < 1:
        raise ValueError(f"eviction: one replica's KV cache must be >= 1 token to size against, got {kv_tokens}")
    return replace(ts, documents=max(1, math.ceil(working_set * kv_tokens / (ts.doc_tokens + 1))))


def sizing_record(working_set: float, kv_tokens: int, source: str, shape: dict, probe: Optional[dict] = None) -> dict:
    """Step 3's run-level record from the sized trace's shape."""
    doc = shape.get("document_tokens") or 0
    return {"factor": working_set, "replica_kv_tokens": kv_tokens, "kv_tokens_from": source,
            "documents": shape.get("documents"), "document_tokens": doc, "ratio": round(doc / kv_tokens, 4),
            **({"probe": probe} if probe else {})}


def replica_kv_tokens(infos: Sequence[dict]) -> list:
    """Each replica's KV-cache tokens from its read-back record (None: not reported)."""
    return [((i or {}).get("kv_cache") or {}).get("tokens") for i in infos]


def probe(system, ctx, kv_sizing: str = "each-case") -> tuple[int, dict]:
    """Step 1: start ``system``'s replicas once, read their KV-cache tokens, stop them. Returns the smallest
    and the probe's record. With ``kv_sizing`` ``first-case`` (``PairSettings``) and fresh engines the probe is
    the run's first start: every case's engines get its KV cache (``ctx.kv``, ``sut.locality.kv_pin``), so
    the trace is sized for the cache every case has. ``RunFailed`` when they cannot start or report no capacity."""
    from sut.core.transport import TransportSpec
    from sut.errors import EngineError, RunFailed
    from sut.locality.pairs import _children, _IdleSink, _stop
    from sut.locality.systems import build_transport

    d = ctx.run_dir / "kv-probe"
    d.mkdir(parents=True, exist_ok=True)
    spec = TransportSpec(engine=ctx.engine, generation=ctx.generation, log_dir=None if ctx.log_to_console else str(d),
                         run_dir=str(d))
    before, t0 = _children(), time.monotonic()
    t = build_transport(system, spec)
    try:
        infos = [r.info for r in t.start(_IdleSink())]
        tokens = replica_kv_tokens(infos)
        ctx.kv.decide(infos, "kv-probe", system.spec.fresh, kv_sizing)
    except (RunFailed, EngineError) as e:
        raise RunFailed(f"eviction: the KV-cache probe of system {system.name} failed: {e}") from None
    finally:
        cleanup = _stop(t, before)
    rec = {"system": system.name, "replica_kv_tokens": tokens, "start_s": round(time.monotonic() - t0, 3),
           "cleanup": cleanup}
    if not tokens or any(x is None for x in tokens):
        raise RunFailed(f"eviction: system {system.name}'s replicas reported no KV-cache size ({tokens}); pass "
                        "--kv-tokens")
    return min(tokens), rec


def case_record(infos: Sequence[dict], sizing: dict) -> dict:
    """Per case: each replica's reported KV tokens, the trace's ratio on the smallest, and a note when they
    differ from the sizing's capacity."""
    tokens = replica_kv_tokens(infos)
    known = [x for x in tokens if x]
    out = {"replica_kv_tokens": tokens,
           "ratio": round(sizing["document_tokens"] / min(known), 4) if known else None}
    if known and min(known) != sizing["replica_kv_tokens"]:
        out["note"] = (f"replicas report {min(known):,} KV tokens, the trace was sized for "
                       f"{sizing['replica_kv_tokens']:,}")
    return out


def report_lines(record: dict) -> list[str]:
    """The working set and, per case, the cached share (engines vs the router's expectation)."""
    ws = (record.get("workload") or {}).get("working_set") or {}
    lines = [f"eviction: {ws.get('documents')} documents, {ws.get('document_tokens'):,} distinct document tokens = "
             f"{ws.get('ratio')}x one replica's KV cache of {ws.get('replica_kv_tokens'):,} tokens "
             f"({ws.get('kv_tokens_from')}; asked {ws.get('factor')}x)" if ws else "eviction: not sized",
             f"{'pair':>4}  {'system':<11} {'policy':<22} {'cached':>7} {'router expected':>15} {'req/s':>8} "
             f"{'KV tokens per replica':>22} {'ratio':>6}"]
    for c in record.get("cases", []):
        t, w = c.get("timed"), c.get("working_set") or {}
        if not t:
            continue
        share = "-" if t.get("cached_share") is None else f"{t['cached_share']:.1%}"
        exp = "-" if t.get("router_cached_share") is None else f"{t['router_cached_share']:.1%}"
        kv = " ".join(f"{x:,}" if x else "-" for x in w.get("replica_kv_tokens") or [])
        lines.append(f"{c['pair']:>4}  {c['system']:<11} {c['policy']:<22} {share:>7} {exp:>15} "
                     f"{t['requests_per_s']:>8.3f} {kv:>22} {w.get('ratio', '-'):>6}")
        if w.get("note"):
            lines.append(f"      note: {w['note']}")
    return lines
