"""What python -m sut find-qps prints and logs about a search: the try table and lines, the result with its
user.conf line, and the whole command that resumes a search (the same settings, the arguments after ``--``)."""

from __future__ import annotations

import logging
import shlex
from pathlib import Path
from typing import Optional

from sut.findqps.plot import plot_search
from sut.findqps.search import DEFAULT_MAX_RUNS, Try, bounds, next_qps
from sut.scenarios import default_model_key
from sut.settings.run import MAX_TARGET_QPS

log = logging.getLogger("find_qps")


def fmt_qps(q: Optional[float]) -> str:
    """A qps for messages: "none" or the shortest form (``%g``)."""
    return "none" if q is None else f"{q:g}"


def fmt_bound(q: Optional[float], tries: list[Try], allow_growth: bool) -> str:
    """A bound for messages (``fmt_qps``), with " (GROWING)" when the try that makes it is a VALID one whose
    queue was growing (counted as an upper bound, ``find_qps_search.bounds``)."""
    growing = not allow_growth and any(t.qps == q and t.growing for t in tries)
    return fmt_qps(q) + (" (GROWING)" if growing else "")


def _num(v: Optional[float], places: int = 1) -> str:
    """A measurement for the table and log lines: "none", or with thousands separators ("120,687.7")."""
    return "none" if v is None else f"{v:,.{places}f}"


def table(tries: list[Try], allow_growth: bool = False) -> str:
    """The tries as a table; a VALID try whose queue was growing shows as GROWING (explained under it)."""
    rows = ["qps        validity  TTFT p99 ms  TPOT p99 ms  tokens/s  wall s  folder"]
    for t in tries:
        shown = "GROWING" if t.growing else str(t.validity)
        rows.append(f"{t.qps:<10g} {shown:<9} {_num(t.ttft_p99_ms):>11}  {_num(t.tpot_p99_ms):>11}  "
                    f"{_num(t.tokens_per_s):>8}  {_num(t.wall_s, 0):>6}  {t.folder} {t.note}")
    if any(t.growing for t in tries):
        rows.append("GROWING: LoadGen said VALID, but the TTFT backlog grew through the try fast enough to pass the "
                    "limit within 600 s (note); " + ("counted as VALID here (--allow-queue-growth)" if allow_growth
                                                      else "it bounds the search from above like an INVALID try"))
    return "\n".join(rows)


def try_line(t: Try) -> str:
    """One try as a log line: qps, validity, p99s, tokens/s, wall time, run folder and note."""
    return (f"target_qps {t.qps:g}: {'GROWING' if t.growing else t.validity or 'FAILED'}, TTFT p99 "
            f"{_num(t.ttft_p99_ms)} ms, TPOT p99 {_num(t.tpot_p99_ms)} ms, {_num(t.tokens_per_s)} tokens/s, wall "
            f"{_num(t.wall_s, 0)} s, {t.folder}" + (f" ({t.note})" if t.note else ""))


def log_how_to_go_on(a, run_args: list[str], log_path: Path, new_tries: int) -> None:
    """After a search stopped early: the command that resumes it from ``log_path`` (an unfinished try is not
    in it, a failed one bounds nothing: either is made again), or, when no try was ever recorded there, that
    the same command starts over."""
    if log_path.is_file() and log_path.stat().st_size > 0:
        log.error("the search stopped after %d new finished tr%s; every finished try is in %s; go on with:\n  %s",
                  new_tries, "y" if new_tries == 1 else "ies", log_path, resume_command(a, run_args, log_path))
    else:
        log.error("the search stopped before any try finished (nothing recorded in %s): run the same command again",
                  log_path)


def resume_command(a, run_args: list[str], log_path: Path) -> str:
    """The whole command that goes on with this search from ``log_path``: the same search settings (those
    ``TryLog`` checks, exactly as parsed, and the others as given) and the arguments after ``--``."""
    max_runs = a.max_runs or DEFAULT_MAX_RUNS  # --max-runs 0 made no try: go on with the default
    cmd = ["python", "-m", "sut", "find-qps", "--scenario", a.scenario, "--resume", str(log_path),
           "--min-duration-s", repr(a.min_duration_s), "--min-query-count", str(a.min_query_count),
           "--factor", f"{a.factor!r}", "--rel-tol", f"{a.rel_tol!r}", "--max-runs", str(max_runs),
           "--output-dir", str(a.output_dir), "--timeout-s", f"{a.timeout_s!r}"]
    if a.budget_s is not None:
        cmd += ["--budget-s", repr(a.budget_s)]
    if a.fresh_process:
        cmd.append("--fresh-process")
    if a.allow_queue_growth:
        cmd.append("--allow-queue-growth")
    return shlex.join([*cmd, "--", *run_args])


def report(a, tries: list[Try], best: Optional[float], n_prior: int, log_path: Path, run_args: list[str]) -> int:
    """Print the tries, the result and how to go on, and write the search's figure next to ``log_path``
    (``find_qps_plot``: ``<log>.png``); 0 when a VALID qps is known, else 1."""
    print(table(tries, a.allow_queue_growth))
    print(f"{n_prior} earlier tries, {len(tries) - n_prior} new; every try is in {log_path}")
    if tries:
        print(f"figure: {plot_search(tries, a.scenario, best, Path(log_path).with_suffix('.png'))}")
    lo, hi = bounds(tries, a.allow_queue_growth)
    nq = next_qps(lo, hi, a.start, a.factor, a.rel_tol) if tries else None
    if nq is not None:
        print(f"not converged (highest VALID {fmt_qps(lo)}, lowest INVALID {fmt_bound(hi, tries, a.allow_queue_growth)}, "
              f"--rel-tol {a.rel_tol:g}); " + (f"go on with:\n  {resume_command(a, run_args, log_path)}"
                                              if nq <= MAX_TARGET_QPS else f"the next target_qps, {nq:g} queries/s, "
                                              f"is above the {MAX_TARGET_QPS:g} cap of a run's: it cannot go on"))
    if lo is not None and hi is not None and lo > hi:
        print(f"note: VALID at {lo:g} above INVALID at {fmt_bound(hi, tries, a.allow_queue_growth)} (noisy tries); "
              "confirm with a longer run")
    if best is None:
        grew = not a.allow_queue_growth and any(t.growing for t in tries)
        print("no try was VALID" + (" with a steady queue (GROWING above)" if grew else "")
              + (f" (lowest tried {min(t.qps for t in tries):g} queries/s)" if tries else ""))
        return 1
    grew = any(t.qps == best and t.growing for t in tries)  # only under --allow-queue-growth
    short = not grew and not any(t.qps == best and t.valid and t.queue_growing is False for t in tries)
    print(f"highest VALID target_qps: {best:g} queries/s ({a.scenario}"
          f"{'; its queue was GROWING: a full-length run will likely fail' if grew else ''}"
          f"{'' if a.allow_queue_growth else '; GROWING tries not counted'}); confirm with one full-length run.")
    if short:
        print(f"note: no try at {best:g} was long enough to judge its queue; short tries overestimate: on one H200 "
              "two such results failed over 600 s (Server 55.5: TTFT backlog; Interactive 47.25: TPOT p99 34.3 ms "
              "against 30), docs/benchmarks.md. Search with --min-duration-s 120 or more.")
    print(f"user.conf line: {default_model_key(a.scenario)}.Server.target_qps = {best:g}")
    return 0

