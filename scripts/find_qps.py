"""Find the highest Server / Interactive ``target_qps`` that LoadGen calls VALID (issue 14).

Each try is one short ``python -m sut run`` (a fresh process: LoadGen's ``FromConfig`` runs once per
process) at one ``--target-qps``; its ``run.json`` gives LoadGen's verdict (``result_validity``,
which in Server includes the p99 TTFT/TPOT limits and early stopping) and the TTFT/TPOT p99s. The
search grows (x ``--factor``) from ``--start`` until a try is INVALID, or shrinks until one is VALID,
then bisects between the highest VALID and the lowest INVALID value until they are within
``--rel-tol`` of each other or ``--max-runs`` tries are spent. It prints every try, then the result
and the user.conf line for it.

Early stopping needs enough queries: with every query under the limits LoadGen wants about 460 at
p99 ("Would need to run at least N more queries"), so a short try needs ``--min-query-count`` of
several hundred (default 1,000) even when ``--min-duration-s`` is small. Short tries are dev runs
(marked not compliant); confirm the value with one full-length run (600 s, user.conf line, no
overrides) before submitting.

Example (one H200, fp8, Server):
    python scripts/find_qps.py --scenario Server --start 40 -- --config loadgen_configs/h200_fp8.toml \
        --model MODEL --dataset cnn_eval.json
CPU try-out (tiny model; small settings):
    python scripts/find_qps.py --scenario Server --start 4 --min-duration-s 5 --min-query-count 500 --max-runs 4 \
        -- --config loadgen_configs/cpu_tiny.toml --dataset results/demo/data/synthetic_64.json
Everything after ``--`` goes to ``python -m sut run`` as is.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sut_runs import run_once, split_run_args  # noqa: E402

MODEL_KEYS = {"Server": "llama3_1-8b", "Interactive": "llama3_1-8b-interactive"}


@dataclass(frozen=True)
class Try:
    """One short run: ``qps`` asked, LoadGen's ``validity`` (``VALID``/``INVALID``/None = the run failed)."""

    qps: float
    validity: Optional[str]
    ttft_p99_ms: Optional[float] = None
    tpot_p99_ms: Optional[float] = None
    tokens_per_s: Optional[float] = None
    folder: str = ""
    note: str = ""

    @property
    def valid(self) -> bool:
        return self.validity == "VALID"


def search(run: Callable[[float], Try], start: float, factor: float = 2.0, rel_tol: float = 0.05,
           max_runs: int = 8) -> tuple[Optional[float], list[Try]]:
    """Highest VALID qps found and every try, in order.

    ``run(qps)`` makes one try. Grow from ``start`` by ``factor`` while VALID (shrink while
    INVALID) to bracket the boundary, then bisect until ``hi / lo - 1 <= rel_tol``. Returns
    ``(None, tries)`` when no try was VALID. Raises ``ValueError`` for non-positive arguments.
    """
    if start <= 0 or factor <= 1 or rel_tol <= 0 or max_runs < 1:
        raise ValueError("start, rel_tol must be > 0, factor > 1, max_runs >= 1")
    tries: list[Try] = []
    lo = hi = None  # highest VALID, lowest INVALID
    q = start
    while len(tries) < max_runs:
        t = run(q)
        tries.append(t)
        if t.valid:
            lo = q if lo is None else max(lo, q)
        else:
            hi = q if hi is None else min(hi, q)
        if lo is None:
            q = q / factor
        elif hi is None:
            q = q * factor
        else:
            if hi / lo - 1 <= rel_tol:
                break
            q = (lo + hi) / 2
    return lo, tries


def _ms(ns) -> Optional[float]:
    return None if ns is None else round(ns / 1e6, 2)


def sut_try(scenario: str, qps: float, out: Path, run_args: list[str], min_duration_s: float,
            min_query_count: int, timeout_s: float) -> Try:
    """One ``python -m sut run`` at ``qps``; its verdict from the run's ``run.json``."""
    name = f"{time.strftime('%Y%m%d-%H%M%S')}-findqps-{scenario}-{qps:g}"
    o = run_once([*run_args, "--scenario", scenario, "--target-qps", f"{qps:g}", "--min-duration-s",
                  f"{min_duration_s:g}", "--min-query-count", str(min_query_count)], out, name, timeout_s)
    if o.rc == 2 or o.record is None:
        raise SystemExit(f"python -m sut run refused the settings (exit {o.rc}):\n{o.stderr}")
    rec = o.record
    lg = rec.get("loadgen") or {}
    note = "" if o.rc == 0 else f"run failed (exit {o.rc}): {rec.get('error')}"
    return Try(qps, rec.get("validity") if o.rc == 0 else None,
               _ms(lg.get("result_first_token_99.00_percentile_latency_ns")),
               _ms(lg.get("result_time_per_output_token_99.00_percentile_ns")),
               rec.get("tokens_per_s"), str(o.folder), note)


def table(tries: list[Try]) -> str:
    rows = ["qps        validity  TTFT p99 ms  TPOT p99 ms  tokens/s  folder"]
    for t in tries:
        rows.append(f"{t.qps:<10g} {str(t.validity):<9} {str(t.ttft_p99_ms):>11}  {str(t.tpot_p99_ms):>11}  "
                    f"{str(round(t.tokens_per_s, 1) if t.tokens_per_s else None):>8}  {t.folder} {t.note}")
    return "\n".join(rows)


def main(argv=None) -> int:
    argv, run_args = split_run_args(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Arguments after -- go to python -m sut run (model, dataset, preset, ...).")
    p.add_argument("--scenario", required=True, choices=sorted(MODEL_KEYS))
    p.add_argument("--start", type=float, required=True, help="first target_qps to try (queries/s)")
    p.add_argument("--factor", type=float, default=2.0, help="growth/shrink factor while bracketing (default 2)")
    p.add_argument("--rel-tol", type=float, default=0.05, help="stop when highest VALID and lowest INVALID are "
                                                                "within this fraction (default 0.05)")
    p.add_argument("--max-runs", type=int, default=8, help="at most this many tries (default 8)")
    p.add_argument("--min-duration-s", type=float, default=60.0, help="LoadGen min duration of each try (default 60)")
    p.add_argument("--min-query-count", type=int, default=1000,
                   help="LoadGen min query count of each try (early stopping needs several hundred; default 1000)")
    p.add_argument("--timeout-s", type=float, default=3600.0, help="give up on one try after this long")
    p.add_argument("--output-dir", default="results/find_qps", help="where the tries' run folders go")
    a = p.parse_args(argv)
    if any(x in run_args for x in ("--scenario", "--target-qps", "--min-duration-s", "--min-query-count")):
        p.error("give --scenario, --target-qps, --min-duration-s and --min-query-count to find_qps, not after --")
    out = Path(a.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    try:
        best, tries = search(lambda q: sut_try(a.scenario, q, out.resolve(), run_args, a.min_duration_s,
                                               a.min_query_count, a.timeout_s),
                             a.start, a.factor, a.rel_tol, a.max_runs)
    except ValueError as e:
        p.error(str(e))
    print(table(tries))
    if best is None:
        print(f"no try was VALID (lowest tried {min(t.qps for t in tries):g} queries/s)")
        return 1
    print(f"highest VALID target_qps: {best:g} queries/s ({a.scenario}); confirm with one full-length run.")
    print(f"user.conf line: {MODEL_KEYS[a.scenario]}.Server.target_qps = {best:g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
