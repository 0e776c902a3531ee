"""One LoadGen run end to end: settings → dataset → SUT → LoadGen → run record.

``run_benchmark(RunSettings, EngineSettings, GenerationSettings, options)`` is what
``python -m sut run`` calls. It reads ``user.conf`` once per process through
``TestSettings.FromConfig`` with the official model key and scenario (which also loads the
embedded MLPerf mlperf.conf), builds the QSL and the SUT, runs ``StartTestWithLogSettings`` on
a helper thread (so Ctrl-C and engine death are noticed at once), and writes ``run.json``
next to LoadGen's logs. A run that deviates from the official settings (quick mode, dataset
subset, overridden duration or QPS, fixed output length) is marked not compliant in the
console, the folder name and the record.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import hashlib
import importlib.metadata as md
import json
import logging
import os
import math
import platform
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from sut import __version__
from sut.base import InputError, RunFailed, SUTContext, SystemUnderTest, get_sut
from sut.compliance import COMPLIANCE_TESTS, TEST06_AUDIT_CONFIG, ComplianceError, verify_test06, write_test06
from sut.constants import MIN_DURATION_MS, MODEL_KEYS, PERFORMANCE_SAMPLE_COUNT
from sut.dataset import Dataset, QuerySampleLibrary, load_dataset
from sut.engine import EngineSettings, GenerationSettings, read_model_info
from sut.scenarios import LATENCY_LIMITS_MS, ScenarioError, check_backend, resolve_scenario
from sut.userconf import check_user_conf

log = logging.getLogger(__name__)

MODES = ("performance", "accuracy")


@dataclass(frozen=True)
class RunSettings:
    """Settings of one LoadGen run.

    Attributes:
        sut: registered backend name (``vllm``, ``flame``).
        dataset: cnn_eval-format JSON file.
        output_dir: base folder; each run gets its own sub-folder.
        mode: ``performance`` or ``accuracy``.
        scenario: ``Offline``, ``Server`` or ``Interactive`` (``sut/scenarios.py``: Interactive is a
            LoadGen Server run with the model key ``llama3_1-8b-interactive``).
        model_key: LoadGen model key (MLPerf mlperf.conf); None = the scenario's (``llama3_1-8b``,
            Interactive ``llama3_1-8b-interactive``); a key that does not go with the scenario is refused.
        user_conf: user.conf path, read once through ``FromConfig``.
        max_samples: use only the first N records (not compliant).
        min_duration_s / min_query_count / target_qps: overrides after user.conf (not compliant,
            except ``target_qps`` which is marked so because it belongs in user.conf).
        tokenizer: tokenizer for the accuracy gate (default: the model folder).
        accuracy_gate: run the ROUGE + length gate after an accuracy-mode run.
        audit_config: LoadGen audit config (e.g. TEST06's ``audit.config``); None = never read one.
        compliance_test: ``TEST06`` runs MLPerf's TEST06: the shipped audit config (unless
            ``audit_config`` names another), then the TEST06 checks on the sampled accuracy log
            (``sut/compliance.py``); the result goes to ``<run>/TEST06/`` and ``run.json``, and a
            failed check fails the run.
        enable_trace: LoadGen trace log (large; off by default).
        stall_timeout_s: fail if no sample completes for this long while samples are outstanding.
        run_name: sub-folder name; default ``<time>-<sut>-<scenario>-<mode>``.
        engine_console: vLLM's own output (local engine workers' stdout/stderr) on the console
            (``--verbose``) instead of ``<run>/engine-N.log``.
    """

    sut: str
    dataset: str
    output_dir: str = "results"
    mode: str = "performance"
    scenario: str = "Offline"
    model_key: Optional[str] = None
    user_conf: str = "user.conf"
    max_samples: Optional[int] = None
    min_duration_s: Optional[float] = None
    min_query_count: Optional[int] = None
    target_qps: Optional[float] = None
    tokenizer: Optional[str] = None
    accuracy_gate: bool = True
    audit_config: Optional[str] = None
    compliance_test: Optional[str] = None
    enable_trace: bool = False
    stall_timeout_s: float = 1800.0
    run_name: Optional[str] = None
    progress: bool = True
    engine_console: bool = False

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.model_key is not None and self.model_key not in MODEL_KEYS:
            raise ValueError(f"model_key must be one of {MODEL_KEYS} (spelt exactly so), got {self.model_key!r}")
        # ScenarioError (a ValueError) names the right spelling or pairing; the key is then the scenario's
        object.__setattr__(self, "model_key", resolve_scenario(self.scenario, self.model_key).model_key)
        if self.compliance_test is not None:
            if self.compliance_test not in COMPLIANCE_TESTS:
                raise ValueError(f"compliance_test must be one of {COMPLIANCE_TESTS}, got {self.compliance_test!r}")
            if self.mode != "performance":
                raise ValueError(f"{self.compliance_test} is a performance-mode run (its audit config sets mode 2); "
                                 f"got mode {self.mode!r}")
            if self.audit_config and Path(self.audit_config).resolve() != TEST06_AUDIT_CONFIG.resolve():
                raise ValueError(f"--compliance-test {self.compliance_test} uses {TEST06_AUDIT_CONFIG}; do not also "
                                 f"pass --audit-config ({self.audit_config})")
        if self.audit_config and self.mode != "performance":
            raise ValueError("an audit config sets LoadGen's mode itself (TEST06: performance with a sampled accuracy "
                             f"log); run it with --mode performance, got {self.mode!r}")
        if self.max_samples is not None and self.max_samples < 1:
            raise ValueError(f"max_samples must be >= 1, got {self.max_samples}")
        if self.min_query_count is not None and self.min_query_count < 1:
            raise ValueError(f"min_query_count must be >= 1, got {self.min_query_count}")
        for name in ("min_duration_s", "target_qps"):
            v = getattr(self, name)
            if v is not None and not (math.isfinite(v) and 0 < v <= 1e7):
                raise ValueError(f"{name} must be a number in (0, 1e7], got {v}")
        if not (math.isfinite(self.stall_timeout_s) and self.stall_timeout_s > 0):
            raise ValueError(f"stall_timeout_s must be a positive number, got {self.stall_timeout_s}")


_FROM_CONFIG_CALLED = False

# LoadGen settings that mlperf.conf fixes for a compliant run; a user.conf may only make the first two
# stricter (a longer run, more queries). Checked against mlperf.conf's own values, read in a child
# process (FromConfig may run once per process).
_CONF_FIELDS = ("min_duration_ms", "min_query_count", "max_duration_ms", "max_query_count",
                "performance_sample_count_override", "accuracy_sample_count_override",
                "sample_concatenate_permutation", "use_token_latencies")
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


def loadgen_test_settings(rs: RunSettings, dataset_size: int):
    """Build LoadGen ``TestSettings`` from mlperf.conf + user.conf, then apply dev overrides.

    Returns ``(settings, noncompliance_reasons)``. Raises ``RunFailed`` if user.conf is
    missing/invalid or ``FromConfig`` was already called in this process (LoadGen would log
    "Multiple conf files are used", which the submission checker rejects).
    """
    global _FROM_CONFIG_CALLED
    import mlperf_loadgen as lg

    if not Path(rs.user_conf).is_file():
        raise InputError(f"user.conf not found: {rs.user_conf}")
    scen = resolve_scenario(rs.scenario, rs.model_key)  # Interactive: LoadGen's Server + the -interactive key
    check_user_conf(rs.user_conf, rs.model_key, scen.loadgen)  # a line LoadGen would ignore is refused (exit 2)
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
    if rs.max_samples is not None:
        reasons.append(f"dataset cut to its first {rs.max_samples} records (--max-samples)")
    if rs.min_duration_s is not None:
        ts.min_duration_ms = int(rs.min_duration_s * 1000)
        reasons.append(f"min_duration overridden to {rs.min_duration_s} s")
    if rs.min_query_count is not None:
        ts.min_query_count = int(rs.min_query_count)
        reasons.append(f"min_query_count overridden to {rs.min_query_count}")
    if rs.target_qps is not None:
        if scen.loadgen == "Server":
            ts.server_target_qps = float(rs.target_qps)
        else:
            ts.offline_expected_qps = float(rs.target_qps)
        reasons.append("target_qps set on the command line (put it in user.conf for a compliant run)")
    if ts.min_duration_ms < MIN_DURATION_MS:
        reasons.append(f"min_duration {ts.min_duration_ms} ms < {MIN_DURATION_MS} ms")
    return ts, reasons


def _version(dist: str) -> Optional[str]:
    for name in (dist, dist + "-cpu"):
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            continue
    return None


def parse_loadgen_detail(path: Path) -> dict:
    """Key results from ``mlperf_log_detail.txt`` (``:::MLLOG`` JSON lines) as plain values."""
    wanted = {"result_validity", "result_samples_per_second", "result_tokens_per_second", "result_min_duration_met",
              "result_min_queries_met", "early_stopping_met", "effective_samples_per_query", "effective_min_duration_ms",
              "effective_performance_sample_count", "effective_target_qps", "loadgen_version", "effective_min_query_count",
              "result_max_latency_ns", "effective_sample_concatenate_permutation", "effective_use_token_latencies",
              "effective_scenario", "result_completed_samples_per_sec", "result_completed_tokens_per_second",
              "result_scheduled_samples_per_sec", "result_perf_constraints_met", "early_stopping_ttft_result",
              "early_stopping_tpot_result", "result_invalid_reason", "result_first_token_99.00_percentile_latency_ns",
              "result_first_token_mean_latency_ns", "result_first_token_50.00_percentile_latency_ns",
              "result_time_per_output_token_99.00_percentile_ns", "result_time_per_output_token_50.00_percentile_ns",
              "result_99.00_percentile_latency_ns", "effective_target_latency_percentile", "result_query_count",
              "requested_server_ttft_latency", "requested_server_tpot_latency"}
    out: dict = {"errors": 0, "warnings": 0}
    if not path.is_file():
        return out
    for line in path.read_text(errors="replace").splitlines():
        if not line.startswith(":::MLLOG"):
            continue
        try:
            rec = json.loads(line[len(":::MLLOG"):])
        except json.JSONDecodeError:
            continue
        key = rec.get("key")
        if key in wanted:
            out[key] = rec.get("value")
        if key == "error" or str(key).startswith("error_"):
            out["errors"] += 1
        if key == "warning" or str(key).startswith("warning_"):
            out["warnings"] += 1
    return out


def token_latencies(scenario: str, results: dict, harness: dict) -> dict:
    """``run.json`` ``latency``: the scenario's p99 limits, LoadGen's TTFT/TPOT (from
    ``mlperf_log_detail.txt``, ms) and the harness's own per-sample figures."""
    def ms(key):
        v = results.get(key)
        return None if v is None else v / 1e6

    return {"limits_ms": LATENCY_LIMITS_MS.get(scenario),
            "loadgen": {"ttft_p99_ms": ms("result_first_token_99.00_percentile_latency_ns"),
                        "ttft_p50_ms": ms("result_first_token_50.00_percentile_latency_ns"),
                        "ttft_mean_ms": ms("result_first_token_mean_latency_ns"),
                        "tpot_p99_ms": ms("result_time_per_output_token_99.00_percentile_ns"),
                        "tpot_p50_ms": ms("result_time_per_output_token_50.00_percentile_ns"),
                        "latency_p99_ms": ms("result_99.00_percentile_latency_ns"),
                        "perf_constraints_met": results.get("result_perf_constraints_met"),
                        "early_stopping_met": results.get("early_stopping_met")},
            "harness": harness}


def host_info() -> dict:
    """OS, CPU model and NVIDIA driver of this host (for ``systems/<system>.json``); None where unknown."""
    cpu = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    driver = None
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=30)
            driver = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
        except (OSError, subprocess.SubprocessError):
            driver = None
    return {"os": platform.platform(), "cpu": cpu, "cpu_count": os.cpu_count(), "gpu_driver": driver}


def _file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _test06(rs: RunSettings, model, run_dir: Path) -> dict:
    """TEST06 checks on this run's sampled accuracy log; writes ``<run>/TEST06/``."""
    acc_log = run_dir / "mlperf_log_accuracy.json"
    try:
        res = verify_test06(acc_log, rs.scenario, model.eos_token_ids)
    except ComplianceError as e:
        return {"passed": False, "error": str(e), "verify_accuracy": None}
    write_test06(res, acc_log, run_dir)
    log.info("TEST06 on %d logged responses: %s", res.samples, res.verify_accuracy_txt().replace("\n", "; "))
    return {"passed": res.passed, "samples": res.samples, "eos_token_ids": list(model.eos_token_ids),
            "verify_accuracy": res.verify_accuracy_txt(), "failures": list(res.failures),
            "folder": str(run_dir / "TEST06")}


def _run_dir(rs: RunSettings, compliant: bool) -> Path:
    name = rs.run_name or (f"{_dt.datetime.now().strftime('%Y%m%d-%H%M%S')}-{rs.sut}-{rs.scenario}-"
                           f"{rs.compliance_test or rs.mode}")
    if not compliant and "NOT-COMPLIANT" not in name:
        name += "-NOT-COMPLIANT"
    d = Path(rs.output_dir) / name
    d.mkdir(parents=True, exist_ok=False)
    return d


def run_benchmark(rs: RunSettings, es: EngineSettings, gen: GenerationSettings, options: dict | None = None,
                  command: Optional[str] = None) -> dict:
    """Run one LoadGen test and return the run record (also written to ``run.json``).

    ``command`` is the command line to record (the CLI passes its own); the run folder also keeps
    a copy of the user.conf it read.

    Raises:
        DatasetError: bad dataset (before any engine starts).
        EngineError: an engine failed to start.
        RunFailed: the run could not finish trustworthily; ``run.json`` still records why.
    """
    options = dict(options or {})
    try:
        backend = get_sut(rs.sut)
    except KeyError as e:
        raise InputError(e.args[0]) from None
    backend.check_options(options)
    try:
        check_backend(rs.sut, resolve_scenario(rs.scenario, rs.model_key))  # flame + Server: exit 2, nothing started
    except ScenarioError as e:
        raise InputError(str(e)) from None
    backend.check_engine(es)  # e.g. --device cuda without a GPU: exit 2 before the run folder exists
    model = read_model_info(es.model)
    if not gen.eos_token_ids:
        gen = dataclasses.replace(gen, eos_token_ids=model.eos_token_ids)
    dataset = load_dataset(rs.dataset, model.vocab_size, es.max_model_len, rs.max_samples)
    ts, reasons = loadgen_test_settings(rs, len(dataset))
    if gen.ignore_eos:
        reasons.append("benchmark-only fixed output length (ignore_eos): outputs do not stop at EOS")
    if gen.max_tokens != 128 or gen.min_tokens != 1:
        reasons.append(f"max_tokens/min_tokens {gen.max_tokens}/{gen.min_tokens} differ from the reference 128/1")
    audit_config = rs.audit_config or (str(TEST06_AUDIT_CONFIG) if rs.compliance_test == "TEST06" else None)
    if audit_config and not Path(audit_config).is_file():
        # LoadGen would silently run without it.
        raise InputError(f"audit config not found: {audit_config}")
    if audit_config:
        reasons.append(f"audit config {audit_config} in effect (a compliance test run, not a result)")
    if es.enable_prefix_caching:
        reasons.append("prefix caching on: cross-query KV reuse is not allowed in MLPerf")
    compliant = not reasons
    try:
        run_dir = _run_dir(rs, compliant)
    except FileExistsError as e:
        raise InputError(f"run folder {e.filename} already exists (choose another --run-name)") from None
    except OSError as e:
        raise InputError(f"cannot create the run folder under --output-dir {rs.output_dir}: {e.strerror}") from None
    if not compliant:
        log.warning("THIS RUN IS NOT COMPLIANT: %s", "; ".join(reasons))
    if Path("audit.config").exists() and not rs.audit_config:
        log.warning("./audit.config exists but is ignored (pass --audit-config to use it)")

    record: dict = {
        "record_version": 1,
        "status": "running",
        "kind": "mlperf-loadgen",
        "sut": rs.sut,
        "scenario": rs.scenario,
        "loadgen_scenario": resolve_scenario(rs.scenario, rs.model_key).loadgen,
        "mode": rs.mode,
        "model_key": rs.model_key,
        "compliance": {"compliant": compliant, "reasons": reasons},
        "run_settings": dataclasses.asdict(rs),
        "engine_settings": dataclasses.asdict(es),
        "generation": dataclasses.asdict(gen),
        "options": options,
        "model": {"path": model.path, "config_sha256": model.config_sha256, "vocab_size": model.vocab_size,
                  "eos_token_ids": list(model.eos_token_ids)},
        "dataset": {"path": str(Path(rs.dataset).resolve()), "sha256": dataset.sha256, "samples": len(dataset),
                    "records_in_file": dataset.total_in_file, "prompt_tokens": dataset.length_stats()},
        "versions": {"project": __version__, "mlcommons-loadgen": _version("mlcommons-loadgen"), "python": platform.python_version(),
                     "flamepy": _version("flamepy")},
        "host": platform.node(),
        "host_info": host_info(),
        "command": command,
        "audit_config": ({"path": str(Path(audit_config).resolve()), "sha256": _file_sha256(Path(audit_config))}
                         if audit_config else None),
        "started": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "output_dir": str(run_dir),
    }
    shutil.copy2(rs.user_conf, run_dir / "user.conf")
    _write_record(run_dir, record)

    try:
        return _execute(rs, es, gen, backend, options, model, dataset, ts, audit_config, run_dir, record)
    except BaseException as e:  # noqa: BLE001 - recorded, then re-raised
        if record.get("status") == "running":
            record["status"] = "failed"
            record["error"] = record.get("error") or f"{type(e).__name__}: {e}"
            record["finished"] = _dt.datetime.now().astimezone().isoformat(timespec="seconds")
            _write_record(run_dir, record)
        raise


def _execute(rs: RunSettings, es: EngineSettings, gen: GenerationSettings, backend: type[SystemUnderTest],
             options: dict, model, dataset: Dataset, ts, audit_config: Optional[str], run_dir: Path,
             record: dict) -> dict:
    """Start the SUT, run LoadGen, check and record (the body of ``run_benchmark``)."""
    import mlperf_loadgen as lg

    ctx = SUTContext(dataset=dataset, engine=es, generation=gen, options=options, progress=rs.progress,
                     scenario=rs.scenario,
                     engine_log_dir=None if rs.engine_console else str(run_dir), run_dir=str(run_dir))
    sut = backend(ctx)
    qsl = None
    handle = None
    error: Optional[str] = None
    t_start = None
    loadgen_returned = True  # LoadGen's SUT/QSL objects may be destroyed only once StartTest has returned
    try:
        started = sut.start()
        record.update(started)
        engines = started.get("engines") or []
        record["prefix_caching"] = {"enabled": any(e.get("enable_prefix_caching") for e in engines),
                                    "read_back_from_engines": bool(engines)}
        if engines:
            record["versions"].update(vllm=engines[0].get("vllm_version"), torch=engines[0].get("torch_version"))
            record["devices"] = [e.get("device") for e in engines]
        _write_record(run_dir, record)  # engines, pids and read-back args are on disk before LoadGen starts
        qsl = QuerySampleLibrary(dataset, ts.performance_sample_count_override)
        handle = lg.ConstructSUT(sut.issue_queries, sut.flush_queries)
        out = lg.LogOutputSettings()
        out.outdir = str(run_dir)
        out.copy_summary_to_stdout = True
        ls = lg.LogSettings()
        ls.log_output = out
        ls.enable_trace = rs.enable_trace
        audit = str(Path(audit_config).resolve()) if audit_config else str(run_dir / "no-audit.config")
        log.info("LoadGen %s %s mode, model key %s, output %s", rs.scenario, rs.mode, rs.model_key, run_dir)
        t_start = time.monotonic()
        loadgen_returned = False
        error, loadgen_returned = _start_test_interruptible(lg, handle, qsl.handle, ts, ls, audit, sut,
                                                            rs.stall_timeout_s)
    except KeyboardInterrupt as e:
        error = interrupt_reason(e)
    finally:
        sut.stop()
        sut.ledger.close()  # every queued answer sent and counted (backends close it too; this is idempotent)
        if handle is not None and loadgen_returned:
            lg.DestroySUT(handle)
        if qsl is not None and loadgen_returned:
            qsl.destroy()
    wall = time.monotonic() - t_start if t_start else None
    error = error or sut.ledger.error
    led = sut.ledger
    record.update(sut.record())
    record["ledger"] = {"issued": led.issued, "completed": led.completed, "answered_empty": led.answered_empty,
                        "output_tokens": led.output_tokens}
    if error is None and led.completed != led.issued:
        error = f"{led.issued - led.completed} issued sample(s) were never answered"
    results = parse_loadgen_detail(run_dir / "mlperf_log_detail.txt")
    record["loadgen"] = results
    if hasattr(led, "first_sent"):  # Server / Interactive
        record["ledger"]["first_tokens"] = led.first_sent
        record["latency"] = token_latencies(rs.scenario, results, led.latency_summary())
        if error is None and led.first_sent != led.completed:
            error = f"{led.completed - led.first_sent} answered sample(s) got no first token"
    record["wall_s"] = wall
    if rs.mode == "performance":
        record["validity"] = results.get("result_validity")
        record["samples_per_s"] = results.get("result_samples_per_second", results.get("result_completed_samples_per_sec"))
        record["tokens_per_s"] = results.get("result_tokens_per_second", results.get("result_completed_tokens_per_second"))
    else:
        record["validity"] = None
        if wall:
            record["samples_per_s"] = led.completed / wall
            record["tokens_per_s"] = led.output_tokens / wall
    record["finished"] = _dt.datetime.now().astimezone().isoformat(timespec="seconds")
    if error:
        record["status"] = "failed"
        record["error"] = error
        _write_record(run_dir, record)
        raise RunFailed(f"{error} (record: {run_dir / 'run.json'})")
    if rs.compliance_test == "TEST06":
        record["test06"] = _test06(rs, model, run_dir)
        if not record["test06"]["passed"]:
            record["status"] = "failed"
            record["error"] = f"TEST06 failed: {record['test06']}"
            _write_record(run_dir, record)
            raise RunFailed(f"TEST06 verification failed: {record['test06']['verify_accuracy']!r} "
                            f"{record['test06'].get('failures')} (record: {run_dir / 'run.json'})")
    record["status"] = "ok"
    if rs.mode == "accuracy" and rs.accuracy_gate:
        record["accuracy"] = _accuracy_gate(rs, es, model, dataset, run_dir)
    _write_record(run_dir, record)
    return record


#: After a failure the ledger answers every outstanding sample, and LoadGen returns within seconds
#: (13,368 samples: well under one). If it has not returned after this long, the run stops waiting.
LOADGEN_DRAIN_S = 120.0


def interrupt_reason(e: KeyboardInterrupt) -> str:
    """``interrupted (<signal>)`` for the run record; a bare ``KeyboardInterrupt`` is Ctrl-C."""
    return f"interrupted ({e.args[0] if e.args else 'SIGINT, Ctrl-C'})"


def _start_test_interruptible(lg, sut_handle, qsl_handle, ts, ls, audit, sut,
                              stall_timeout_s) -> tuple[Optional[str], bool]:
    """Run StartTest on a thread; the main thread watches for Ctrl-C/SIGTERM, stalls and failures.

    Returns ``(error or None, whether StartTest returned)``. On Ctrl-C or a stall the ledger answers
    the outstanding samples empty so that LoadGen returns, and the run is reported failed. After any
    failure the main thread waits at most ``LOADGEN_DRAIN_S`` for LoadGen; a further Ctrl-C during
    that wait is only logged.
    """
    done = threading.Event()
    exc: list = []

    def target():
        try:
            lg.StartTestWithLogSettings(sut_handle, qsl_handle, ts, ls, audit)
        except BaseException as e:  # noqa: BLE001
            exc.append(e)
        finally:
            done.set()

    t = threading.Thread(target=target, name="loadgen", daemon=True)
    t.start()
    led = sut.ledger
    error = None
    failed_at = None
    while not done.is_set():
        try:
            if done.wait(0.5):
                break
            now = time.monotonic()
            last = led.last_complete_t or led.first_issue_t
            if error is None and last and led.outstanding and now - last > stall_timeout_s:
                error = f"no sample completed for {stall_timeout_s:.0f} s with {led.outstanding} outstanding (stall)"
                led.fail(error)
            if failed_at is None and (error or led.error):
                failed_at = now
            if failed_at is not None and now - failed_at > LOADGEN_DRAIN_S:
                error = f"{error or led.error}; LoadGen did not return within {LOADGEN_DRAIN_S:.0f} s after it"
                log.error("%s", error)
                break
        except KeyboardInterrupt as e:
            if error is None and led.error is None:
                error = interrupt_reason(e)
                led.fail(error)
            else:
                log.warning("already stopping (%s); waiting for LoadGen to return", error or led.error)
    if exc:
        error = error or f"LoadGen raised: {exc[0]!r}"
    return error, done.is_set()


def _accuracy_gate(rs: RunSettings, es: EngineSettings, model, dataset: Dataset, run_dir: Path) -> dict:
    tok = rs.tokenizer or es.model
    try:
        import accuracy
    except ImportError as e:  # pragma: no cover - the package ships with the project
        return {"skipped": f"accuracy package unavailable: {e}"}
    try:
        res = accuracy.run_gate(str(run_dir / "mlperf_log_accuracy.json"), rs.dataset, tok, str(run_dir),
                                eos_ids=list(model.eos_token_ids), max_samples=rs.max_samples)
    except Exception as e:  # noqa: BLE001 - the run itself succeeded; report why the gate did not run
        log.error("accuracy gate could not run: %s", e)
        return {"skipped": str(e)}
    return {"passed": res.get("passed"), "scores": res.get("scores"), "file": str(run_dir / "accuracy.json")}


def _write_record(run_dir: Path, record: dict) -> None:
    tmp = run_dir / "run.json.tmp"
    tmp.write_text(json.dumps(record, indent=2, default=str))
    os.replace(tmp, run_dir / "run.json")
