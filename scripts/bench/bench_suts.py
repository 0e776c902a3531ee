"""Compare SUTs side by side on the same prompts and load: ``--sut`` A vs B (vs C ...), alternating.

Each round runs every SUT once (the order rotates from round to round, so a drift of the machine
does not favour one SUT), each as its own ``python -m sut run`` with the same arguments (after
``--``) plus ``--sut NAME`` and the SUT's extra arguments (``--extra NAME="ARGS"``). An entry of
``--suts`` may also be a variant label: ``--variant "LABEL=ARGS"`` runs LABEL with ARGS in place of
``--sut LABEL`` (ARGS name the SUT once: ``--sut NAME ...``; LABEL is no SUT's name), so one session
can compare one SUT under several settings. It prints one line per run, then each entry's median
output tokens/s and its ratio to the first entry's median, and writes ``summary.json`` (labels, each
label's run arguments, runs).
A run that fails or is INVALID is reported and makes the exit code 1.

Example (one H200, fp8: the vllm-http figure of docs/benchmarks.md):
    python scripts/bench/bench_suts.py --suts vllm vllm-http --rounds 2 --out results/bench_suts -- \\
        --config loadgen_configs/h200_fp8.toml --model MODEL --load-format dummy --dataset cnn_eval.json \\
        --target-qps 56 --min-duration-s 40 --min-query-count 1 --benchmark-ignore-eos
    # the same, isolating vLLM's request statistics in the servers:
    python scripts/bench/bench_suts.py --suts vllm vllm-http vllm-http+stats \\
        --variant "vllm-http+stats=--sut vllm-http --server-log-stats" --rounds 2 --out ... -- ...
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import shlex
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without an install (GPU host)
from sut.base import sut_names  # noqa: E402
from sut.run.child import cpu_noise_note, run_once, split_run_args  # noqa: E402

log = logging.getLogger("bench_suts")


LABEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")


def _names_sut(args: list[str]) -> bool:
    return any(a == "--sut" or a.startswith("--sut=") for a in args)


def _variant_sut(label: str, args: list[str]) -> str:
    """The one SUT a variant's ARGS name (``--sut NAME`` or ``--sut=NAME``); ``ValueError`` if they
    name none, an empty one or more than one."""
    names = [a[len("--sut="):] if a.startswith("--sut=") else (args[i + 1] if i + 1 < len(args) else "")
             for i, a in enumerate(args) if a == "--sut" or a.startswith("--sut=")]
    if len(names) != 1 or not names[0] or names[0].startswith("-"):
        raise ValueError(f"--variant {label}: its ARGS must name the SUT exactly once (--sut NAME ...), "
                         f"got {shlex.join(args)!r}")
    return names[0]


def entry_args(suts: list[str], variants: list[str], extras: list[str]) -> dict[str, list[str]]:
    """Each ``--suts`` entry's run arguments: ``--variant LABEL=ARGS`` gives ARGS (they must name the
    SUT exactly once with ``--sut``; LABEL may not be a SUT's name, so a label never runs another SUT
    than its name says), a plain entry ``--sut ENTRY``; ``--extra NAME=ARGS`` appends to NAME's (ARGS
    without ``--sut``). ``ValueError`` for a bad or repeated label, a variant or extra of no entry, a
    variant labelled with a SUT's name or not naming one SUT, an extra naming a SUT."""
    if len(set(suts)) != len(suts):
        raise ValueError("--suts must be distinct")
    bad = [s for s in suts if not LABEL.match(s)]
    if bad:
        raise ValueError(f"--suts {bad[0]!r}: a label is letters, digits and . _ + - (no spaces)")
    defined: dict[str, list[str]] = {}
    for v in variants:
        label, sep, args = v.partition("=")
        label = label.strip()
        if not sep or label not in suts:
            raise ValueError(f"--variant {v!r}: expected LABEL=ARGS with LABEL one of --suts")
        if label in defined:
            raise ValueError(f"--variant {label}: given twice")
        if label in sut_names():
            raise ValueError(f"--variant {label}: a variant label may not be a SUT's name (e.g. {label}+v1)")
        defined[label] = shlex.split(args)
        _variant_sut(label, defined[label])
    out = {s: defined.get(s, ["--sut", s]) for s in suts}
    for e in extras:
        name, _, args = e.partition("=")
        if name not in out:
            raise ValueError(f"--extra {name}: not one of --suts")
        if _names_sut(shlex.split(args)):
            raise ValueError(f"--extra {name}: must not name --sut (use --variant LABEL=\"--sut NAME ...\")")
        out[name] = out[name] + shlex.split(args)
    return out

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
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                usage="%(prog)s --suts A B ... [options] -- RUN_ARGS (for `python -m sut run`, "
                                      "paths relative to the repository root)")
    p.add_argument("--suts", nargs="+", required=True, help="SUT names or --variant labels; ratios are to the first")
    p.add_argument("--variant", action="append", default=[], metavar='LABEL="--sut NAME ARGS"',
                   help="a labelled entry of --suts and its run args (e.g. vllm-http+stats=\"--sut vllm-http "
                        "--server-log-stats\")")
    p.add_argument("--rounds", type=int, default=2, help="rounds; each runs every entry once (default 2)")
    p.add_argument("--extra", action="append", default=[], metavar='NAME="ARGS"', help="extra run args of one entry")
    p.add_argument("--out", default="results/bench_suts", help="folder of the run folders and summary.json "
                   "(default results/bench_suts)")
    p.add_argument("--timeout-s", type=float, default=3600.0, help="limit of one run in seconds (default 3600)")
    a = p.parse_args(argv)
    if a.rounds < 1:
        p.error("--rounds must be >= 1")
    if not run_args:
        p.error("give the run args after -- (e.g. -- --model M --dataset D ...): they go to `python -m sut run`")
    if _names_sut(run_args):
        p.error("the run args after -- must not name --sut (give it with --suts / --variant)")
    try:
        args_of = entry_args(a.suts, a.variant, a.extra)
    except ValueError as e:
        p.error(str(e))
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    runs, records, width = [], [], max(10, *map(len, a.suts))
    for k, s in rounds_order(a.suts, a.rounds):
        name = f"{time.strftime('%H%M%S')}-{s}-r{k}"
        log.info("round %d %s: running (run name %s, in %s)", k, s, name, out)
        o = run_once([*run_args, *args_of[s]], out, name, a.timeout_s)
        rec = o.record or {}
        records.append(rec)
        ok = o.rc == 0 and rec.get("validity") in ("VALID", None) and rec.get("tokens_per_s")
        runs.append({"round": k, "sut": s, "args": args_of[s], "ok": bool(ok), "rc": o.rc,
                     "tokens_per_s": rec.get("tokens_per_s"),
                     "validity": rec.get("validity"), "folder": str(o.folder), "error": rec.get("error") or
                     (None if ok else o.stderr[-500:])})
        log.info("round %d %-*s rc=%s %s tok/s %s (%s)", k, width, s, o.rc, rec.get("tokens_per_s"),
                 rec.get("validity"), o.folder)
        if not ok and o.rc == 0 and rec.get("validity") not in ("VALID", None):
            log.info("  not counted: LoadGen said %s (a ratio needs VALID runs: on idle cores a --quick run can end "
                     "before its minimum duration; raise --target-qps so that it issues more)", rec.get("validity"))
        elif not ok:
            last = (runs[-1]["error"] or "").strip().splitlines()
            log.info("  %s", last[-1] if last else "no error text (see the run folder)")
    summary = {"suts": a.suts, "entry_args": args_of, "rounds": a.rounds, "run_args": run_args, "runs": runs,
               "summary": summarize(runs, a.suts)}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    for s, v in summary["summary"].items():
        med, ratio = v["median_tokens_per_s"], v["ratio_to_" + a.suts[0]]
        log.info("%-*s median %s tok/s, ratio to %s %s (%d good run(s))", width, s,
                 "-" if med is None else f"{med:,.1f}", a.suts[0], "-" if ratio is None else f"{ratio:.4f}", v["runs"])
    note = cpu_noise_note(records)
    if note:
        log.info("%s", note)
    log.info("runs and summary.json in %s", out)
    return 0 if all(r["ok"] for r in runs) else 1


def _main_stoppable() -> int:
    """``main`` with SIGTERM taken as Ctrl-C: either stops the run in progress (its own session: ``sut_runs``);
    exit codes from ``sut.exits`` (Ctrl-C / SIGTERM: 130)."""
    from sut.exits import run_main, stop_on_sigterm_like_ctrl_c

    stop_on_sigterm_like_ctrl_c()
    return run_main(main, messages={"interrupted": "interrupted ({}); the run in progress was stopped too"},
                    logger=log)


if __name__ == "__main__":
    sys.exit(_main_stoppable())
