"""Whether a Server / Interactive run's backlog kept growing: the TTFT trend over the run.

A target_qps at or just past what the SUT can serve shows up in LoadGen's TTFT p99 only once the backlog is
long: a short run can end VALID while the queue grows by a few milliseconds each second, and the 600 s run at
the same target then fails on TTFT. Seen on one H200 (2026-12-01, docs/benchmarks.md): Server
55.5 q/s was VALID in a short try (2,040 queries, ~37 s), 55 q/s INVALID over 600 s with TTFT rising almost
linearly from ~0 to 4.4 s (p50 2.2 s, p99 4.1 s; limit 2 s).

:func:`queue_trend` reads the harness's own per-sample figures (issue time, TTFT and end-to-end latency, from
the streaming ledger). The queue's state changes on the time scale of how long a query holds its sequence slot
(the "service time", here the median of end-to-end latency minus TTFT, so that a growing wait does not lengthen
it: ~9 s on one H200 in Server, 128 tokens x ~70 ms), so:

- the fit starts after ``WARM_SERVICES`` service times and not before the middle of the run (an empty engine
  first fills its sequence slots: TTFT rises then without any backlog);
- the fitted window is cut into at most ``BINS`` time bins of at least one service time each, the TTFT median of
  each bin is one point (neighbouring queries share one queue state: fitting every query would count one burst
  hundreds of times), and at least ``MIN_BINS`` bins are needed: a run shorter than ``needs_span_s`` (about 12
  service times) is **not judged** (``judged`` false, ``growing`` None), however it looks;
- ``growing`` needs the least-squares slope over those medians ``MIN_Z`` standard errors above 0, the later half
  of the window slower than the earlier, and the TTFT p50 projected to ``horizon_s`` (LoadGen's 600 s) at that
  slope past the scenario's TTFT limit;
- ``saturated`` says the backlog had already built before the fitted window: the last quarter's TTFT p50 is above
  the scenario's TTFT limit (a queue that grew early and then stayed long, as when every sequence slot is taken:
  one H200, Interactive 44 q/s with 1,024 batched tokens a step, 2026-12-02, TTFT p50 3.7 s in the first quarter,
  24.4 s in the last, slope -14.7 ms/s). A flat slope then means "past capacity", not "steady".

Returned (``run.json`` ``latency.harness.ttft_trend``): ``samples``, ``span_s`` (issue span), ``issued_qps``
(the arrival rate the run really had: LoadGen's seeded schedule runs a few % above target in short runs),
``service_s_p50``, ``first_quarter_p50_ms`` / ``last_quarter_p50_ms`` (TTFT p50 of the first / last quarter of the
span), ``judged``, ``needs_span_s``, ``fit_from_s``, ``bins``, ``slope_ms_per_s``, ``slope_z``, ``fit_mid_s`` /
``fit_mid_ms`` (a point of the fitted line: the bins' mean mid time and mean TTFT median, through which the
figure draws it), ``horizon_s``, ``projected_p50_ms``, ``growing``, ``saturated`` (None without a limit). None when there are fewer than ``MIN_SAMPLES`` usable samples or the span is
under ``MIN_SPAN_S``. Samples with a non-finite value are left out.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np

#: Fewest samples, and shortest issue span (s), from which a trend is reported at all (below: None).
MIN_SAMPLES = 200
MIN_SPAN_S = 10.0
#: The fit starts this many service times (median end-to-end latency) into the run, and not before its middle.
WARM_SERVICES = 2.0
#: At most this many time bins in the fitted window, each at least one service time long; fewer than MIN_BINS:
#: not judged.
BINS = 10
MIN_BINS = 6
#: A slope counts as growth only this many standard errors above 0 (t with 4-8 degrees of freedom: p < 0.01).
MIN_Z = 4.0


def queue_trend(issued_s: Sequence[float], ttft_s: Sequence[float], e2e_s: Sequence[float],
                horizon_s: Optional[float], limit_ms: Optional[float]) -> Optional[dict]:
    """The TTFT trend of one run (module docstring).

    Args:
        issued_s: per sample, the time its query was issued (s, any monotonic clock).
        ttft_s: per sample (same order), its TTFT (s).
        e2e_s: per sample (same order), issue to last token (s).
        horizon_s: the run length to project to (s; LoadGen's min duration); None: no projection, no verdict.
        limit_ms: the scenario's TTFT p99 limit (ms); None: no verdict (``growing`` None).

    Raises:
        ValueError: when the sequences differ in length.
    """
    if not len(issued_s) == len(ttft_s) == len(e2e_s):
        raise ValueError(f"issued_s, ttft_s and e2e_s have {len(issued_s)}, {len(ttft_s)} and {len(e2e_s)} values")
    rows = np.column_stack([np.asarray(v, dtype=float) for v in (issued_s, ttft_s, e2e_s)]) if len(issued_s) else \
        np.empty((0, 3))
    rows = rows[np.all(np.isfinite(rows), axis=1)]
    if len(rows) < MIN_SAMPLES:
        return None
    rows = rows[np.argsort(rows[:, 0], kind="stable")]
    t, y = rows[:, 0] - rows[0, 0], rows[:, 1] * 1e3
    service = max(float(np.median(rows[:, 2] - rows[:, 1])), 1e-3)  # first token to last: not the wait
    span = float(t[-1])
    if span < MIN_SPAN_S:
        return None
    start = max(span / 2, WARM_SERVICES * service)
    bins = min(BINS, int((span - start) // service)) if span > start else 0
    horizon = horizon_s if horizon_s is not None and math.isfinite(horizon_s) else None
    last_quarter = _p50(y[t >= 3 * span / 4])
    out = {"samples": int(len(y)), "span_s": round(span, 3), "issued_qps": round((len(y) - 1) / span, 3),
           "service_s_p50": round(service, 3), "first_quarter_p50_ms": _p50(y[t <= span / 4]),
           "last_quarter_p50_ms": last_quarter, "judged": bins >= MIN_BINS,
           "needs_span_s": round(max(2 * MIN_BINS * service, 2 * MIN_SPAN_S), 1), "fit_from_s": round(start, 3),
           "bins": bins, "slope_ms_per_s": None, "slope_z": None, "fit_mid_s": None, "fit_mid_ms": None,
           "horizon_s": horizon, "projected_p50_ms": None, "growing": None,
           "saturated": None if limit_ms is None else last_quarter > limit_ms}
    if not out["judged"]:
        return out
    window = t >= start
    slope, z, (mid_t, mid_y) = _binned_slope(t[window], y[window], start, span, bins)
    mid = (start + span) / 2
    later_slower = _p50(y[t >= mid]) > _p50(y[window & (t < mid)])
    out.update(slope_ms_per_s=round(slope, 4), slope_z=round(z, 2), fit_mid_s=round(mid_t, 3), fit_mid_ms=round(mid_y, 3))
    if horizon is not None:
        out["projected_p50_ms"] = round(out["last_quarter_p50_ms"] + max(slope, 0.0) * max(horizon - span, 0.0), 3)
        if limit_ms is not None:
            out["growing"] = bool(z >= MIN_Z and later_slower and out["projected_p50_ms"] > limit_ms)
    return out


def _p50(v: np.ndarray) -> float:
    return round(float(np.median(v)), 3)


def time_bins(t: np.ndarray, start: float, end: float, bins: int) -> list[tuple[float, np.ndarray]]:
    """``(mid time, mask of t)`` of each non-empty one of ``bins`` equal bins of [start, end] (times outside
    go to the first / last bin)."""
    edges = np.linspace(start, end, bins + 1)
    idx = np.clip(np.searchsorted(edges, t, side="right") - 1, 0, bins - 1)
    return [((edges[i] + edges[i + 1]) / 2, idx == i) for i in range(bins) if np.any(idx == i)]


def _binned_slope(t: np.ndarray, y: np.ndarray, start: float, end: float,
                  bins: int) -> tuple[float, float, tuple[float, float]]:
    """``_slope`` of the TTFT medians of ``bins`` equal bins of [start, end] over the bins' mid times, and the
    point ``(mean mid time, mean median)`` that the least-squares line passes through."""
    pts = time_bins(t, start, end, bins)
    mids, medians = np.asarray([m for m, _ in pts]), np.asarray([float(np.median(y[sel])) for _, sel in pts])
    return (*_slope(mids, medians), (float(mids.mean()), float(medians.mean())))


def _slope(t: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(least-squares slope of ``y`` over ``t``, slope / its standard error); (0, 0) when ``t`` is constant."""
    tc = t - t.mean()
    sxx = float(np.dot(tc, tc))
    if len(t) < 3 or sxx <= 0:
        return 0.0, 0.0
    slope = float(np.dot(tc, y - y.mean()) / sxx)
    resid = y - y.mean() - slope * tc
    se = float(np.sqrt(np.dot(resid, resid) / (len(t) - 2) / sxx))
    return slope, (slope / se if se > 0 else (float("inf") if slope > 0 else 0.0))


def describe(trend: Optional[dict], steady_too: bool = False) -> Optional[str]:
    """One line for a console summary or a search note when the queue was growing (also for a judged run whose
    queue was not, with ``steady_too``); None otherwise."""
    if trend and trend.get("saturated") and not trend.get("growing"):
        return (f"backlog already built: TTFT p50 {_ms(trend['first_quarter_p50_ms'])} -> "
                f"{_ms(trend['last_quarter_p50_ms'])} (first -> last quarter), above the TTFT limit"
                + (f", then flat ({trend['slope_ms_per_s']:+,.1f} ms/s from {trend['fit_from_s']:.0f} s)"
                   if trend.get("slope_ms_per_s") is not None else "")
                + f" at {trend['issued_qps']:g} queries/s issued: past capacity")
    if trend and steady_too and trend.get("growing") is False:
        return (f"no backlog growth: {trend['slope_ms_per_s']:+,.1f} ms/s (z {trend['slope_z']:g}) from "
                f"{trend['fit_from_s']:.0f} s to {trend['span_s']:.0f} s at {trend['issued_qps']:g} queries/s issued")
    if not trend or not trend.get("growing"):
        return None
    rise = (f"queue growing: TTFT p50 {_ms(trend['first_quarter_p50_ms'])} -> {_ms(trend['last_quarter_p50_ms'])} over "
            f"{trend['span_s']:.0f} s (+{trend['slope_ms_per_s']:,.1f} ms/s) at {trend['issued_qps']:g} queries/s issued")
    if trend["span_s"] >= trend["horizon_s"]:
        return rise + ": the backlog grew all run, past capacity"
    return (rise + f"; ~{_ms(trend['projected_p50_ms'])} by {trend['horizon_s']:.0f} s: past capacity, a full-length "
            "run at this arrival rate would fail on TTFT")


def not_judged(trend: Optional[dict]) -> Optional[str]:
    """A note when the run was too short to judge the backlog (``judged`` false); None otherwise."""
    if not trend or trend.get("judged") is not False:
        return None
    return (f"queue trend not judged: {trend['span_s']:.0f} s of issuing, needs >= {trend['needs_span_s']:g} s "
            f"(12 x the {trend['service_s_p50']:g} s a query holds its slot after its first token, median)")


def _ms(v: float) -> str:
    """A latency for people: "850 ms", or "12.3 s" from 10 s on."""
    return f"{v:,.0f} ms" if v < 10_000 else f"{v / 1e3:,.1f} s"
