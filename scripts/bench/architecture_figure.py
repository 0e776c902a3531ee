"""Draw docs/architecture.png: the data flow of the dispatch core (``python scripts/bench/architecture_figure.py``).

Boxes are the layers of ``sut/core`` and their users; arrows are requests (down) and results (up).
The picture is generated, not drawn by hand, so it changes with this file under review.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

log = logging.getLogger("architecture_figure")

#: (key, x, y, width, height, title, detail lines, colour)
BOXES = [
    ("loadgen", 0.5, 9.0, 4.0, 1.0, "LoadGen (mlperf_loadgen)", ["issue_queries / flush_queries"], "#dde"),
    ("locality", 6.0, 9.0, 4.0, 1.0, "python -m sut.locality", ["trace bursts, pairs (NOT MLPerf)"], "#edd"),
    ("sut", 0.5, 7.2, 4.0, 1.2, "TransportSUT  sut/core/loadgen_sut.py",
     ["--sut vllm | flame | vllm-http", "harness.py: run folder, run.json"], "#dde"),
    ("ledger", 6.3, 5.3, 3.9, 1.3, "SampleLedger  sut/ledger/sample.py",
     ["exactly once; unknown/duplicate = fatal;", "one completer thread calls LoadGen"], "#ded"),
    ("dispatch", 0.8, 5.3, 5.0, 1.3, "Dispatcher  sut/core/dispatcher.py",
     ["routing policy (sut/core/routing): round_robin,", "least_loaded, least_pending, prefix_affinity"], "#ffe"),
    ("local", 0.0, 2.6, 3.1, 1.8, "local transport", ["sut/core/transports/local.py", "EnginePool -> worker",
                                                       "processes (sut/engine)"], "#eef"),
    ("flame", 3.45, 2.6, 3.1, 1.8, "flame transport", ["sut/flame/transport.py", "batcher -> 1 session/replica",
                                                        "-> executors -> EngineHost"], "#eef"),
    ("http", 6.9, 2.6, 3.1, 1.8, "http transport", ["sut/core/transports/http.py", "1 pooled client ->",
                                                     "vllm serve (OpenAI API)"], "#eef"),
    ("engines", 0.0, 0.4, 10.0, 1.2, "vLLM engines (one per GPU, or several per GPU)",
     ["prefix-caching guard sut/core/guard.py: before build and after ready"], "#eee"),
]

#: (from, to, label, colour); requests flow down, results up.
ARROWS = [
    ("loadgen", "sut", "samples", "k"), ("locality", "dispatch", "Requests", "k"), ("sut", "dispatch", "Requests", "k"),
    ("dispatch", "local", "submit(replica)", "k"), ("dispatch", "flame", "", "k"), ("dispatch", "http", "", "k"),
    ("local", "engines", "", "k"), ("flame", "engines", "", "k"), ("http", "engines", "", "k"),
    ("http", "dispatch", "Completion / FirstToken / FatalEvent", "tab:blue"), ("dispatch", "ledger", "complete", "tab:blue"),
    ("ledger", "loadgen", "QuerySamplesComplete", "tab:blue"),
]


def _centre(box: tuple, side: str) -> tuple[float, float]:
    _, x, y, w, h, *_ = box
    return {"top": (x + w / 2, y + h), "bottom": (x + w / 2, y), "right": (x + w, y + h / 2), "left": (x, y + h / 2)}[side]


def draw(out: Path) -> Path:
    """Write the figure to ``out`` (PNG); returns the path."""
    boxes = {b[0]: b for b in BOXES}
    fig, ax = plt.subplots(figsize=(10, 8.4))
    for key, x, y, w, h, title, lines, colour in BOXES:
        ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.05", fc=colour, ec="0.3"))
        ax.text(x + w / 2, y + h - 0.28, title, ha="center", va="center", fontsize=10, weight="bold")
        for i, line in enumerate(lines):
            ax.text(x + w / 2, y + h - 0.62 - 0.32 * i, line, ha="center", va="center", fontsize=8.5)
    for a, b, label, colour in ARROWS:
        if boxes[a][2] == boxes[b][2]:  # same row: side to side
            p0, p1 = _centre(boxes[a], "right"), _centre(boxes[b], "left")
        else:
            up = boxes[b][2] > boxes[a][2]
            p0, p1 = _centre(boxes[a], "top" if up else "bottom"), _centre(boxes[b], "bottom" if up else "top")
        ax.add_patch(FancyArrowPatch(p0, p1, arrowstyle="-|>", mutation_scale=14, color=colour, lw=1.3,
                                     connectionstyle="arc3,rad=0.08" if colour != "k" else "arc3,rad=0"))
        if label:
            ax.text(p0[0] + 0.3 * (p1[0] - p0[0]) + 0.1, p0[1] + 0.3 * (p1[1] - p0[1]), label, fontsize=8, color=colour)
    ax.set_xlim(-0.3, 10.3)
    ax.set_ylim(0.1, 10.3)
    ax.axis("off")
    ax.set_title("Dispatch core: requests down (black), results up (blue)", fontsize=11)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[2] / "docs" / "architecture.png"))
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    log.info("wrote %s", draw(Path(a.out)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
