"""Scaling table of the standalone SUT over GPU counts, from the run records of ``gpu_runs.sh scale``.

Usage: ``python scripts/bench/gpu_scaling.py RUNS_DIR 1 N2 ...`` where ``RUNS_DIR/gpus<N>-NOT-COMPLIANT/run.json``
(or ``gpus<N>/run.json``) is the run on N GPUs. Prints, per GPU count: tokens/s, LoadGen validity, the
speed-up over the one-GPU run, per-engine sample counts and their spread
((max - min) / mean), and the GPU UUIDs. Targets: speed-up >= 0.97 x N (1.94 on two GPUs),
spread <= 0.02. Exit 1 when a record is missing or a target is missed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

EFFICIENCY_TARGET = 0.97  # >= 1.94x on 2 GPUs
SPREAD_TARGET = 0.02      # Per-engine sample counts within 2 %


def load(runs: Path, n: int) -> dict:
    for name in (f"gpus{n}-NOT-COMPLIANT", f"gpus{n}"):
        f = runs / name / "run.json"
        if f.is_file():
            return json.loads(f.read_text())
    raise FileNotFoundError(f"no run record for {n} GPU(s) under {runs} (gpus{n}[-NOT-COMPLIANT]/run.json)")


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    runs, counts = Path(argv[0]), sorted(set(int(x) for x in argv[1:]))
    if counts[0] != 1 or len(counts) < 2:
        print("error: give 1 (the baseline) and at least one larger GPU count, e.g. 1 2", file=sys.stderr)
        return 2
    try:
        recs = {n: load(runs, n) for n in counts}
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    per_gpu = recs[1]["tokens_per_s"]
    ok = True
    for n in counts:
        r = recs[n]
        samples = [e.get("samples") or 0 for e in r["engines"]]
        spread = (max(samples) - min(samples)) / (sum(samples) / len(samples)) if sum(samples) else float("nan")
        speedup = r["tokens_per_s"] / per_gpu
        good = r["validity"] == "VALID" and speedup >= EFFICIENCY_TARGET * n - 1e-9 and spread <= SPREAD_TARGET
        ok &= good
        print(f"{n} GPU(s): {r['tokens_per_s']:.1f} tok/s {r['validity']} | speed-up {speedup:.4f} "
              f"(target >= {EFFICIENCY_TARGET * n:.2f}) | per-engine samples {samples} spread {spread:.4f} "
              f"(target <= {SPREAD_TARGET}) | GPUs {[e['device'].get('uuid') for e in r['engines']]} | "
              f"{'ok' if good else 'MISSED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
