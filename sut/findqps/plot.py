"""The figure of a target_qps search (python -m sut find-qps writes it next to its JSONL log, ``<log>.png``).

Three panels over the tries' ``target_qps`` (queries/s): TTFT p99 and TPOT p99 (ms, log scale) with the
scenario's p99 limit (``sut.scenarios.LATENCY_LIMITS_MS``) as a dashed line, and LoadGen's completed tokens/s.
VALID tries are green dots, VALID tries whose TTFT backlog was growing (``Try.queue_growing``) orange triangles,
INVALID red crosses; a failed try (no LoadGen verdict, no figures) is a grey
tick on the x axis. The search's result (the highest VALID target_qps; a GROWING one only under ``--allow-queue-growth``) is a
vertical line. Uses matplotlib's Agg canvas (no
display, no global backend).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Optional, Sequence

from sut.findqps.search import Try
from sut.scenarios import LATENCY_LIMITS_MS


def plot_search(tries: Sequence[Try], scenario: str, best: Optional[float], path: Path) -> Path:
    """Write the search figure of ``tries`` (module docstring) to ``path`` (PNG); returns ``path``."""
    with warnings.catch_warnings():  # one try, or equal figures: matplotlib widens the flat axis itself, and says so
        warnings.filterwarnings("ignore", message="Attempting to set identical", category=UserWarning)
        return _draw(tries, scenario, best, path)


def verdict(t: Try) -> Optional[str]:
    """"VALID", "VALID, queue growing", "INVALID" or None (the try failed)."""
    return "VALID, queue growing" if t.growing else t.validity


def _draw(tries: Sequence[Try], scenario: str, best: Optional[float], path: Path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 3.8))
    FigureCanvasAgg(fig)
    limits = LATENCY_LIMITS_MS[scenario]
    panels = (("ttft_p99_ms", "TTFT p99 (ms)", limits["ttft"]), ("tpot_p99_ms", "TPOT p99 (ms)", limits["tpot"]),
              ("tokens_per_s", "completed tokens/s", None))
    for i, (field, label, limit) in enumerate(panels):
        ax = fig.add_subplot(1, 3, i + 1)
        for label_, style in (("VALID", dict(color="tab:green", marker="o")),
                              ("VALID, queue growing", dict(color="tab:orange", marker="^")),
                              ("INVALID", dict(color="tab:red", marker="x"))):
            pts = [(t.qps, getattr(t, field)) for t in tries if verdict(t) == label_ and getattr(t, field)]
            if pts:
                ax.scatter(*zip(*pts), label=label_, **style)
        failed = [t.qps for t in tries if t.validity is None]
        if failed:
            ax.plot(failed, [0] * len(failed), "|", color="grey", markersize=14, transform=ax.get_xaxis_transform(),
                    label="failed")
        if limit is not None:
            ax.set_yscale("log")
            ax.axhline(limit, color="black", linestyle="--", linewidth=1, label=f"limit {limit} ms")
        if best is not None:
            ax.axvline(best, color="tab:green", linewidth=0.8, alpha=0.6)
        ax.set_xlabel("target_qps (queries/s)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if i == 0:
            ax.legend(fontsize=8)
    title = f"{scenario} target_qps search: {len(tries)} tries"
    grew = best is not None and any(t.qps == best and t.growing for t in tries)
    fig.suptitle(title + (f", result {best:g}" + (" (its queue was growing)" if grew else "") if best is not None
                          else ", no result"))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path
