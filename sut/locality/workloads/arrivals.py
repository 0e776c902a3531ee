"""``arrivals``: Poisson arrivals at 50 %, 80 % and 95 % of the burst capacity measured on the same card;
per-request TTFT and TPOT p50 / p99 and goodput against stated targets, not only throughput.

Algorithm
---------
1. **Capacity.** ``--capacity`` requests/s if given; else one calibration case before the pairs: the first
   system with ``--capacity-policy`` (default ``round_robin``, the cache-blind baseline: "at 50/80/95 % of
   round-robin capacity", ``../shared/research/routing_anchors_2026-12.md``, targets 1), fresh engines, the
   warm-ups, then the trace as one burst; capacity = its requests/s. Recorded (``workload.capacity``, and
   the calibration case under ``workload.calibration``); it is the same for every system and policy, and it
   is in the run's header, so a run merged with another must have had the same (pass ``--capacity``).
2. **Levels.** Level ``i`` (``--load-levels``, increasing) sends its own copy of the trace at Poisson rate
   ``level x capacity`` (``--arrival-seed``): level 0 the measured trace itself, level ``i > 0`` the trace
   with ids shifted like a warm-up (``trace.shift_trace``: same lengths and prefix relations, no prefix of
   the trace, of a warm-up or of another level), so no level is served from an earlier level's cache.
3. **Per case** (fresh engines, the warm-ups as bursts): every level in increasing order, each through a
   fresh router and validated like any timed burst, its request ids from ``i x LEVEL_ID_STRIDE``.
4. **Metrics per level** (``sut.locality.latency``): TTFT from each request's arrival to its first token
   (client side, one host's clock) and TPOT, p50 / p90 / p99; goodput = requests with TTFT <=
   ``--ttft-target-s`` and TPOT <= ``--tpot-target-s`` per second of the level's wall time (defaults 5 s and
   0.1 s: Dynamo's gate in AIPerf's goodput, the anchors' section 2), and its share of the requests.
5. **Report.** One per-run record per case and level, its policy named ``POLICY@LEVEL%``: the pair report's
   medians and flame / standalone ratios are of ``goodput_per_s`` (the run's ``report_metric``), per
   level; the case's ``timed`` is its highest level's.

Knobs: ``--load-levels`` (0.5 0.8 0.95), ``--capacity`` (0 = measured), ``--capacity-policy``
(round_robin), ``--ttft-target-s`` (5), ``--tpot-target-s`` (0.1), ``--arrival-seed``; the trace's.

Shape on a GPU (preset): 32 news documents of ~8K tokens x 4 questions = 128 requests of 64 new tokens,
shuffled; on one H100/H200 with two engines a case is about 2.5 minutes (start ~1 min, two burst warm-ups,
three levels of 128 requests lasting 128 / (level x capacity) s each).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence

NAME = "arrivals"
#: Request ids of level ``i`` start at ``i x LEVEL_ID_STRIDE`` (below the warm-ups' ``sut.locality.pairs``
#: ``WARMUP_ID_STRIDE``; a trace holds at most ``trace.MAX_REQUESTS`` requests).
LEVEL_ID_STRIDE = 100_000
_TRACE = {"doc_tokens": 8192, "documents": 32, "questions": 4, "max_tokens": 64, "zipf_s": 0.0, "order": "shuffled",
          "text": "news"}
PRESET = {"trace": _TRACE, "run": {"rate": 0.0, "policies": ("prefix_affinity", "round_robin")},
          "routing": {"release_gate": "never"}, "workload": {"load_levels": (0.5, 0.8, 0.95)}}


@dataclass(frozen=True)
class Level:
    """One load level: ``level`` (fraction of capacity), ``rate`` (requests/s), its ``trace`` copy, the
    ``hashes`` validation compares against, the id ``shift`` (None: the measured trace) and ``first_id``."""

    level: float
    rate: float
    trace: Sequence
    hashes: Sequence[str]
    shift: Optional[int]
    first_id: int

    @property
    def label(self) -> str:
        return f"{self.level:.0%}"


def level_rate(level: float, capacity: float) -> float:
    """Level ``level``'s arrival rate at ``capacity`` requests/s, as recorded (4 decimals). ``ValueError`` when it
    rounds to 0: a rate of 0 sends every request at once (``burst``), which is no Poisson level."""
    rate = round(level * capacity, 4)
    if not rate > 0:
        raise ValueError(f"capacity {capacity:g} requests/s x load level {level:g} is below 0.0001 requests/s, the "
                         "resolution of the levels' rates (a rate of 0 would send the level as one burst)")
    return rate


def make_levels(prepared, levels: Sequence[float], capacity: float) -> list[Level]:
    """The levels of step 2 from the prepared trace (its ``extra`` shifted copies: one per level after the
    first) and the capacity (requests/s > 0, every level's rate > 0: ``level_rate``; ``ValueError`` otherwise)."""
    if not capacity > 0:
        raise ValueError(f"arrivals need a burst capacity > 0 requests/s, got {capacity}")
    copies = [(None, prepared.trace, prepared.input_hashes)] + list(prepared.extra)
    return [Level(lv, level_rate(lv, capacity), tr, hs, sh, i * LEVEL_ID_STRIDE)
            for i, (lv, (sh, tr, hs)) in enumerate(zip(sorted(levels), copies))]


def calibrate(system, ctx, ps, policy: str) -> dict:
    """Step 1: one case of ``system`` with ``policy`` sending the trace as one burst; returns the record
    ``{"requests_per_s", "system", "policy", "case"}``. ``RunFailed`` when the case fails. It is the run's first
    case: with ``--kv-sizing first-case`` its KV cache is the pairs' (``ctx.kv``, which the copy it runs on
    shares; ``sut.locality.kv_pin``)."""
    from sut.errors import RunFailed
    from sut.locality.pairs import Case, run_case

    case = Case(0, system.name, policy, -1, label=f"calibration-{system.name}-{policy}")
    calm = replace(ctx, levels=(), workload=replace(ctx.workload, kill_after=0.0))  # one plain burst
    rec = run_case(system, calm, replace(ps, rate=0.0), case)
    if "error" in rec:
        raise RunFailed(f"the capacity calibration failed: {rec['error']}")
    return {"requests_per_s": rec["timed"]["requests_per_s"], "system": system.name, "policy": policy, "case": rec}


def level_records(case: dict) -> list[dict]:
    """Step 5: the per-run records of one finished case, one per level (policy ``POLICY@LEVEL%``)."""
    out = []
    for lv in case["levels"]:
        t = lv["timed"]
        out.append({"system": case["system"], "policy": f"{case['policy']}@{lv['level']:.0%}", "pair": case["pair"],
                    **{m: t.get(m) for m in ("requests_per_s", "output_tokens_per_s", "cached_share",
                                             "goodput_per_s")}})
    return out


def _cell(lat: Optional[dict], key: str) -> str:
    return "-" if not lat or lat.get(key) is None else f"{lat[key]:.3f}"


def report_lines(record: dict) -> list[str]:
    """Per case and level: rate, TTFT (client) and TPOT p50 / p99, goodput and its share."""
    w = record.get("workload") or {}
    cap = w.get("capacity") or {}
    tg = (w.get("settings") or {})
    lines = [f"arrivals: capacity {cap.get('requests_per_s')} requests/s ({cap.get('source')}); goodput = TTFT <= "
             f"{tg.get('ttft_target_s')} s and TPOT <= {tg.get('tpot_target_s')} s",
             f"{'pair':>4}  {'system':<11} {'policy':<22} {'level':>5} {'rate/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} "
             f"{'TPOT p50':>9} {'TPOT p99':>9} {'good/s':>8} {'good':>6}"]
    for c in record.get("cases", []):
        for lv in c.get("levels") or []:
            t = lv["timed"]
            ttft = t.get("client_ttft_s") or t.get("ttft_s")
            lines.append(f"{c['pair']:>4}  {c['system']:<11} {c['policy']:<22} {lv['level']:>5.0%} {lv['rate']:>8.3f} "
                         f"{_cell(ttft, 'p50'):>9} {_cell(ttft, 'p99'):>9} {_cell(t.get('tpot_s'), 'p50'):>9} "
                         f"{_cell(t.get('tpot_s'), 'p99'):>9} {t.get('goodput_per_s', 0):>8.3f} "
                         f"{t.get('goodput_share', 0):>6.1%}")
    return lines
