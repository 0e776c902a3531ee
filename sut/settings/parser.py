"""``python -m sut run``'s flags: the run parser (``add_run_parser``) and ``parse_run_args``, which
``python -m sut find-qps`` uses for the arguments it passes on to each try."""

from __future__ import annotations

import argparse
import logging
from typing import Optional

from sut.base import get_sut, sut_names
from sut.constants import COMPLIANCE_TESTS, DEFAULT_MODEL_KEY, EDGE_MODEL_KEY, INTERACTIVE_MODEL_KEY
from sut.exits import ShortUsageParser
from sut.settings.flags import add_backend_flags, add_engine_flags, engine_defaults
from sut.settings.run import QUICK_MIN_DURATION_S, QUICK_MIN_QUERY_COUNT, QUICK_PERFORMANCE_SAMPLES

log = logging.getLogger("sut")


def backend_options_classes() -> dict[str, Optional[type]]:
    """Every backend's options dataclass (None: it takes none), by ``--sut`` name; a backend whose
    module cannot be imported here (e.g. no flamepy) is left out, with a debug line."""
    out = {}
    for name in sut_names():
        try:
            out[name] = get_sut(name).options_cls()
        except (ImportError, KeyError) as e:
            log.debug("--sut %s is not available here (%s): no flags for it", name, e)
    return out


def add_run_parser(sub) -> argparse.ArgumentParser:
    """``python -m sut run``'s parser, added to the subparsers ``sub`` (``python -m sut`` and ``find-qps``), and
    returned."""
    p = sub.add_parser(
        "run",
        help="run one LoadGen test through a SUT",
        description="Run LoadGen (Offline, Server or Interactive) through a system-under-test and write LoadGen "
                    "logs + run.json.\n\n"
                    "Example:\n  python -m sut run --sut vllm --mode performance --model MODEL_DIR "
                    "--dataset cnn_eval.json --output-dir results",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", help="preset TOML (loadgen_configs/*.toml); flags override it")
    g = p.add_argument_group("run")
    g.add_argument("--sut", help=f"system-under-test: {', '.join(sut_names())} (default vllm)")
    g.add_argument("--scenario", help="Offline (default), Server or Interactive (= a LoadGen Server run with model "
                                      f"key {INTERACTIVE_MODEL_KEY}: TTFT 500 ms / TPOT 30 ms); spelt exactly so")
    g.add_argument("--mode", choices=["performance", "accuracy"], help="performance (default) or accuracy")
    g.add_argument("--dataset", help="cnn_eval-format JSON (validated before LoadGen starts)")
    g.add_argument("--output-dir", help="base folder for run folders (default results)")
    g.add_argument("--user-conf", help="LoadGen user.conf, read once via FromConfig (default ./user.conf)")
    g.add_argument("--model-key", help=f"LoadGen model key (default: {DEFAULT_MODEL_KEY}; Interactive: "
                                       f"{INTERACTIVE_MODEL_KEY}; {EDGE_MODEL_KEY}: Offline only)")
    g.add_argument("--run-name", help="run folder name (default <time>-<sut>-<scenario>-<mode>); a run that is not compliant gets "
                   "-NOT-COMPLIANT appended")
    g.add_argument("--audit-config", help="LoadGen audit config, e.g. TEST06's audit.config (never read implicitly)")
    g.add_argument("--compliance-test", choices=COMPLIANCE_TESTS,
                   help="MLPerf compliance test: TEST06 = loadgen_configs/TEST06/audit.config, then the TEST06 "
                        "checks; writes <run>/TEST06/verify_accuracy.txt, fails the run if a check fails")
    g.add_argument("--tokenizer", help="tokenizer for the accuracy gate (default: the model folder); an accuracy "
                                       "run with none exits 2 before it starts")
    g.add_argument("--no-accuracy-gate", action="store_true", help="do not score an accuracy-mode run")
    g.add_argument("--enable-trace", action="store_true", help="write LoadGen's (large) trace log")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument("--stall-timeout-s", type=float,
                   help="fail the run (exit 1) when no sample completes for this many seconds while samples are "
                        "outstanding: a stopped engine or a server that no longer answers (default 300)")
    g.add_argument("-v", "--verbose", dest="run_verbose", action="store_true",
                   help="debug logging, and vLLM's own output (its logs, warnings, the harmless 'Chat template warmup "
                        "failed' traceback) on the console instead of RUN/engine-N.log")
    q = p.add_argument_group("dev overrides (each makes the run NOT compliant)")
    q.add_argument("--quick", action="store_true",
                   help=f"short dev run: min duration {QUICK_MIN_DURATION_S:g} s and min query count "
                        f"{QUICK_MIN_QUERY_COUNT} (unless given), at most {QUICK_PERFORMANCE_SAMPLES} performance "
                        "samples (Offline: one query of about that duration x target_qps samples, not the whole "
                        "dataset)")
    q.add_argument("--max-samples", type=int, help="use only the first N dataset records")
    q.add_argument("--min-duration-s", type=float, help="override LoadGen min duration")
    q.add_argument("--min-query-count", type=int, help="override LoadGen min query count")
    q.add_argument("--target-qps", type=float, help="Offline: expected samples/s; Server/Interactive: queries/s "
                                                    "(normally in user.conf)")
    q.add_argument("--benchmark-ignore-eos", action="store_true",
                   help="benchmark only: always generate 128 tokens (dummy weights emit EOS at random)")
    add_engine_flags(p.add_argument_group("engine (vLLM; a preset's [engine] replaces these defaults)"),
                     defaults=engine_defaults())
    b = p.add_argument_group("SUT backend options (each backend's own flags follow, one group per --sut)")
    b.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="backend option (repeatable; the value is read as JSON, else as a string), e.g. batch_size=64 "
                        "for --sut flame; checked by the backend's options dataclass")
    add_backend_flags(p, backend_options_classes())
    return p


def parse_run_args(args: list[str]) -> argparse.Namespace:
    """``args`` (``python -m sut run``'s flags, without ``run``) parsed as ``python -m sut run`` parses them;
    argparse exits 2 on bad flags."""
    p = ShortUsageParser(prog="python -m sut")
    run = add_run_parser(p.add_subparsers(dest="cmd", required=True))
    a, extra = p.parse_known_args(["run", *args])
    if extra:  # named by run's parser (its usage), not by the top one's "python -m sut [-h] {run}"
        run.error(f"unrecognized arguments: {' '.join(extra)}")
    return a
