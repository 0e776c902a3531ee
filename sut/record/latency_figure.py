"""``latency.png`` of a Server / Interactive performance run: TTFT and TPOT of every sample over the run.

Two panels over the time since the first query was issued (s): TTFT (left) and TPOT (right) of each sample
(grey dots, ms, log scale), the p50 and p99 of equal time bins (lines), the scenario's p99 limit (dashed) and,
on the TTFT panel, the trend line of ``sut.record.latency_trend`` over its judged window (red when the queue was
growing or had built up past the TTFT limit before it, ``saturated``; none when the run was too short to
judge). A backlog that keeps growing shows as a TTFT band that
climbs through the run while TPOT stays flat; a steady run as flat bands. Figures are the harness's own (from ``issue_queries`` to the first token and
then per further token, ``sut.ledger.streaming``), not LoadGen's. Uses matplotlib's Agg canvas (no display).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from sut.record.latency_trend import time_bins

log = logging.getLogger(__name__)

#: Time bins of the p50 / p99 lines (fewer for small runs: at least SAMPLES_PER_BIN samples a bin on average;
#: no lines below 2 bins).
BINS = 40
SAMPLES_PER_BIN = 10


def write_latency_figure(path: Path, title: str, ttft: tuple[Sequence[float], Sequence[float]],
                         tpot: tuple[Sequence[float], Sequence[float]], limits_ms: Optional[dict],
                         trend: Optional[dict]) -> Optional[Path]:
    """Write the figure (module docstring) to ``path``; returns ``path``, or None when there is nothing to draw
    (no sample with a TTFT) or matplotlib or the write failed (logged, the partial file removed: a figure never
    fails a run).

    Args:
        title: the figure's title (scenario, target, LoadGen's verdict).
        ttft, tpot: ``(issue times s, values s)`` per sample (same clock for both).
        limits_ms: ``{"ttft": ms, "tpot": ms}`` or None.
        trend: ``sut.record.latency_trend.queue_trend``'s dict or None.
    """
    if not len(ttft[0]):
        return None
    try:
        return _draw(path, title, ttft, tpot, limits_ms or {}, trend)
    except BaseException as e:  # noqa: BLE001 - the run's record and LoadGen's logs are what counts
        try:
            path.unlink(missing_ok=True)  # no partial file left, also when a stop signal cut the write short
        except OSError:
            pass
        if not isinstance(e, Exception):  # Ctrl-C / SIGTERM: the run stops
            raise
        if isinstance(e, OSError):  # e.g. a full file system: no traceback
            log.warning("could not draw %s: %s", path, e)
        else:
            log.warning("could not draw %s", path, exc_info=True)
        return None


def _draw(path: Path, title: str, ttft, tpot, limits: dict, trend: Optional[dict]) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, NullFormatter

    t0 = float(min(ttft[0]))
    fig = Figure(figsize=(12, 4))
    FigureCanvasAgg(fig)
    for i, (name, (issued, values)) in enumerate((("TTFT", ttft), ("TPOT", tpot))):
        ax = fig.add_subplot(1, 2, i + 1)
        t = np.asarray(issued, dtype=float) - t0
        y = np.asarray(values, dtype=float) * 1e3
        ok = np.isfinite(t) & np.isfinite(y) & (y > 0)
        t, y = t[ok], y[ok]
        if len(t):
            ax.scatter(t, y, s=2, color="grey", alpha=0.25, rasterized=True, label="per sample")
            _bin_lines(ax, t, y)
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))  # ms, not 6x10^1
            few = np.log10(y.max() / y.min()) < 1.5  # a decade or so holds one major tick: label 2x, 3x, 5x too
            ax.yaxis.set_minor_formatter(FuncFormatter(_minor_label) if few else NullFormatter())
        limit = limits.get(name.lower())
        if limit is not None:
            ax.axhline(limit, color="black", linestyle="--", linewidth=1, label=f"p99 limit {limit} ms")
        if name == "TTFT" and trend:
            _trend_line(ax, trend)
        ax.set_xlabel("time since the first query was issued (s)")
        ax.set_ylabel(f"{name} (ms)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="best", framealpha=0.8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def _minor_label(v: float, _pos) -> str:
    """A log axis's minor tick ``v`` (ms) labelled where it is 2, 3 or 5 times a power of ten, else unlabelled."""
    if v <= 0:
        return ""
    lead = v / 10 ** np.floor(np.log10(v))
    return f"{v:,.0f}" if v >= 1 and min(abs(lead - k) for k in (2, 3, 5)) < 1e-6 else ""


def _bin_lines(ax, t: np.ndarray, y: np.ndarray) -> None:
    """p50 and p99 of equal time bins (``BINS``, fewer for a small run), drawn at the bins' mid times (empty bins
    left out); none for a run too small for 2 bins."""
    bins = min(BINS, len(t) // SAMPLES_PER_BIN)
    if bins < 2:
        return
    pts = time_bins(t, 0.0, float(t.max()) or 1.0, bins)
    for q, style in ((50, dict(color="tab:blue")), (99, dict(color="tab:purple", linestyle=":"))):
        ax.plot([m for m, _ in pts], [np.percentile(y[sel], q) for _, sel in pts], label=f"p{q} of {bins} time bins",
                **style)


def _trend_line(ax, trend: dict) -> None:
    """The fitted TTFT line over the judged window (``fit_from_s`` to the end), through the fit's own point
    (``fit_mid_s``, ``fit_mid_ms``; records without it: the last quarter's p50 at 7/8 of the span); on the log
    axis only where it stays above a tenth of that point (a flat, noisy fit extended to the window's start can
    reach 0); nothing when the run was not judged."""
    span, slope = trend.get("span_s"), trend.get("slope_ms_per_s")
    if not span or slope is None:
        return
    x0, y0 = trend.get("fit_mid_s"), trend.get("fit_mid_ms")
    if x0 is None or y0 is None:
        x0, y0 = 7 * span / 8, trend["last_quarter_p50_ms"]
    floor = max(y0, 1e-3) / 10
    xs = np.linspace(trend.get("fit_from_s", span / 2), span, 50)
    ys = y0 + slope * (xs - x0)
    keep = ys >= floor
    if not keep.any():
        return
    growing, full = bool(trend.get("growing")), bool(trend.get("saturated"))
    note = " (queue growing)" if growing else " (past capacity)" if full else ""
    ax.plot(xs[keep], ys[keep], color="tab:red" if growing or full else "tab:green", linewidth=2,
            label=f"trend {slope:+,.1f} ms/s{note}")
