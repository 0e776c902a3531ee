"""Find the highest Server / Interactive ``target_qps`` that LoadGen calls VALID and that does not build a backlog.

Each try is one short LoadGen test at one ``target_qps`` with its own run folder and ``run.json``, exactly as
``python -m sut run`` writes them; ``run.json`` gives LoadGen's verdict (``result_validity``: in Server also
the p99 TTFT/TPOT limits and early stopping) and the p99s. The search grows (x ``--factor``) from ``--start``
until a try is INVALID, or shrinks until one is VALID, then bisects between the highest VALID and the lowest
INVALID value until they are within ``--rel-tol`` or ``--max-runs`` tries are spent. It logs each try as it
starts and as it ends (qps, validity, TTFT/TPOT p99, tokens/s, wall time), then prints every try, the result,
the user.conf line for it and, when not converged, the whole command that goes on with ``--resume``.

``--one-process`` (default): every try runs in this process over one engine start (``sut.run.series``: a fresh
SUT object and ledger per try; the first try's LoadGen settings copied for the next with only ``target_qps``
changed; each ``run.json`` says "try N of a one-process target_qps search: engine warm from earlier tries";
the engine logs are in the first try's folder). A try that fails (engine death, a sample never answered, a
ledger error) is logged as a failed try and ends the search with exit 1 (Ctrl-C: 130), engines stopped.
``--fresh-process``: each try is one ``python -m sut run`` process (the engines start for every try); a try
past ``--timeout-s`` is stopped (SIGTERM, then SIGKILL of its process group ``sut_runs.TIMEOUT_GRACE_S``
later). In both modes a failed try is no LoadGen verdict: it is recorded (validity null, no p99s) but
bounds nothing, the search stops with exit 1, and a resumed search makes that try again. So does a try that
LoadGen calls INVALID only for early stopping, with every p99 under its limit and at most as many queries again
needed, or ``FEW_QUERIES`` in all (``find_qps_try``, ``sut.record.read.early_stopping_shortfall``): too few queries
is no verdict on the rate (the note says which ``--min-query-count`` to search with, in a new log); needing more
than that, it counts as INVALID ("near the bound"). An INVALID try's
note names the checks it failed. Every try is a
performance run: ``--mode accuracy``, ``--compliance-test`` or ``--audit-config`` after ``--`` (or in the
preset) is refused (exit 2) before any try.

A short try can end VALID at a target the SUT cannot keep up with: the backlog (and TTFT) grows by a few ms each
second, which LoadGen's p99 shows only once the run is long. The harness measures that trend
(``sut.record.latency_trend``, ``run.json`` ``latency.harness.ttft_trend``); a VALID try whose TTFT would pass the
limit within 600 s at that rate is marked GROWING (``Try.queue_growing``, a note says by how much) and bounds
the search from above like an INVALID one, unless ``--allow-queue-growth`` (LoadGen's verdict alone). A try
shorter than ~12 times what a query holds its sequence slot for (first token to last) is not judged (its note
says how long it needed to be; ~110 s for Server on one H200): then only LoadGen's verdict counts, and near the
bound it can be optimistic. On one H200 tries of ~37 s found Server 55.5 VALID; the 600 s run at 55 failed on
TTFT (docs/benchmarks.md).

Early stopping needs enough queries: with every query under the limits LoadGen wants about 460 at
p99 ("Would need to run at least N more queries"), so a short try needs ``--min-query-count`` of
several hundred (default 1,000) even when ``--min-duration-s`` is small. Short tries are dev runs
(marked not compliant); confirm the value with one full-length run (600 s, user.conf line, no
overrides) before submitting.

Equal issue: LoadGen rounds a try's query count UP to a whole multiple of the performance sample count
(mlperf.conf's ``sample_concatenate_permutation = 1``; the count is the dataset's samples after
``--max-samples``, at most mlperf.conf's 13,368), so on the full cnn_eval set every try issues >= 13,368
queries whatever ``--min-query-count`` says; the search warns before it starts. Pass ``--max-samples N``
after ``--`` (N about ``--min-query-count``) or a smaller dataset for short tries.

Example (one H200, fp8, Server; the first 1,000 samples, so that a try is not 13,368 queries):
    python -m sut find-qps --scenario Server --start 40 -- --config loadgen_configs/h200_fp8.toml \
        --model MODEL --dataset cnn_eval.json --max-samples 1000
CPU try-out (tiny model; the 64-sample set ``python -m sut demo`` writes; small settings):
    python -m sut find-qps --scenario Server --start 4 --min-duration-s 5 --min-query-count 500 --max-runs 4 \
        -- --config loadgen_configs/cpu_tiny.toml --dataset results/demo/data/synthetic_64.json
Everything after ``--`` is ``python -m sut run``'s arguments, less those find-qps sets for every try
(``OWN_RUN_FLAGS``, abbreviated too: exit 2 naming them before any try).

Resumable, cut-off safe: each try is appended to a JSONL file (``--log``, default
``OUTPUT_DIR/tries-SCENARIO.jsonl``; one object a line: qps, validity, TTFT/TPOT p99 ms, tokens/s,
wall_s, folder, the search settings) as soon as it ends, so a search killed mid-try (a device session
running out) loses only that try. ``--resume FILE`` takes the tries in FILE as made and goes on from
their bounds (highest VALID, lowest INVALID), appending to FILE (or to ``--log B``, which then gets FILE's
tries first; a non-empty B other than FILE is refused, exit 2); tries made with other settings
(scenario, min duration, min query count, run arguments) are refused (exit 2), as is a log path that cannot
be written (``sut.data.paths.check_output_path``) or a try above a run's ``MAX_TARGET_QPS`` (1e7); a search whose
next rate is above that cap stops (exit 1, ``AboveCap``) with no resume command. ``--budget-s S`` starts
no try that would, at the longest try's pace so far (scaled up for a try at a lower rate than the tries it
is estimated from; ``find_qps_search.Budget``: a one-process search's engine
start counts only until a try without it has run), end more than S seconds after the search began.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

from sut.data.paths import check_output_path
from sut.errors import InputError
from sut.exits import ShortUsageParser
from sut.findqps.attempt import NO_VERDICT, sut_run_settings, sut_try, try_from_record
from sut.findqps.checks import check_first_qps, check_performance_tries, equal_issue_warning
from sut.findqps.report import fmt_bound, fmt_qps, log_how_to_go_on, report, try_line
from sut.findqps.search import DEFAULT_MAX_RUNS, AboveCap, Budget, Try, TryLog, bounds, check_search_args, search
from sut.run.child import TIMEOUT_GRACE_S, split_run_args
from sut.scenarios import STREAMING_SCENARIOS

log = logging.getLogger("find_qps")


class TryFailed(Exception):
    """A try that failed in a way that ends the search (one-process mode): ``try_`` goes to the log, then
    ``cause`` is raised."""

    def __init__(self, t: Try, cause: BaseException):
        super().__init__(str(cause))
        self.try_, self.cause = t, cause


class FreshProcessTries:
    """``tries(qps) -> Try``: each try one ``python -m sut run`` process (``sut_try``). ``prepare()`` parses
    ``run_args`` as that run does (bad input: ``BadInput``, exit 2) and counts the dataset's samples."""

    #: Every try starts its own engines, so each one's time is the pace (``Budget``).
    started_engines = False

    def __init__(self, a, run_args: list[str]):
        self.a, self.run_args, self.out = a, run_args, Path(a.output_dir).resolve()

    def prepare(self):
        """``(RunSettings, samples)``: the tries' run settings and the dataset's samples after ``--max-samples``."""
        from accuracy.dataset import DatasetFileError, read_dataset_json
        from sut.errors import BadInput

        a = self.a
        rs = sut_run_settings(a.scenario, self.out, self.run_args, a.min_duration_s, a.min_query_count)[0]
        try:
            n = len(read_dataset_json(rs.dataset))
        except DatasetFileError as e:
            raise BadInput(f"error: {e}") from None
        return rs, min(n, rs.max_samples or n)

    def __call__(self, q: float) -> Try:
        """The try at ``q``; a failed one (exit 1, a time-out) raises ``TryFailed`` (``RunFailed``: exit 1)."""
        from sut.errors import RunFailed

        a = self.a
        t = sut_try(a.scenario, q, self.out, self.run_args, a.min_duration_s, a.min_query_count, a.timeout_s)
        if t.validity is None:
            raise TryFailed(t, RunFailed(t.note))
        return t

    def close(self) -> None:
        """Nothing runs between tries."""


class OneProcessTries:
    """``tries(qps) -> Try`` over one engine start (``sut.run.series``). ``prepare()`` parses ``run_args`` as
    ``python -m sut run`` does and checks everything (bad input: exit 2, nothing started); the engines start
    with the first test. A try that fails raises ``TryFailed`` (Ctrl-C: its ``RunFailed``); ``close()`` stops
    the engines."""

    def __init__(self, a, run_args: list[str], first_try: int = 1):
        self.a, self.run_args, self.out = a, run_args, Path(a.output_dir).resolve()
        self.series = None
        self.first_try = first_try  # this process's first try's number in the search (after resumed ones)

    @property
    def started_engines(self) -> bool:
        """The last try started the engines (its time includes that; ``Budget``)."""
        return self.series is not None and self.series.tests == 1

    def prepare(self):
        """``(RunSettings, samples)``: the series' run settings and its dataset's samples (after
        ``--max-samples``); dataset and settings checked, nothing started."""
        from sut.run.series import SUTSeries

        if self.series is None:
            a = self.a
            *settings, command = sut_run_settings(a.scenario, self.out, self.run_args, a.min_duration_s,
                                                  a.min_query_count, progress=sys.stderr.isatty())
            self.series = SUTSeries(*settings, command=command)
        return self.series.rs, len(self.series.dataset)

    def __call__(self, q: float) -> Try:
        from sut.errors import EngineError, InputError, RunFailed
        from sut.exits import interrupted

        a = self.a
        self.prepare()
        name, t0 = f"{time.strftime('%Y%m%d-%H%M%S')}-findqps-{a.scenario}-{q:g}", time.monotonic()
        try:
            rec = self.series.run(q, name, search_try=self.first_try + self.series.tests)
        except InputError:
            raise
        except (RunFailed, EngineError) as e:
            folder = next(self.out.glob(name + "*"), None)
            if interrupted() or folder is None or not (folder / "run.json").is_file():
                raise
            rec = json.loads((folder / "run.json").read_text())
            raise TryFailed(try_from_record(q, rec, False, folder, time.monotonic() - t0,
                                            f"run failed: {rec.get('error')}"), e) from e
        t = try_from_record(q, rec, True, rec["output_dir"], time.monotonic() - t0)
        if t.validity is None:  # no verdict (early stopping needed more queries): as a failed try
            raise TryFailed(t, RunFailed(t.note))
        return t

    def close(self) -> None:
        if self.series is not None:
            self.series.close()


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` with every option's default, except where there is none (None) or the option is a switch."""

    def _get_help_string(self, action):
        if action.default is None or action.nargs == 0:
            return action.help
        return super()._get_help_string(action)


def _parser() -> argparse.ArgumentParser:
    p = ShortUsageParser(prog="python -m sut find-qps", description=__doc__.split("\n\n")[0],
                         formatter_class=_HelpFormatter,
                         epilog="Arguments after -- go to python -m sut run (model, dataset, preset, ...).")
    p.add_argument("--scenario", required=True, choices=sorted(STREAMING_SCENARIOS),
                   help="LoadGen scenario of every try")
    p.add_argument("--start", type=float, help="first target_qps to try (queries/s); needed unless --resume has tries")
    p.add_argument("--factor", type=float, default=2.0, help="growth/shrink factor while bracketing, in (1, 100]")
    p.add_argument("--rel-tol", type=float, default=0.05, help="stop when highest VALID and lowest INVALID are "
                                                                "within this fraction")
    p.add_argument("--max-runs", type=int, default=DEFAULT_MAX_RUNS, help="at most this many new tries")
    p.add_argument("--min-duration-s", type=float, default=120.0,
                   help="LoadGen min duration of each try (s); shorter tries are not judged for queue growth and "
                        "overestimate (docs/scenarios.md section 3, docs/submission.md section 3)")
    p.add_argument("--min-query-count", type=int, default=1000,
                   help="LoadGen min query count of each try (early stopping needs several hundred; LoadGen "
                        "rounds it up to a whole multiple of the dataset's sample count)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--one-process", dest="fresh_process", action="store_false",
                      help="(default) every try in this process over one engine start (sut.series)")
    mode.add_argument("--fresh-process", dest="fresh_process", action="store_true",
                      help="every try a fresh python -m sut run process (the engines start for each try)")
    p.set_defaults(fresh_process=False)
    p.add_argument("--timeout-s", type=float, default=3600.0,
                   help="--fresh-process only: stop a try after this many seconds (SIGTERM; SIGKILL of its "
                        f"process group {TIMEOUT_GRACE_S:g} s later); one-process mode ignores it (there a try fails "
                        "when no sample completes for the run's stall timeout, RunSettings.stall_timeout_s)")
    p.add_argument("--output-dir", default="results/find_qps", help="where the tries' run folders go")
    p.add_argument("--log", type=Path, help="JSONL file each finished try is appended to at once "
                                            "(default: the --resume file, else OUTPUT_DIR/tries-SCENARIO.jsonl)")
    p.add_argument("--resume", type=Path, help="go on from the tries recorded in this JSONL file (same settings); "
                                               "default: none (a new search)")
    p.add_argument("--allow-queue-growth", action="store_true",
                   help="count a VALID try as VALID even when its TTFT backlog was growing (default: it bounds the "
                        "search from above, as a 600 s run at that target would fail on TTFT)")
    p.add_argument("--budget-s", type=float, help="start no try that would end later than this many seconds "
                                                  "after the search began (at the longest try's pace, scaled for a "
                                                  "lower rate; default: no limit)")
    return p


#: ``python -m sut run``'s flags that find_qps sets itself for every try, with their ``argparse`` dests.
OWN_RUN_FLAGS = {"--min-duration-s": "min_duration_s", "--min-query-count": "min_query_count",
                 "--output-dir": "output_dir", "--run-name": "run_name", "--scenario": "scenario",
                 "--target-qps": "target_qps"}


def own_run_flags_given(run_args: list[str]) -> list[str]:
    """Which of :data:`OWN_RUN_FLAGS` ``run_args`` (the arguments after ``--``) gives, sorted: parsed as ``python -m
    sut run`` parses them, so an abbreviation (``--output D``) and ``--flag=value`` count, and a value that only looks
    like one of them (``--option=note=--scenario``) does not. A flag the run does not know exits 2 here
    (argparse's message), before any try."""
    from sut.settings.parser import parse_run_args

    ns = parse_run_args(run_args)
    return [f for f, dest in OWN_RUN_FLAGS.items() if getattr(ns, dest) is not None]


def _setup(argv):
    """Parse and check everything (exit 2 before any try): ``(args, run args, earlier tries, try log, budget)``."""
    argv, run_args = split_run_args(argv)
    p = _parser()
    a = p.parse_args(argv)
    given = own_run_flags_given(run_args)
    if given:
        p.error(f"{', '.join(given)} after --: find-qps sets {'them' if len(given) > 1 else 'it'} for every try "
                "(each try's folder is named by find-qps, its target_qps by --start and the search); give --scenario, "
                "--min-duration-s, --min-query-count and --output-dir to find-qps itself, before --")
    out = Path(a.output_dir)
    settings = {"scenario": a.scenario, "min_duration_s": a.min_duration_s, "min_query_count": a.min_query_count,
                "run_args": run_args}
    prior: list[Try] = []
    if a.resume is not None:
        if not a.resume.is_file():
            p.error(f"--resume {a.resume}: " + ("not a regular file" if a.resume.exists() else "no such file"))
        try:
            prior = TryLog(a.resume, settings).read()
        except (ValueError, OSError) as e:
            p.error(f"--resume: {e}")
    try:
        check_search_args(a.start, a.factor, a.rel_tol, a.max_runs, prior)
    except ValueError as e:
        p.error(str(e))
    for name in ("budget_s", "timeout_s"):
        v = getattr(a, name)
        if v is not None and not (v > 0 and v != float("inf")):
            p.error(f"--{name.replace('_', '-')} {v:g}: must be a number of seconds > 0")
    if a.budget_s is not None and a.budget_s < a.min_duration_s:  # no try could end within it
        p.error(f"--budget-s {a.budget_s:g}: below --min-duration-s {a.min_duration_s:g}, the least a try takes")
    seed = None
    if a.resume is not None and a.log is not None and a.log.resolve() != a.resume.resolve():
        if a.log.is_file() and a.log.stat().st_size:
            p.error(f"--log {a.log} already holds tries and is not the --resume file {a.resume}: go on from it "
                    f"with --resume {a.log} (no --log), or give a new or empty --log file (it gets {a.resume}'s "
                    "tries first)")
        seed = a.resume
    trylog = TryLog(a.log or a.resume or out / f"tries-{a.scenario}.jsonl", settings, seed)
    flag = "--log" if a.log or not a.resume else "--resume"
    default = "" if a.log or a.resume else f" (--log's default, under --output-dir {a.output_dir})"
    try:  # the first try's end writes it: a path that cannot be written ends the search now, not then
        check_output_path(trylog.path, flag)
        if a.resume is None:  # a --resume file was read whole above; a --log beside it must be empty
            trylog.check_appendable()  # a file that is no try log is not appended to (nor trimmed)
    except ValueError as e:
        p.error(f"{flag}: {e}{default}")
    except InputError as e:
        p.error(f"{e}{default}")
    return a, run_args, prior, trylog, Budget(a.budget_s, prior)


def main(argv=None) -> int:
    a, run_args, prior, trylog, budget = _setup(argv)
    from sut.exits import run_main, stop_on_sigterm_like_ctrl_c

    tries = FreshProcessTries(a, run_args) if a.fresh_process else OneProcessTries(a, run_args, len(prior) + 1)

    def go() -> int:
        stop_on_sigterm_like_ctrl_c()  # fresh-process: the run has its own session; sut_runs stops it on the way out
        if not a.fresh_process:
            os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO")  # vLLM's own lines go to the engine logs
        try:
            return _search(a, tries, prior, trylog, budget, run_args)
        finally:
            tries.close()  # the engines stop once, also after a failed try or Ctrl-C

    return run_main(go, messages={"failed": "search failed: {}", "stopped": "search stopped: {}"}, logger=log)


def _search(a, make_try, prior: list[Try], trylog: TryLog, budget: Budget,
            run_args: list[str]) -> int:
    """Run the search with ``make_try`` (a ``FreshProcessTries`` / ``OneProcessTries``: ``prepare()`` before the
    first new try, for ``check_performance_tries`` and ``equal_issue_warning``, then one call per try), logging
    each try as it starts and ends and appending every finished try to ``trylog`` at once, and report.
    ``TryFailed``: the failed try is appended (it bounds nothing), then its cause raised; on any stop but bad
    input the resume command is logged."""
    made = list(prior)

    def one(q: float) -> Try:
        n = len(made) + 1
        if n == len(prior) + 1:  # before the first new try: settings and dataset checked, nothing started
            rs, samples = make_try.prepare()
            check_performance_tries(rs)
            check_first_qps(rs, q, "--start" if not prior else f"the next target_qps after {a.resume}'s tries,")
            warning = equal_issue_warning(rs, samples, a.min_query_count, q)
            if warning:
                log.warning("%s", warning)
        lo, hi = bounds(made, a.allow_queue_growth)
        log.info("try %d: target_qps %g queries/s (highest VALID %s, lowest INVALID %s; at most %d new tries) ...",
                 n, q, fmt_qps(lo), fmt_bound(hi, made, a.allow_queue_growth), a.max_runs)
        try:
            t = make_try(q)
        except TryFailed as e:
            trylog.append(budget.note(e.try_, make_try.started_engines))
            made.append(e.try_)
            log.error("try %d: %s", n, try_line(e.try_))
            log.error("the try at %g queries/s failed; the search stops", q)
            raise e.cause from None
        trylog.append(budget.note(t, make_try.started_engines))
        made.append(t)
        log.info("try %d: %s", n, try_line(t))
        return t

    # the run folders and the log's folder are made by the first try, after every check
    try:
        best, tries = search(one, a.start, a.factor, a.rel_tol, a.max_runs, prior, budget.may_start,
                             a.allow_queue_growth)
    except BaseException as e:  # a failed try, Ctrl-C / SIGTERM: say how to go on (not for bad input), then the
        from sut.exits import EXIT_BAD_INPUT, exit_code  # exit-code map

        if exit_code(e) != EXIT_BAD_INPUT:
            trylog.seed()
            if made and made[-1].note.startswith(NO_VERDICT):  # resuming this log would make the same try
                log.error("the search stopped: %s", made[-1].note)
            elif isinstance(e, AboveCap):  # resuming cannot go on either
                log.error("every try is in %s", trylog.path)
            else:
                log_how_to_go_on(a, run_args, trylog.path, len(made) - len(prior))
        raise
    trylog.seed()
    return report(a, tries, best, len(prior), trylog.path, run_args)
