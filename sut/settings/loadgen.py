"""LoadGen ``TestSettings`` of a run: mlperf.conf + user.conf read once per process, then the dev overrides.

``loadgen_test_settings(run_settings, dataset_size)`` returns the settings and the reasons the run is
not compliant (a user.conf that weakens mlperf.conf, a cut dataset, command-line overrides);
``mlperf_conf_settings`` reads what mlperf.conf alone gives, in a child process (``FromConfig`` may run
once per process: a second call would make LoadGen log "Multiple conf files are used", which the
submission checker rejects). ``copy_test_settings`` makes the settings of a later test in the same process
(``sut.run.series``) from the first test's, without a second ``FromConfig``.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

from sut.constants import DEFAULT_MODEL_KEY, MIN_DURATION_MS, PERFORMANCE_SAMPLE_COUNT
from sut.errors import InputError, RunFailed
from sut.scenarios import resolve_scenario
from sut.settings.userconf import check_user_conf

log = logging.getLogger(__name__)

_FROM_CONFIG_CALLED = False

# LoadGen settings that mlperf.conf fixes for a compliant run; a user.conf may only make the first two
# stricter (a longer run, more queries). Checked against mlperf.conf's own values, read in a child
# process (FromConfig may run once per process).
_CONF_FIELDS = ("min_duration_ms", "min_query_count", "max_duration_ms", "max_query_count",
                "performance_sample_count_override", "accuracy_sample_count_override",
                "sample_concatenate_permutation", "use_token_latencies",
                # what is issued and measured: one sample for every query, each once, tokens/s inferred and scaled
                "performance_issue_same", "performance_issue_same_index", "performance_issue_unique",
                "infer_token_latencies", "token_latency_scaling_factor")
_CONF_SNIPPET = """
import json, sys, tempfile, mlperf_loadgen as lg
ts = lg.TestSettings()
ts.scenario = getattr(lg.TestScenario, sys.argv[2])
with tempfile.NamedTemporaryFile("w", suffix=".conf") as f:
    rc = ts.FromConfig(f.name, sys.argv[1], sys.argv[2])
print(json.dumps({"rc": rc, **{k: getattr(ts, k) for k in sys.argv[3:]}}))
"""


#: Server settings mlperf.conf fixes for the streaming scenarios (the token-latency limits and their percentile).
_SERVER_CONF_FIELDS = ("ttft_latency", "tpot_latency", "server_target_latency_percentile", "server_target_latency_ns")


def mlperf_conf_settings(model_key: str, scenario: str, fields: tuple = _CONF_FIELDS) -> dict:
    """The LoadGen settings ``fields`` that the embedded mlperf.conf alone gives (``scenario``: LoadGen's).

    Raises ``RunFailed`` if the child process cannot read them.
    """
    out = subprocess.run([sys.executable, "-c", _CONF_SNIPPET, model_key, scenario, *fields],
                         capture_output=True, text=True, timeout=120)
    try:
        ref = json.loads(out.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        raise RunFailed(f"could not read mlperf.conf's settings for {model_key}/{scenario}: {out.stderr[-500:]}") from None
    if ref.pop("rc") != 0:
        raise RunFailed(f"LoadGen's FromConfig failed on an empty user.conf for {model_key}/{scenario}")
    return ref


def loadgen_test_settings(rs, dataset_size: int):
    """Build LoadGen ``TestSettings`` from mlperf.conf + user.conf, then apply dev overrides
    (``rs``: ``sut.run.harness.RunSettings``).

    Returns ``(settings, noncompliance_reasons)``. Raises ``RunFailed`` if user.conf is
    missing/invalid or ``FromConfig`` was already called in this process (LoadGen would log
    "Multiple conf files are used", which the submission checker rejects).
    """
    global _FROM_CONFIG_CALLED
    import mlperf_loadgen as lg

    if not Path(rs.user_conf).is_file():
        raise InputError(f"user.conf {rs.user_conf} is not a regular file" if Path(rs.user_conf).exists()
                         else f"user.conf not found: {rs.user_conf}")
    scen = resolve_scenario(rs.scenario, rs.model_key)  # Interactive: LoadGen's Server + the -interactive key
    # A line LoadGen would ignore is refused (exit 2); with --target-qps, a file keyed for other runs only is fine.
    check_user_conf(rs.user_conf, rs.model_key, scen.loadgen, target_qps_given=rs.target_qps is not None)
    if _FROM_CONFIG_CALLED:
        raise RunFailed("TestSettings.FromConfig was already called in this process; start a new process per run")
    ts = lg.TestSettings()
    ts.scenario = getattr(lg.TestScenario, scen.loadgen)
    rc = ts.FromConfig(str(rs.user_conf), rs.model_key, scen.loadgen)
    _FROM_CONFIG_CALLED = True
    if rc != 0:
        raise InputError(f"LoadGen rejected {rs.user_conf} (FromConfig returned {rc}); values must be numbers, "
                        "lines 'model.scenario.key = value'")
    ts.mode = lg.TestMode.AccuracyOnly if rs.mode == "accuracy" else lg.TestMode.PerformanceOnly
    reasons = []
    if rs.scenario == "Offline" and not ts.offline_expected_qps > 0:
        raise InputError(f"{rs.user_conf}: target_qps must be a positive number of samples/s, got "
                         f"{ts.offline_expected_qps}")
    if scen.loadgen == "Server" and not ts.server_target_qps > 0:
        raise InputError(f"{rs.user_conf}: target_qps must be a positive number of queries/s, got "
                         f"{ts.server_target_qps}")
    fields = _CONF_FIELDS + (_SERVER_CONF_FIELDS if scen.loadgen == "Server" else ())
    ref = mlperf_conf_settings(rs.model_key, scen.loadgen, fields)
    for key in fields:
        val = getattr(ts, key)
        if val == ref[key] or (key in ("min_duration_ms", "min_query_count") and val > ref[key]):
            continue
        reasons.append(f"{rs.user_conf} changes {key} from mlperf.conf's {ref[key]} to {val}")
    official_count = PERFORMANCE_SAMPLE_COUNT[rs.model_key]
    if dataset_size != official_count:
        reasons.append(f"dataset has {dataset_size} samples, the benchmark needs {official_count}")
    if ts.performance_sample_count_override > dataset_size or ts.performance_sample_count_override == 0:
        ts.performance_sample_count_override = dataset_size
    reasons += _dev_overrides(ts, rs, scen.loadgen)
    if ts.performance_issue_same and ts.performance_issue_same_index >= ts.performance_sample_count_override:
        raise InputError(f"{rs.user_conf}: performance_issue_same_index {ts.performance_issue_same_index} is not one "
                         f"of the {ts.performance_sample_count_override} samples this run loads (0 to "
                         f"{ts.performance_sample_count_override - 1}); LoadGen 6.0.17 crashes or logs an error on it")
    check_target_qps(ts, rs, where="--target-qps" if rs.target_qps is not None else str(rs.user_conf),
                     samples=dataset_size)
    if ts.min_duration_ms < MIN_DURATION_MS and not any("min_duration" in r for r in reasons):
        reasons.append(f"min_duration {ts.min_duration_ms} ms < {MIN_DURATION_MS} ms")  # said once
    return ts, reasons


#: The largest Offline query a run may ask LoadGen for (samples): 100 x the 13,368-sample set (1,336,800).
#: LoadGen 6.0.17 sizes Offline's one query as max(min_query_count, 1.1 x min duration x target_qps) samples
#: and allocates it whole; at mlperf.conf's 600 s that allows target_qps up to ~2,025 samples/s.
OFFLINE_MAX_QUERY_SAMPLES = 100 * PERFORMANCE_SAMPLE_COUNT[DEFAULT_MODEL_KEY]

#: The most queries a Server / Interactive performance run may ask LoadGen for: the same 1,336,800. LoadGen
#: 6.0.17 builds the whole schedule (max(min_query_count, target_qps x min duration) queries) before it issues the
#: first; a target_qps of 1e7 grew the harness past 6 GB in 20 s with nothing issued. At 600 s this
#: allows ~2,228 queries/s (one H200 keeps ~53).
SERVER_MAX_QUERIES = 100 * PERFORMANCE_SAMPLE_COUNT[DEFAULT_MODEL_KEY]

#: Issuing longer than this (s) at a Server / Interactive target_qps gets a warning before the run starts ...
LONG_ISSUE_S = 3600.0
#: ... and so does issuing longer than this (s) when it is also more than twice the min duration (a
#: --quick Interactive run at 0.001 queries/s sat silent for 12 min waiting for its next arrival).
LONG_DEV_ISSUE_S = 300.0


def check_target_qps(ts, rs, where: str, samples: int | None = None) -> None:
    """Refuse a ``target_qps`` (the effective one in ``ts``: user.conf, then ``--target-qps``) that LoadGen
    cannot run sensibly; ``rs``: the run settings (``stall_timeout_s``, ``mode``), ``where``: named in the error;
    ``samples``: the samples an accuracy run issues (for the issue-time warning).

    Raises ``InputError`` (exit 2, before anything starts) for a Server / Interactive ``target_qps`` whose mean
    query gap (1 / target_qps s) exceeds ``rs.stall_timeout_s`` (LoadGen would wait that long with nothing
    outstanding, which no stall check sees) or whose performance schedule exceeds ``SERVER_MAX_QUERIES``, and an
    Offline performance query of more than ``OFFLINE_MAX_QUERY_SAMPLES`` samples. Logs a warning when a Server /
    Interactive run would spend more than ``LONG_ISSUE_S`` issuing its queries."""
    import mlperf_loadgen as lg

    if ts.scenario == lg.TestScenario.Server:
        _check_server_qps(ts, rs, where, samples)
    elif rs.mode == "performance":
        samples = max(ts.min_query_count, 1.1 * ts.min_duration_ms / 1000.0 * ts.offline_expected_qps)
        if samples > OFFLINE_MAX_QUERY_SAMPLES:
            raise InputError(f"{where}: Offline target_qps {ts.offline_expected_qps:g} samples/s x min duration "
                             f"{ts.min_duration_ms / 1000:g} s makes a query of about {samples:,.0f} samples "
                             f"(min_query_count {ts.min_query_count}), more than the {OFFLINE_MAX_QUERY_SAMPLES:,} "
                             "allowed (100 x the 13,368-sample set)")


def _check_server_qps(ts, rs, where: str, samples: int | None) -> None:
    """``check_target_qps`` for LoadGen's Server scenario (Server and Interactive)."""
    qps, duration_s = ts.server_target_qps, ts.min_duration_ms / 1000.0
    if 1.0 / qps > rs.stall_timeout_s:
        raise InputError(f"{where}: target_qps {qps:g} queries/s means one query every {1.0 / qps:.0f} s on "
                         f"average, longer than the stall timeout {rs.stall_timeout_s:g} s; use at least "
                         f"{1.0 / rs.stall_timeout_s:.2g}")
    if rs.mode == "performance":
        queries = max(ts.min_query_count, qps * duration_s)
        if queries > SERVER_MAX_QUERIES:
            raise InputError(f"{where}: target_qps {qps:g} queries/s x min duration {duration_s:g} s makes about "
                             f"{queries:,.0f} queries (min_query_count {ts.min_query_count}), more than the "
                             f"{SERVER_MAX_QUERIES:,} allowed (100 x the 13,368-sample set): LoadGen schedules them "
                             "all before it issues the first")
        issue_s = max(duration_s + 1.0 / qps, queries / qps)  # past the min duration: one more mean gap
    elif samples:
        queries, issue_s = samples, samples / qps
    else:
        return
    if issue_s > LONG_ISSUE_S or (issue_s > LONG_DEV_ISSUE_S and issue_s > 2 * duration_s):
        took = f"{issue_s / 3600:.1f} h" if issue_s >= 3600 else f"{issue_s / 60:.0f} min"
        log.warning("%s: target_qps %g queries/s: LoadGen issues its %s queries over about %s", where, qps,
                    f"{queries:,.0f}", took)


def _dev_overrides(ts, rs, loadgen_scenario: str) -> list[str]:
    """Apply the run's dev overrides (``--max-samples``, ``--min-duration-s``, ...) to ``ts``; returns
    the reasons they make the run not compliant."""
    reasons = []
    cap = rs.performance_sample_cap  # --quick: a few samples, so that Offline's one query is short too
    if cap is not None and ts.performance_sample_count_override > cap:
        ts.performance_sample_count_override = cap
        reasons.append(f"performance sample count cut to {cap} (--quick)")
    if rs.max_samples is not None:
        reasons.append(f"dataset cut to its first {rs.max_samples} records (--max-samples)")
    if rs.min_duration_s is not None:
        ts.min_duration_ms = int(rs.min_duration_s * 1000)
        reasons.append(f"min_duration overridden to {rs.min_duration_s} s")
    if rs.min_query_count is not None:
        ts.min_query_count = int(rs.min_query_count)
        reasons.append(f"min_query_count overridden to {rs.min_query_count}")
    if rs.target_qps is not None:
        if loadgen_scenario == "Server":
            ts.server_target_qps = float(rs.target_qps)
        else:
            ts.offline_expected_qps = float(rs.target_qps)
        reasons.append("target_qps set on the command line (put it in user.conf for a compliant run)")
    return reasons


def settings_fields(ts) -> list[str]:
    """Names of the settings the LoadGen binding exposes on ``ts`` (every public attribute that is not a
    method: 42 in LoadGen 6.0.17, from ``scenario`` and ``mode`` to ``tpot_latency``)."""
    return [a for a in dir(ts) if not a.startswith("_") and not callable(getattr(ts, a))]


def copy_test_settings(ts, **changes):
    """A fresh ``TestSettings`` with every exposed setting of ``ts`` (``settings_fields``), then ``changes``
    (``server_target_qps=12.5``): a later test's settings in a process that already ran ``FromConfig``
    (a second call would log "Multiple conf files are used" and skip the embedded mlperf.conf).

    Raises ``AttributeError`` naming a key of ``changes`` that is not a setting.
    """
    import mlperf_loadgen as lg

    names = settings_fields(ts)
    unknown = sorted(set(changes) - set(names))
    if unknown:
        raise AttributeError(f"not LoadGen TestSettings fields: {', '.join(unknown)}")
    new = lg.TestSettings()
    for name in names:
        setattr(new, name, getattr(ts, name))
    for name, value in changes.items():
        setattr(new, name, value)
    return new


def scheduled_queries(ts, perf_count: int) -> int:
    """The least number of queries LoadGen schedules in a Server test: ``min_query_count``, rounded up to a
    whole multiple of ``perf_count`` under equal issue (``ts.sample_concatenate_permutation``)."""
    n = int(ts.min_query_count)
    if ts.sample_concatenate_permutation and perf_count > 0:
        n = -(-n // perf_count) * perf_count
    return n
