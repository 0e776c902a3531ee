"""Compare SUTs side by side on the same prompts and load: ``--sut`` A vs B (vs C ...), alternating.

Each round runs every SUT once (the order rotates from round to round, so a drift of the machine
does not favour one SUT), each as its own ``python -m sut run`` with the same arguments (after
``--``) plus ``--sut NAME`` and the SUT's extra arguments (``--extra NAME="ARGS"``). It prints one
line per run, then each SUT's median output tokens/s and its ratio to the first SUT's median, and
writes ``summary.json``. A run that fails or is INVALID is reported and makes the exit code 1.

Example (one H200, fp8: the vllm-http figure of docs/benchmarks.md):
    python scripts/bench_suts.py --suts vllm vllm-http --rounds 2 --out results/bench_suts -- \\
        --config loadgen_configs/h200_fp8.toml --model MODEL --load-format dummy --dataset cnn_eval.json \\
        --target-qps 56 --min-duration-s 40 --min-query-count 1 --benchmark-ignore-eos
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sut_runs import run_once, split_run_args  # noqa: E402

log = logging.getLogger("bench_suts")


def rounds_order(suts: list[str], rounds: int) -> list[tuple[int, str]]:
    """``(round, sut)`` in run order: round k starts at SUT ``k mod n``."""
    n = len(suts)
    return [(k, suts[(k + i) % n]) for k in range(rounds) for i in range(n)]


def summarize(runs: list[dict], suts: list[str]) -> dict:
    """Median tokens/s per SUT over its good runs, and its ratio to the first SUT's median."""
    med = {}
    for s in suts:
        vals = [r["tokens_per_s"] for r in runs if r["sut"] == s and r["ok"]]
        med[s] = statistics.median(vals) if vals else None
    base = med[suts[0]]
    return {s: {"median_tokens_per_s": med[s], "runs": sum(r["sut"] == s and r["ok"] for r in runs),
                "ratio_to_" + suts[0]: round(med[s] / base, 4) if med[s] and base else None} for s in suts}


def main(argv=None) -> int:
    argv, run_args = split_run_args(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--suts", nargs="+", required=True, help="SUT names; ratios are to the first")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--extra", action="append", default=[], metavar='NAME="ARGS"', help="extra run args of one SUT")
    p.add_argument("--out", default="results/bench_suts")
    p.add_argument("--timeout-s", type=float, default=3600.0)
    a = p.parse_args(argv)
    if a.rounds < 1 or len(set(a.suts)) != len(a.suts):
        p.error("--rounds must be >= 1 and --suts distinct")
    extra = {}
    for e in a.extra:
        name, _, args = e.partition("=")
        if name not in a.suts:
            p.error(f"--extra {name}: not one of --suts")
        extra[name] = shlex.split(args)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    for k, s in rounds_order(a.suts, a.rounds):
        name = f"{time.strftime('%H%M%S')}-{s}-r{k}"
        o = run_once([*run_args, "--sut", s, *extra.get(s, [])], out, name, a.timeout_s)
        rec = o.record or {}
        ok = o.rc == 0 and rec.get("validity") in ("VALID", None) and rec.get("tokens_per_s")
        runs.append({"round": k, "sut": s, "ok": bool(ok), "rc": o.rc, "tokens_per_s": rec.get("tokens_per_s"),
                     "validity": rec.get("validity"), "folder": str(o.folder), "error": rec.get("error") or
                     (None if ok else o.stderr[-500:])})
        log.info("round %d %-10s rc=%s %s tok/s %s", k, s, o.rc, rec.get("tokens_per_s"), rec.get("validity"))
    summary = {"suts": a.suts, "rounds": a.rounds, "run_args": run_args, "runs": runs, "summary": summarize(runs, a.suts)}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    for s, v in summary["summary"].items():
        log.info("%-10s median %s tok/s, ratio to %s %s (%d good run(s))", s, v["median_tokens_per_s"], a.suts[0],
                 v["ratio_to_" + a.suts[0]], v["runs"])
    return 0 if all(r["ok"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
