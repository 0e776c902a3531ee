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
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Callable, Iterable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sut_runs import run_once, split_run_args  # noqa: E402

log = logging.getLogger("find_qps")
MODEL_KEYS = {"Server": "llama3_1-8b", "Interactive": "llama3_1-8b-interactive"}


@dataclass(frozen=True)
class Try:
    """One short run: ``qps`` asked, LoadGen's ``validity`` (``VALID``/``INVALID``/None = the run failed),
    its p99s (ms), output tokens/s and how long the try took (``wall_s``, engine start included)."""

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
    if (start is None and not tries) or (start is not None and start <= 0) or factor <= 1 or rel_tol <= 0 \
            or max_runs < 0:
        raise ValueError("start (needed without earlier tries), rel_tol must be > 0, factor > 1, max_runs >= 0")
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
    rec = o.record
    lg = rec.get("loadgen") or {}
    note = "" if o.rc == 0 else f"run failed (exit {o.rc}): {rec.get('error')}"
    return Try(qps, rec.get("validity") if o.rc == 0 else None,
               _ms(lg.get("result_first_token_99.00_percentile_latency_ns")),
               _ms(lg.get("result_time_per_output_token_99.00_percentile_ns")),
               rec.get("tokens_per_s"), str(o.folder), note, round(time.monotonic() - t0, 1))


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
    p.add_argument("--timeout-s", type=float, default=3600.0, help="give up on one try after this long")
    p.add_argument("--output-dir", default="results/find_qps", help="where the tries' run folders go")
    p.add_argument("--log", type=Path, help="JSONL file each finished try is appended to at once "
                                            "(default: the --resume file, else OUTPUT_DIR/tries-SCENARIO.jsonl)")
    p.add_argument("--resume", type=Path, help="go on from the tries recorded in this JSONL file (same settings)")
    p.add_argument("--budget-s", type=float, help="start no try that would end later than this many seconds "
                                                  "after the search began (at the longest try's pace)")
    return p


def main(argv=None) -> int:
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
    trylog = TryLog(a.log or a.resume or out / f"tries-{a.scenario}.jsonl", settings)
    budget = Budget(a.budget_s, prior)

    def one(q: float) -> Try:
        t = budget.note(sut_try(a.scenario, q, out.resolve(), run_args, a.min_duration_s, a.min_query_count,
                                a.timeout_s))
        trylog.append(t)
        return t

    try:  # the run folders and the log's folder are made by the first try, after every check
        best, tries = search(one, a.start, a.factor, a.rel_tol, a.max_runs, prior, budget.may_start)
    except ValueError as e:
        p.error(str(e))
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
