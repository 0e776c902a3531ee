"""The study's locality benchmark: Flame vs standalone vLLM on both study traces, and its targets.

Runs ``python -m sut.locality run`` once per trace preset with ``--systems standalone flame`` (the
``study-reuse`` trace with ``prefix_affinity`` and ``round_robin``, ``study-no-reuse`` with
``prefix_affinity``), ``--pairs N`` fresh pairs each, then prints the pair ratios and checks the
targets against the runs' ``locality.json`` (``--check`` only checks finished runs, merged
reports of ``python -m sut.locality report``, and runs cut off before their ``locality.json``: their
finished cases in ``cases.jsonl``, complete pairs only):

* flame / standalone, both with prefix affinity, ``study-reuse``: median >= 99.5 %, worst pair >= 99 %
  (the study: 99.14 %, worst 97.97 %); ``study-no-reuse``: median >= 99.5 % (the study: 99.45 %);
* prefix_affinity / round_robin on ``study-reuse`` (ratio of the median requests/s): >= 1.8x for both
  systems (the study: 1.775x vLLM, 1.734x Flame); cached share with affinity >= 74.8 % (the study:
  74.86 %; four questions per document allow at most 75 %).

Usage (everything after ``--`` goes to ``python -m sut.locality run``: engine flags, ``--dataset``,
``--tokenizer``, shorter documents for a CPU, ...)::

    python scripts/bench/bench_locality.py --pairs 5 --out results/bench-locality -- \\
        --model /models/Llama-3.1-8B-Instruct --dtype bfloat16 --device cuda --engines-per-device 2 \\
        --dataset cnn_eval.json --tokenizer /models/Llama-3.1-8B-Instruct
    python scripts/bench/bench_locality.py --check results/bench-locality/*-SYNTHETIC-LOCALITY-NOT-MLPERF

The Flame system needs ``FLAME_ENDPOINT`` (docs/locality.md). Exit 0 when every run completed (the
verdicts are printed, whatever they say), 1 when a run failed, 2 for bad arguments; with
``--require-targets`` a missed target exits 1 too.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[2]
TRACES = {"study-reuse": ("prefix_affinity", "round_robin"), "study-no-reuse": ("prefix_affinity",)}
SUFFIX = "-SYNTHETIC-LOCALITY-NOT-MLPERF"


def _ratio(report: dict, policy: str) -> Optional[dict]:
    return (report.get("pair_ratios") or {}).get(policy)


def targets(record: dict) -> list[tuple[str, Optional[float], str, str, Optional[bool]]]:
    """``(what, measured, target, the study's figure, met)`` rows for one run's ``locality.json``;
    ``measured``/``met`` are None where the run lacks the systems or policies a target needs."""
    report, preset = record.get("report") or {}, record.get("trace_preset")
    rows = []
    aff = _ratio(report, "prefix_affinity")
    med = aff["median"] if aff else None
    if preset == "study-reuse":
        worst = aff["min"] if aff else None
        rows += [("flame / standalone, prefix_affinity, median", med, ">= 99.5 %", "99.14 %",
                  None if med is None else med >= 0.995),
                 ("flame / standalone, prefix_affinity, worst pair", worst, ">= 99 %", "97.97 %",
                  None if worst is None else worst >= 0.99)]
        study = {"standalone": "1.775x", "flame": "1.734x"}
        for system in ("standalone", "flame"):
            pr = (report.get("policy_ratios") or {}).get(system)
            x = pr["ratio_of_medians"] if pr else None
            rows.append((f"{system}: prefix_affinity / round_robin", x, ">= 1.8x", study[system],
                         None if x is None else x >= 1.8))
            st = (((report.get("runs") or {}).get(system) or {}).get("prefix_affinity") or {}).get("cached_share")
            share = st["median"] if st else None
            rows.append((f"{system}: cached share with prefix_affinity", share, ">= 74.8 %", "74.86 %",
                         None if share is None else share >= 0.748))
    elif preset == "study-no-reuse":
        rows.append(("flame / standalone, prefix_affinity, median", med, ">= 99.5 %", "99.45 %",
                     None if med is None else med >= 0.995))
    return rows


def _fmt(what: str, v: Optional[float]) -> str:
    if v is None:
        return "-"
    return f"{v:.3f}x" if "/ round_robin" in what else f"{v:.2%}"


def print_targets(run: Path, record: dict) -> bool:
    """Print one run's pair ratios and target rows; True when every target with a value is met."""
    print(f"\n{run.name}: trace {record.get('trace_preset')}, status {record.get('status')}")
    if record.get("error"):
        print(f"  FAILED: {record['error']}")
    for po, r in ((record.get("report") or {}).get("pair_ratios") or {}).items():
        pairs = ", ".join(f"{x['ratio']:.2%}" for x in r["per_pair"])
        print(f"  {r['name']}, {po}: per pair {pairs}; median {r['median']:.2%}, min {r['min']:.2%}, max {r['max']:.2%}")
    ok = True
    for what, v, target, study, met in targets(record):
        verdict = "n/a" if met is None else ("met" if met else "MISSED")
        ok = ok and met is not False
        print(f"  {what:<48} {_fmt(what, v):>9}  target {target:<10} study {study:<8} {verdict}")
    for note in record.get("notes", []):
        print(f"  note: {note}")
    return ok


def load_record(run: Path) -> Optional[dict]:
    """The run's ``locality.json`` (a run's or a merged report's); for a run cut off before it, the
    report of its finished cases (``cases.jsonl``, ``sut.locality.merge``: complete pairs only); None
    (said why) when there is neither."""
    path = run / "locality.json"
    if path.is_file():
        return json.loads(path.read_text())
    if not (run / "cases.jsonl").is_file():
        print(f"\n{run}: no locality.json or cases.jsonl (the run failed before its first case, or this is no run folder)")
        return None
    from sut.errors import BadInput
    from sut.locality.merge import build
    from sut.locality.runner import deviation_notes

    try:
        m = build([run])  # computes the pair report once (``Merged.report``)
    except BadInput as e:
        print(f"\n{run}: {e}")
        return None
    return dict(m.record, report=m.report, notes=m.record["notes"] + deviation_notes(m.cases))


def run_preset(preset: str, pairs: int, out: Path, passthrough: list[str], policies: Optional[list[str]] = None) -> Path:
    """One ``python -m sut.locality run`` for ``preset`` with the trace's policies (those of them in
    ``policies`` when given); returns its run folder."""
    name = f"bench-{preset}"
    chosen = [x for x in TRACES[preset] if not policies or x in policies]
    cmd = [sys.executable, "-m", "sut.locality", "run", "--trace-preset", preset, "--systems", "standalone", "flame",
           "--policies", *chosen, "--pairs", str(pairs), "--output-dir", str(out), "--run-name", name,
           *passthrough]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=REPO)
    return out / (name + SUFFIX)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    passthrough = argv[argv.index("--") + 1:] if "--" in argv else []
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=5, help="fresh pairs per trace (default 5, as the study)")
    p.add_argument("--traces", nargs="+", choices=sorted(TRACES), default=["study-reuse", "study-no-reuse"])
    p.add_argument("--out", default="results/bench-locality", help="output folder of the runs")
    p.add_argument("--policies", nargs="+", choices=["prefix_affinity", "round_robin"],
                   help="run only these of each trace's policies (e.g. prefix_affinity alone when device time is short)")
    p.add_argument("--check", nargs="+", metavar="RUN", help="only check finished run folders (no runs)")
    p.add_argument("--require-targets", action="store_true", help="exit 1 when a target is missed")
    a = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if a.pairs < 1:
        p.error("--pairs must be >= 1")
    runs = [Path(x) for x in a.check] if a.check else [run_preset(t, a.pairs, Path(a.out), passthrough, a.policies)
                                                       for t in a.traces]
    failed, missed = False, False
    for run in runs:
        record = load_record(run)
        if record is None:
            failed = True
            continue
        failed = failed or record.get("status") != "ok"
        missed = not print_targets(run, record) or missed
    return 1 if failed or (missed and a.require_targets) else 0


if __name__ == "__main__":
    raise SystemExit(main())
