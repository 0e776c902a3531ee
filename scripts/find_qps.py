"""Find the highest Server / Interactive ``target_qps`` that LoadGen calls VALID (issue 14).

Each try is one short LoadGen test at one ``target_qps`` with its own run folder and ``run.json``, exactly as
``python -m sut run`` writes them; ``run.json`` gives LoadGen's verdict (``result_validity``: in Server also
the p99 TTFT/TPOT limits and early stopping) and the p99s. The search grows (x ``--factor``) from ``--start``
until a try is INVALID, or shrinks until one is VALID, then bisects between the highest VALID and the lowest
INVALID value until they are within ``--rel-tol`` or ``--max-runs`` tries are spent. It prints every try,
then the result and the user.conf line for it.

``--one-process`` (default): every try runs in this process over one engine start (``sut.series``: a fresh
SUT object and ledger per try; the first try's LoadGen settings copied for the next with only ``target_qps``
changed; each ``run.json`` says "try N of a one-process target_qps search: engine warm from earlier tries";
the engine logs are in the first try's folder). A try that fails (engine death, a sample never answered, a
ledger error) is logged as a failed try and ends the search with exit 1 (Ctrl-C: 130), engines stopped.
``--fresh-process``: each try is one ``python -m sut run`` process (the engines start for every try; a
failed try counts as INVALID and the search goes on).

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
Everything after ``--`` is ``python -m sut run``'s arguments.

Resumable, cut-off safe: each try is appended to a JSONL file (``--log``, default
``OUTPUT_DIR/tries-SCENARIO.jsonl``; one object a line: qps, validity, TTFT/TPOT p99 ms, tokens/s,
wall_s, folder, the search settings) as soon as it ends, so a search killed mid-try (a device session
running out) loses only that try. ``--resume FILE`` takes the tries in FILE as made and goes on from
their bounds (highest VALID, lowest INVALID), appending to FILE; tries made with other settings
(scenario, min duration, min query count, run arguments) are refused (exit 2). ``--budget-s S`` starts
no try that would, at the longest try's pace so far, end more than S seconds after the search began.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Callable, Iterable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sut_runs import ROOT, run_once, split_run_args  # noqa: E402

sys.path.insert(0, str(ROOT))

log = logging.getLogger("find_qps")
MODEL_KEYS = {"Server": "llama3_1-8b", "Interactive": "llama3_1-8b-interactive"}


@dataclass(frozen=True)
class Try:
    """One short run: ``qps`` asked, LoadGen's ``validity`` (``VALID``/``INVALID``/None = the run failed),
    its p99s (ms), output tokens/s and how long the try took (``wall_s``, engine start included: one-process
    mode, the first try of a session only)."""

    qps: float
    validity: Optional[str]
    ttft_p99_ms: Optional[float] = None
    tpot_p99_ms: Optional[float] = None
    tokens_per_s: Optional[float] = None
    folder: str = ""
    note: str = ""
    wall_s: Optional[float] = None

    @property
    def valid(self) -> bool:
        return self.validity == "VALID"


def bounds(tries: Iterable[Try]) -> tuple[Optional[float], Optional[float]]:
    """``(highest VALID qps, lowest INVALID qps)``; a failed try (validity None) counts as INVALID."""
    tries = list(tries)
    good = [t.qps for t in tries if t.valid]
    bad = [t.qps for t in tries if not t.valid]
    return (max(good) if good else None), (min(bad) if bad else None)


def next_qps(lo: Optional[float], hi: Optional[float], start: Optional[float], factor: float,
             rel_tol: float) -> Optional[float]:
    """The next qps to try from the bounds, or None when ``hi / lo - 1 <= rel_tol`` (done; also when a noisy
    VALID lies above an INVALID). No bounds: ``start``; only INVALID: shrink; only VALID: grow."""
    if lo is None and hi is None:
        return start
    if lo is None:
        return hi / factor
    if hi is None:
        return lo * factor
    return None if hi / lo - 1 <= rel_tol else (lo + hi) / 2


def check_search_args(start: Optional[float], factor: float, rel_tol: float, max_runs: int, prior: list) -> None:
    """``ValueError`` for search arguments that cannot work (``search``'s)."""
    if (start is None and not prior) or (start is not None and start <= 0) or factor <= 1 or rel_tol <= 0 \
            or max_runs < 0:
        raise ValueError("start (needed without earlier tries), rel_tol must be > 0, factor > 1, max_runs >= 0")


def search(run: Callable[[float], Try], start: Optional[float], factor: float = 2.0, rel_tol: float = 0.05,
           max_runs: int = 8, prior: Iterable[Try] = (),
           may_start: Callable[[], bool] = lambda: True) -> tuple[Optional[float], list[Try]]:
    """Highest VALID qps found and every try (``prior`` first, then the new ones, in order).

    ``run(qps)`` makes one try. Starting from the bounds of ``prior`` (or at ``start`` without any):
    grow by ``factor`` while VALID (shrink while INVALID) to bracket the boundary, then bisect until
    ``hi / lo - 1 <= rel_tol``; at most ``max_runs`` new tries, and none once ``may_start()`` says no.
    Returns ``(None, tries)`` when no try was VALID. Raises ``ValueError`` for bad arguments (``start``
    may be None only when ``prior`` holds tries).
    """
    tries = list(prior)
    check_search_args(start, factor, rel_tol, max_runs, tries)
    lo, hi = bounds(tries)
    for _ in range(max_runs):
        q = next_qps(lo, hi, start, factor, rel_tol)
        if q is None or not may_start():
            break
        tries.append(run(q))
        lo, hi = bounds(tries)
    return lo, tries


class TryLog:
    """The JSONL record of a search's tries (one object a line: the Try's fields + ``settings`` + ``finished``).

    ``settings`` (scenario, min duration, min query count, run arguments) is written with every try; earlier
    tries are only usable under the same settings. Raises ``ValueError`` naming file, line and field."""

    def __init__(self, path: Path, settings: dict):
        self.path, self.settings = Path(path), settings

    def read(self) -> list[Try]:
        """The tries recorded in the file. An unterminated last line (a write cut off) is skipped with a
        warning; any other bad line, or a try made with other settings, raises ``ValueError``."""
        text = self.path.read_text(encoding="utf-8")
        lines = text.split("\n")
        tries, names = [], {f.name for f in fields(Try)}
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                t = Try(**{k: v for k, v in rec.items() if k in names})
            except (ValueError, TypeError) as e:
                if n == len(lines):  # no newline after it: the write was cut off
                    log.warning("%s line %d: an unfinished record (cut off while written), skipped", self.path, n)
                    continue
                raise ValueError(f"{self.path} line {n}: not a try record ({e})") from None
            for k, v in self.settings.items():
                if rec.get("settings", {}).get(k) != v:
                    raise ValueError(f"{self.path} line {n}: made with {k} {rec.get('settings', {}).get(k)!r}, this "
                                     f"search uses {v!r}; use the same settings or a new --log file")
            tries.append(t)
        return tries

    def append(self, t: Try) -> None:
        """Append ``t`` as one line and fsync it, so that it survives the process being killed next."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a+b") as f:
            f.seek(0, os.SEEK_END)
            if f.tell():  # drop an unterminated line left by a cut-off write
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    f.seek(0)
                    keep = f.read().rfind(b"\n") + 1
                    f.truncate(keep)
            line = dict(asdict(t), settings=self.settings, finished=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
            f.write((json.dumps(line) + "\n").encode())
            f.flush()
            os.fsync(f.fileno())


class Budget:
    """``may_start()``: True while one more try, as long as the longest so far, ends within ``seconds`` of
    the start (None: no limit). ``note(t)`` records a try's ``wall_s``; earlier tries seed the estimate."""

    def __init__(self, seconds: Optional[float], earlier: Iterable[Try] = (), clock=time.monotonic):
        self.seconds, self.clock, self.t0 = seconds, clock, clock()
        self.longest = max([t.wall_s for t in earlier if t.wall_s] or [0.0])

    def note(self, t: Try) -> Try:
        self.longest = max(self.longest, t.wall_s or 0.0)
        return t

    def may_start(self) -> bool:
        if self.seconds is None or self.clock() - self.t0 + self.longest <= self.seconds:
            return True
        log.warning("no time for another try (%.0f s of %.0f s used, a try takes ~%.0f s)",
                    self.clock() - self.t0, self.seconds, self.longest)
        return False


def _g(q: Optional[float]) -> str:
    return "none" if q is None else f"{q:g}"


def _ms(ns) -> Optional[float]:
    return None if ns is None else round(ns / 1e6, 2)


def sut_try(scenario: str, qps: float, out: Path, run_args: list[str], min_duration_s: float,
            min_query_count: int, timeout_s: float) -> Try:
    """One ``python -m sut run`` at ``qps``; its verdict from the run's ``run.json``."""
    name = f"{time.strftime('%Y%m%d-%H%M%S')}-findqps-{scenario}-{qps:g}"
    t0 = time.monotonic()
    o = run_once([*run_args, "--scenario", scenario, "--target-qps", f"{qps:g}", "--min-duration-s",
                  f"{min_duration_s:g}", "--min-query-count", str(min_query_count)], out, name, timeout_s)
    if o.rc == 2 or o.record is None:
        raise SystemExit(f"python -m sut run refused the settings (exit {o.rc}):\n{o.stderr}")
    note = "" if o.rc == 0 else f"run failed (exit {o.rc}): {o.record.get('error')}"
    return try_from_record(qps, o.record, o.rc == 0, o.folder, time.monotonic() - t0, note)


def try_from_record(qps: float, rec: dict, ok: bool, folder, wall_s: float, note: str = "") -> Try:
    """The ``Try`` of a run whose ``run.json`` is ``rec`` (``ok``: the run finished; else validity None)."""
    lg = rec.get("loadgen") or {}
    return Try(qps, rec.get("validity") if ok else None,
               _ms(lg.get("result_first_token_99.00_percentile_latency_ns")),
               _ms(lg.get("result_time_per_output_token_99.00_percentile_ns")),
               rec.get("tokens_per_s"), str(folder), note, round(wall_s, 1))


def sut_run_settings(scenario: str, out: Path, run_args: list[str], min_duration_s: float, min_query_count: int):
    """``python -m sut run``'s settings for the tries, parsed as it parses ``run_args`` (preset, flags,
    ``--option``): ``(RunSettings, EngineSettings, GenerationSettings, options, command)``. Bad input
    exits 2 (argparse) or raises ``BadInput``."""
    from sut import cli

    args = [*run_args, "--scenario", scenario, "--min-duration-s", f"{min_duration_s:g}", "--min-query-count",
            str(min_query_count), "--output-dir", str(out), "--no-progress"]
    a = cli.build_parser().parse_args(["run", *args])
    a.argv = ["run", *args]
    return (*cli.settings_from_args(a), "python scripts/find_qps.py (one process) = python -m sut " +
            " ".join(shlex.quote(x) for x in a.argv) + " --target-qps QPS")


class TryFailed(Exception):
    """A try that failed in a way that ends the search (one-process mode): ``try_`` goes to the log, then
    ``cause`` is raised."""

    def __init__(self, t: Try, cause: BaseException):
        super().__init__(str(cause))
        self.try_, self.cause = t, cause


class OneProcessTries:
    """``tries(qps) -> Try`` over one engine start (``sut.series``). The first call parses ``run_args`` as
    ``python -m sut run`` does and checks everything (bad input: exit 2, nothing started); the engines start
    with the first test. A try that fails raises ``TryFailed`` (Ctrl-C: its ``RunFailed``); ``close()`` stops
    the engines."""

    def __init__(self, a, run_args: list[str]):
        self.a, self.run_args, self.out = a, run_args, Path(a.output_dir).resolve()
        self.series = None

    def __call__(self, q: float) -> Try:
        from sut.base import InputError, RunFailed
        from sut.engine import EngineError
        from sut.exits import interrupted
        from sut.series import SUTSeries

        a = self.a
        if self.series is None:
            *settings, command = sut_run_settings(a.scenario, self.out, self.run_args, a.min_duration_s,
                                                  a.min_query_count)
            self.series = SUTSeries(*settings, command=command)
        name, t0 = f"{time.strftime('%Y%m%d-%H%M%S')}-findqps-{a.scenario}-{q:g}", time.monotonic()
        try:
            rec = self.series.run(q, name)
        except InputError:
            raise
        except (RunFailed, EngineError) as e:
            folder = next(self.out.glob(name + "*"), None)
            if interrupted() or folder is None or not (folder / "run.json").is_file():
                raise
            rec = json.loads((folder / "run.json").read_text())
            raise TryFailed(try_from_record(q, rec, False, folder, time.monotonic() - t0,
                                            f"run failed: {rec.get('error')}"), e) from e
        return try_from_record(q, rec, True, rec["output_dir"], time.monotonic() - t0)

    def close(self) -> None:
        if self.series is not None:
            self.series.close()


def table(tries: list[Try]) -> str:
    rows = ["qps        validity  TTFT p99 ms  TPOT p99 ms  tokens/s  wall s  folder"]
    for t in tries:
        rows.append(f"{t.qps:<10g} {str(t.validity):<9} {str(t.ttft_p99_ms):>11}  {str(t.tpot_p99_ms):>11}  "
                    f"{str(round(t.tokens_per_s, 1) if t.tokens_per_s else None):>8}  {str(t.wall_s):>6}  "
                    f"{t.folder} {t.note}")
    return "\n".join(rows)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Arguments after -- go to python -m sut run (model, dataset, preset, ...).")
    p.add_argument("--scenario", required=True, choices=sorted(MODEL_KEYS))
    p.add_argument("--start", type=float, help="first target_qps to try (queries/s); needed unless --resume has tries")
    p.add_argument("--factor", type=float, default=2.0, help="growth/shrink factor while bracketing (default 2)")
    p.add_argument("--rel-tol", type=float, default=0.05, help="stop when highest VALID and lowest INVALID are "
                                                                "within this fraction (default 0.05)")
    p.add_argument("--max-runs", type=int, default=8, help="at most this many new tries (default 8)")
    p.add_argument("--min-duration-s", type=float, default=60.0, help="LoadGen min duration of each try (default 60)")
    p.add_argument("--min-query-count", type=int, default=1000,
                   help="LoadGen min query count of each try (early stopping needs several hundred; default 1000)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--one-process", dest="fresh_process", action="store_false",
                      help="(default) every try in this process over one engine start (sut.series)")
    mode.add_argument("--fresh-process", dest="fresh_process", action="store_true",
                      help="every try a fresh python -m sut run process (the engines start for each try)")
    p.set_defaults(fresh_process=False)
    p.add_argument("--timeout-s", type=float, default=3600.0, help="--fresh-process: give up on one try after this "
                                                                   "long (one process: the run's stall timeout)")
    p.add_argument("--output-dir", default="results/find_qps", help="where the tries' run folders go")
    p.add_argument("--log", type=Path, help="JSONL file each finished try is appended to at once "
                                            "(default: the --resume file, else OUTPUT_DIR/tries-SCENARIO.jsonl)")
    p.add_argument("--resume", type=Path, help="go on from the tries recorded in this JSONL file (same settings)")
    p.add_argument("--budget-s", type=float, help="start no try that would end later than this many seconds "
                                                  "after the search began (at the longest try's pace)")
    return p


def _setup(argv):
    """Parse and check everything (exit 2 before any try): ``(args, run args, earlier tries, try log, budget)``."""
    argv, run_args = split_run_args(argv)
    p = _parser()
    a = p.parse_args(argv)
    if any(x in run_args for x in ("--scenario", "--target-qps", "--min-duration-s", "--min-query-count")):
        p.error("give --scenario, --target-qps, --min-duration-s and --min-query-count to find_qps, not after --")
    out = Path(a.output_dir)
    settings = {"scenario": a.scenario, "min_duration_s": a.min_duration_s, "min_query_count": a.min_query_count,
                "run_args": run_args}
    prior: list[Try] = []
    if a.resume is not None:
        if not a.resume.is_file():
            p.error(f"--resume {a.resume}: no such file")
        try:
            prior = TryLog(a.resume, settings).read()
        except (ValueError, OSError) as e:
            p.error(f"--resume: {e}")
    try:
        check_search_args(a.start, a.factor, a.rel_tol, a.max_runs, prior)
    except ValueError as e:
        p.error(str(e))
    trylog = TryLog(a.log or a.resume or out / f"tries-{a.scenario}.jsonl", settings)
    return a, run_args, prior, trylog, Budget(a.budget_s, prior)


def main(argv=None) -> int:
    a, run_args, prior, trylog, budget = _setup(argv)
    if a.fresh_process:
        return _search(a, lambda q: sut_try(a.scenario, q, Path(a.output_dir).resolve(), run_args, a.min_duration_s,
                                            a.min_query_count, a.timeout_s), prior, trylog, budget)
    from sut.exits import run_main, stop_on_sigterm_like_ctrl_c

    tries = OneProcessTries(a, run_args)

    def one_process() -> int:
        stop_on_sigterm_like_ctrl_c()
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO")  # vLLM's own lines go to the engine logs
        try:
            return _search(a, tries, prior, trylog, budget)
        finally:
            tries.close()  # the engines stop once, also after a failed try or Ctrl-C

    return run_main(one_process, messages={"failed": "search failed: {}", "stopped": "search stopped: {}"}, logger=log)


def _search(a, make_try: Callable[[float], Try], prior: list[Try], trylog: TryLog, budget: Budget) -> int:
    """Run the search with ``make_try``, appending every finished try to ``trylog`` at once, and report.
    ``TryFailed``: the failed try is appended, then its cause raised."""
    def one(q: float) -> Try:
        try:
            t = make_try(q)
        except TryFailed as e:
            trylog.append(budget.note(e.try_))
            log.error("the try at %g queries/s failed (%s); the search stops. Every try is in %s", q, e.try_.folder,
                      trylog.path)
            raise e.cause from None
        trylog.append(budget.note(t))
        return t

    # the run folders and the log's folder are made by the first try, after every check
    best, tries = search(one, a.start, a.factor, a.rel_tol, a.max_runs, prior, budget.may_start)
    return report(a, tries, best, len(prior), trylog.path)


def report(a, tries: list[Try], best: Optional[float], n_prior: int, log_path: Path) -> int:
    """Print the tries, the result and how to go on; 0 when a VALID qps is known, else 1."""
    print(table(tries))
    print(f"{n_prior} earlier tries, {len(tries) - n_prior} new; every try is in {log_path}")
    lo, hi = bounds(tries)
    if tries and next_qps(lo, hi, a.start, a.factor, a.rel_tol) is not None:
        print(f"not converged (highest VALID {_g(lo)}, lowest INVALID {_g(hi)}, --rel-tol {a.rel_tol:g}): go on "
              f"with --resume {log_path}")
    if lo is not None and hi is not None and lo > hi:
        print(f"note: VALID at {lo:g} above INVALID at {hi:g} (noisy tries); confirm with a longer run")
    if best is None:
        print("no try was VALID" + (f" (lowest tried {min(t.qps for t in tries):g} queries/s)" if tries else ""))
        return 1
    print(f"highest VALID target_qps: {best:g} queries/s ({a.scenario}); confirm with one full-length run.")
    print(f"user.conf line: {MODEL_KEYS[a.scenario]}.Server.target_qps = {best:g}")
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    sys.exit(main())
