"""Pick the engine settings a confirmation run should use from a latency screen (``gpu_runs.sh server-steps``).

Usage: ``python3 scripts/bench/screen_pick.py --scenario Interactive JOB_DIR``

Reads every ``JOB_DIR/server_steps*/server_steps.json`` (one per engine of ``SS_OVERRIDES``, each with one Server
phase per admission interval of ``SS_ADMIT``). Each (engine, phase) is a candidate; its *worst share* is the larger of
TTFT p99 / limit and TPOT p99 / limit over the phase's steady window (the scenario's p99 limits,
``sut.scenarios.LATENCY_LIMITS_MS``: Interactive 500 / 30 ms, Server 2,000 / 100 ms). The candidate with the lowest
worst share wins: the one with the most room under its binding limit at the screened rate. Printed on stdout as
``gpu_runs.sh confirm`` takes an entry's flags: ``--FLAG=VALUE`` words joined by ``+`` (the screened engine's
``max_num_batched_tokens``, ``max_num_seqs`` and override keys as ``sut run`` flags, and ``--admit-every-steps=K`` for
K > 1: explicit, since the screen starts from the base preset's engine, not the scenario's); the
table of every candidate goes to stderr, with a warning when even the winner's worst share is above ``--headroom``
(default 0.95: a 75 s window's p99 is noisier than a 600 s run's).

Exit codes: 0 a pick; 1 no screen in JOB_DIR, or no candidate with both p99s (no steady window); 2 bad arguments.
A screen only screens: the LoadGen run it feeds decides.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from sut.scenarios import LATENCY_LIMITS_MS  # noqa: E402

#: Engine settings a preset sets per scenario (``[engine.Interactive]``): always given explicitly, since the screen's
#: engine starts from the base preset's (``perf_levers.BASE``: 8,192 batched tokens), not the scenario's.
PER_SCENARIO_KEYS = ("max_num_batched_tokens", "max_num_seqs")


def candidates(job: Path) -> list[dict]:
    """One dict per (screen file, Server phase): ``flags`` (list of ``--FLAG=VALUE``), ``ttft`` / ``tpot`` p99 (ms,
    None when the phase had no steady window) and ``where`` (file and phase, for the table).

    Raises:
        ValueError: a ``server_steps.json`` that is not JSON or lacks its ``phases`` / ``engine_override``.
    """
    out = []
    for f in sorted(job.glob("server_steps*/server_steps.json")):
        try:
            res = json.loads(f.read_text())
            phases, engine = res["phases"], res["engine"]
            keys = set(res.get("engine_override") or {}) | set(PER_SCENARIO_KEYS)
            base = [f"--{k.replace('_', '-')}={engine[k]}" for k in sorted(keys)]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{f}: not a server_steps.py result ({e!r})") from None
        if any(isinstance(engine[k], (dict, list)) for k in keys):
            raise ValueError(f"{f}: an engine override that is not a plain value has no `sut run` flag: {sorted(keys)}")
        for name, ph in phases.items():
            if not name.startswith("server"):
                continue
            k = ph.get("admit_every_steps") or 1
            w = ph.get("window") or {}
            out.append({"flags": base + ([f"--admit-every-steps={k}"] if k > 1 else []),
                        "ttft": w.get("ttft_ms_p99"), "tpot": w.get("tpot_ms_p99"),
                        "where": f"{f.parent.name}/{name}"})
    return out


def worst_share(c: dict, scenario: str) -> float:
    """max(TTFT p99 / limit, TPOT p99 / limit) of candidate ``c`` (inf when either p99 is missing)."""
    lim = LATENCY_LIMITS_MS[scenario]
    if c["ttft"] is None or c["tpot"] is None:
        return float("inf")
    return max(c["ttft"] / lim["ttft"], c["tpot"] / lim["tpot"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("job", type=Path, help="the job folder holding server_steps*/server_steps.json")
    ap.add_argument("--scenario", required=True, choices=sorted(LATENCY_LIMITS_MS))
    ap.add_argument("--headroom", type=float, default=0.95, help="warn when the winner's worst share is above this")
    a = ap.parse_args(argv)
    try:
        cands = candidates(a.job)
    except ValueError as e:
        print(f"screen: {e}", file=sys.stderr)
        return 1
    ranked = sorted(cands, key=lambda c: worst_share(c, a.scenario))
    for c in ranked:
        print(f"screen: {c['where']:<28} TTFT p99 {c['ttft']} ms  TPOT p99 {c['tpot']} ms  worst share "
              f"{worst_share(c, a.scenario):.3f}  flags {' '.join(c['flags'])}", file=sys.stderr)
    if not ranked or worst_share(ranked[0], a.scenario) == float("inf"):
        print(f"screen: no screened setting with both p99s in {a.job} (run the server-steps step first)",
              file=sys.stderr)
        return 1
    best = ranked[0]
    if worst_share(best, a.scenario) > a.headroom:
        print(f"screen: warning: even the best setting uses {worst_share(best, a.scenario):.3f} of a limit "
              f"(above {a.headroom}); confirming it anyway", file=sys.stderr)
    print("+".join(best["flags"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
