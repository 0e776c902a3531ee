"""Each Server / Interactive run of one folder as a share of the Offline run beside it (same job, same card).

Reads every ``run.json`` under the folder (``gpu_runs.sh``'s ``$JOB/confirm``, or any folder of ``python -m sut
run`` outputs), and prints one line per run: scenario, target, LoadGen's verdict, output tokens/s (the run's
``tokens_per_s``: LoadGen's completed tokens/s for Server / Interactive), the share of the Offline run's tokens/s,
TTFT and TPOT p99 against their limits, and the card. Shares have two decimals and each Server / Interactive line
says whether it meets the goal it is read against (``GOALS``, docs/benchmarks.md: Server >= 95 % and Interactive
>= 82 % of Offline, VALID over 600 s, on the same machine; shares are cut, not rounded: 94.996 % reads 94.99 %, "below"). A run.json
that is no run record is named on stderr and left out (exit 1). Exit 2 when the folder holds no run.json, 1 when it holds no Offline run (each
line then shows no share) or runs on different cards.

    python scripts/bench/scenario_ratios.py /tmp/job/confirm
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Optional

GOALS = {"Server": 0.95, "Interactive": 0.82}  # share of the same machine's Offline tokens/s (docs/benchmarks.md)
GOAL_MIN_S = 600  # a goal counts for a run of MLPerf's 600 s minimum duration only


def read_run(path: Path) -> dict:
    """The fields a line shows, from one ``run.json``: scenario, target_qps, validity, tokens_per_s (completed),
    ttft_p99_ms / tpot_p99_ms and their limits (None for Offline), card, wall_s, folder name, min_duration_s (LoadGen's
    effective minimum duration, None when the record has none). ``ValueError`` for a file that is no run record."""
    try:
        d = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read it as JSON: {e}") from None
    if not isinstance(d, dict):
        raise ValueError(f"{path}: not a run record (a JSON {type(d).__name__}, not an object)")
    lg = d.get("loadgen") if isinstance(d.get("loadgen"), dict) else {}
    scenario, tok = d.get("scenario"), d.get("tokens_per_s")  # Server / Interactive: completed tokens/s

    def ms(key: str) -> Optional[float]:
        v = lg.get(key)
        return v / 1e6 if isinstance(v, (int, float)) else None

    cards = sorted({((e or {}).get("device") or {}).get("name") or "?" for e in d.get("engines") or []})
    dur = lg.get("effective_min_duration_ms")
    return {"scenario": scenario or "?", "target_qps": lg.get("effective_target_qps"),
            "validity": d.get("validity") or "?",
            "tokens_per_s": tok, "ttft_p99_ms": ms("result_first_token_99.00_percentile_latency_ns"),
            "ttft_limit_ms": ms("requested_server_ttft_latency"),
            "tpot_p99_ms": ms("result_time_per_output_token_99.00_percentile_ns"),
            "tpot_limit_ms": ms("requested_server_tpot_latency"), "card": ", ".join(cards),
            "wall_s": d.get("wall_s"), "name": path.parent.name,
            "min_duration_s": dur / 1000 if isinstance(dur, (int, float)) else None}


def goal_mark(run: dict, share: float) -> str:
    """`` (goal 95%: V)`` for a Server / Interactive run, V the first that holds: ``not VALID`` (LoadGen did not say
    VALID), ``below`` (the share under ``GOALS``, unrounded), ``duration unknown`` (the record has no LoadGen minimum
    duration), ``short run`` (under ``GOAL_MIN_S``), else ``met``; empty for other scenarios."""
    goal = GOALS.get(run["scenario"])
    if goal is None:
        return ""
    dur = run.get("min_duration_s")
    verdict = ("not VALID" if run["validity"] != "VALID" else "below" if share < goal else
               "duration unknown" if dur is None else "short run" if dur < GOAL_MIN_S else "met")
    return f" (goal {goal:.0%}: {verdict})"


def pct(share: float) -> str:
    """A share as a percentage with two decimals, cut, not rounded (94.996 % reads 94.99 %, never 95.00 %)."""
    return f"{math.floor(share * 10000) / 100:6.2f}%"


def _ms(v: Optional[float], fmt: str) -> str:
    return "?" if v is None else format(v, fmt)


def lines(runs: list[dict]) -> tuple[list[str], Optional[float]]:
    """The printed lines and the Offline tokens/s they are shares of (the first Offline run's; None: none)."""
    off = next((r["tokens_per_s"] for r in runs if r["scenario"] == "Offline" and r["tokens_per_s"]), None)
    out = []
    for r in sorted(runs, key=lambda r: (r["scenario"] != "Offline", r["scenario"] or "", r["target_qps"] or 0)):
        tok = r["tokens_per_s"]
        share = f"  {pct(tok / off)} of Offline{goal_mark(r, tok / off)}" if off and tok else ""
        lat = "" if r["ttft_limit_ms"] is None else (
            f"  TTFT p99 {_ms(r['ttft_p99_ms'], ',.0f')}/{_ms(r['ttft_limit_ms'], ',.0f')} ms"
            f"  TPOT p99 {_ms(r['tpot_p99_ms'], '.1f')}/{_ms(r['tpot_limit_ms'], '.0f')} ms")
        out.append(f"{r['scenario']:<11} {r['target_qps'] or '-':>6}  {r['validity']:<7} "
                   f"{tok or 0:>9,.1f} tok/s{share}{lat}  [{r['name']}]")
    return out, off


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", type=Path, help="a folder with run folders (each with run.json) under it")
    a = p.parse_args(argv)
    paths = sorted(a.folder.rglob("run.json")) if a.folder.is_dir() else []
    if not paths:
        print(f"error: no run.json under {a.folder}", file=sys.stderr)
        return 2
    runs, bad = [], []
    for x in paths:
        try:
            runs.append(read_run(x))
        except ValueError as e:
            bad.append(str(e))
    for b in bad:
        print(f"error: {b} (left out)", file=sys.stderr)
    if not runs:
        return 2
    out, off = lines(runs)
    cards = {r["card"] for r in runs}
    print("\n".join(out))
    print(f"card: {' | '.join(sorted(cards))}; Offline: {f'{off:,.1f} tok/s' if off else 'none in this folder'}")
    if off is None or len(cards) > 1:
        print("no share is comparable: " + ("no Offline run beside these" if off is None else
                                           "the runs are on different cards"), file=sys.stderr)
        return 1
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
