"""One try of python -m sut find-qps and its verdict: ``sut_try`` runs it as one ``python -m sut run`` process,
``try_from_record`` makes its ``Try`` from the run's ``run.json`` (a failed run, or one INVALID only on early
stopping with too few queries, is no verdict: ``FEW_QUERIES``, ``NO_VERDICT``), and ``sut_run_settings`` parses
the tries' ``sut run`` arguments as that run does."""

from __future__ import annotations

import shlex
import time
from pathlib import Path
from typing import Optional

from sut.findqps.search import Try
from sut.record.latency_trend import describe as describe_trend
from sut.record.latency_trend import not_judged
from sut.record.read import early_stopping_shortfall, invalid_why
from sut.run.child import run_once


def _ms(ns) -> Optional[float]:
    return None if ns is None else round(ns / 1e6, 2)


def sut_try(scenario: str, qps: float, out: Path, run_args: list[str], min_duration_s: float,
            min_query_count: int, timeout_s: float) -> Try:
    """One ``python -m sut run`` at ``qps``; its verdict from the run's ``run.json``."""
    name = f"{time.strftime('%Y%m%d-%H%M%S')}-findqps-{scenario}-{qps:g}"
    t0 = time.monotonic()
    o = run_once([*run_args, "--scenario", scenario, "--target-qps", f"{qps:g}", "--min-duration-s",
                  f"{min_duration_s:g}", "--min-query-count", str(min_query_count)], out, name, timeout_s)
    if o.rc is None:  # past --timeout-s: stopped, perhaps before its run folder existed
        note = f"{o.stderr.strip().splitlines()[-1]} (--timeout-s)" + (f"; {o.record.get('error')}" if o.record else "")
        return try_from_record(qps, o.record or {}, False, o.folder or "", time.monotonic() - t0, note)
    if o.rc == 2 or o.record is None:
        raise SystemExit(f"python -m sut run refused the settings (exit {o.rc}):\n{o.stderr}")
    note = "" if o.rc == 0 else f"run failed (exit {o.rc}): {o.record.get('error')}"
    return try_from_record(qps, o.record, o.rc == 0, o.folder, time.monotonic() - t0, note)


#: An early-stopping shortfall up to this many queries in all (or twice those done) is "too few queries", no
#: verdict on the rate: with no query over the limit LoadGen's p99 early stopping needs ~460 queries; near the
#: bound it asks for tens of thousands more (docs/results: 66,393 more after 2,040).
FEW_QUERIES = 1000
NO_VERDICT = "INVALID only on LoadGen's early stopping,"


def try_from_record(qps: float, rec: dict, ok: bool, folder, wall_s: float, note: str = "") -> Try:
    """The ``Try`` of a run whose ``run.json`` is ``rec`` (``ok``: the run finished; else validity None and no
    p99s or tokens/s: what LoadGen reports for a failed run is not a measurement)."""
    if not ok:
        return Try(qps, None, folder=str(folder), note=note, wall_s=round(wall_s, 1))
    lg = rec.get("loadgen") or {}
    trend = ((rec.get("latency") or {}).get("harness") or {}).get("ttft_trend") or {}
    judged = describe_trend(trend) or (not_judged(trend) if rec.get("validity") == "VALID" else None)
    validity, why = rec.get("validity"), None
    if validity == "INVALID":
        why, short = f"INVALID: {invalid_why(rec)}", early_stopping_shortfall(rec)
        if lg.get("result_perf_constraints_met") is True and lg.get("early_stopping_met") is False and short:
            done, more = short
            if done + more <= max(2 * done, FEW_QUERIES):  # too few queries: no verdict on the rate
                validity = None
                need = -(-int((done + more) * 1.25) // 100) * 100
                why = (f"{NO_VERDICT} every p99 under its limit: {done} queries were too few (it needs at least "
                       f"{more} more); search again with --min-query-count {need} or more and a new --log (the "
                       "tries of a log share their settings)")
            else:
                why += f" (every p99 under its limit; it needs at least {more} more queries: near the bound)"
    note = "; ".join(x for x in (note, why, judged) if x)
    return Try(qps, validity, _ms(lg.get("result_first_token_99.00_percentile_latency_ns")),
               _ms(lg.get("result_time_per_output_token_99.00_percentile_ns")),
               rec.get("tokens_per_s"), str(folder), note, round(wall_s, 1), trend.get("growing"))


def sut_run_settings(scenario: str, out: Path, run_args: list[str], min_duration_s: float, min_query_count: int,
                     progress: bool = False):
    """``python -m sut run``'s settings for the tries, parsed as it parses ``run_args`` (preset, flags,
    ``--option``): ``(RunSettings, EngineSettings, GenerationSettings, options, command)``; each try draws the
    run's progress bar only when ``progress`` (and ``run_args`` has no ``--no-progress``). Bad input exits 2
    (argparse) or raises ``BadInput``."""
    from sut.settings.from_args import settings_from_args
    from sut.settings.parser import parse_run_args

    args = [*run_args, "--scenario", scenario, "--min-duration-s", f"{min_duration_s:g}", "--min-query-count",
            str(min_query_count), "--output-dir", str(out), *([] if progress else ["--no-progress"])]
    a = parse_run_args(args)
    a.argv = ["run", *args]
    return (*settings_from_args(a), "python -m sut find-qps (one process) = python -m sut " +
            " ".join(shlex.quote(x) for x in a.argv) + " --target-qps QPS")
