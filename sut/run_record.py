"""The run record (``run.json``) of a LoadGen run: its first version, LoadGen's results, the checks after the run.

``initial_record`` is what is on disk before any engine starts (settings, options, model, dataset,
versions, host); ``parse_loadgen_detail`` / ``token_latencies`` read LoadGen's results
(``streaming_latency_record``: with the harness's own TTFT/TPOT, trend and ``latency.png``);
``test06_record`` and ``accuracy_gate_record`` run the checks after a finished run;
``write_record`` replaces ``run.json`` atomically (``run.json.tmp``, then a rename; the temporary file is
removed when the write fails). A full file system must not leave a run "running": ``reserve_record_space``
sets :data:`RECORD_RESERVE_BYTES` aside in the run folder when it is made, and ``write_final_record`` frees
them to write the record again when a write fails for want of space (``ENOSPC``, ``EDQUOT``).
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import errno
import hashlib
import importlib.metadata as md
import json
import logging
import os
import platform
import shutil
import subprocess
from pathlib import Path
from typing import Optional

from sut import __version__
from sut.base import InputError
from sut.compliance import ComplianceError, verify_test06, write_test06
from sut.constants import MIN_DURATION_MS
from sut.dataset import Dataset
from sut.latency_figure import write_latency_figure
from sut.scenarios import LATENCY_LIMITS_MS, resolve_scenario

log = logging.getLogger("sut.harness")

def version(dist: str) -> Optional[str]:
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


def streaming_latency_record(scenario: str, timed: bool, results: dict, ledger, run_dir: Path) -> dict:
    """``run.json`` ``latency`` of a Server / Interactive run (``token_latencies``) from LoadGen's ``results`` and
    the streaming ``ledger``'s own figures, with the TTFT trend projected to LoadGen's 600 s against the
    scenario's TTFT limit; for a ``timed`` (performance) run also ``latency.png`` in ``run_dir``
    (``sut.latency_figure``; ``figure``: its name, None when not drawn). An accuracy run is not timed: no limit,
    no trend verdict, no figure."""
    limits = LATENCY_LIMITS_MS.get(scenario) or {}
    a = ledger.latency_arrays()
    harness = ledger.latency_summary(MIN_DURATION_MS / 1e3, limits.get("ttft") if timed else None, a)
    out = token_latencies(scenario, results, harness)
    if timed:
        title = (f"{scenario}, target_qps {results.get('effective_target_qps')}: {results.get('result_validity')} "
                 "(harness latencies)")
        fig = write_latency_figure(run_dir / "latency.png", title, (a["issued"], a["ttft"]), (a["issued"], a["tpot"]),
                                   limits, harness.get("ttft_trend"))
        out["figure"] = fig.name if fig else None
    return out


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
    return {"os": os_name(), "cpu": cpu, "cpu_count": os.cpu_count(), "gpu_driver": driver}


def os_name() -> str:
    """The distribution as MLPerf system descriptions name it (``/etc/os-release`` ``PRETTY_NAME``, e.g. "Debian
    GNU/Linux 12 (bookworm)") with the kernel release; ``platform.platform()`` where there is no os-release."""
    try:
        pretty = platform.freedesktop_os_release().get("PRETTY_NAME")
    except OSError:
        pretty = None
    return f"{pretty} (kernel {platform.release()})" if pretty else platform.platform()


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test06_record(rs, model, run_dir: Path, max_tokens: int) -> dict:
    """TEST06 checks on this run's sampled accuracy log (``max_tokens``: the run's, no answer may be longer);
    writes ``<run>/TEST06/``."""
    acc_log = run_dir / "mlperf_log_accuracy.json"
    try:
        res = verify_test06(acc_log, rs.scenario, model.eos_token_ids, max_tokens=max_tokens)
    except ComplianceError as e:
        return {"passed": False, "error": str(e), "verify_accuracy": None}
    write_test06(res, acc_log, run_dir)
    log.info("TEST06 on %d logged responses: %s", res.samples, res.verify_accuracy_txt().replace("\n", "; "))
    return {"passed": res.passed, "samples": res.samples, "eos_token_ids": list(model.eos_token_ids),
            "verify_accuracy": res.verify_accuracy_txt(), "failures": list(res.failures),
            "folder": str(run_dir / "TEST06")}


def gate_tokenizer(rs, es) -> Optional[str]:
    """The tokenizer the accuracy gate will load after the run: ``--tokenizer``, else the model folder; None when
    the run has no gate (``rs.mode`` not accuracy, or ``--no-accuracy-gate``). Called before anything starts.

    Raises ``InputError`` (exit 2) when there is none, naming ``--tokenizer PATH`` (fitting the run's dataset:
    the synthetic tokenizer next to synthetic data, a Llama 3 tokenizer for CNN/DailyMail) and ``--no-accuracy-gate``.
    """
    if rs.mode != "accuracy" or not rs.accuracy_gate:
        return None
    from accuracy.errors import AccuracyInputError
    from accuracy.preflight import resolve_gate_tokenizer

    try:
        return str(resolve_gate_tokenizer(rs.tokenizer, es.model, rs.dataset))
    except AccuracyInputError as e:
        raise InputError(str(e)) from None


def gate_preflight(rs, es, dataset: Optional[Dataset] = None) -> Optional[str]:
    """``gate_tokenizer``, then what the gate will read after the run, checked now: the kept dataset records each
    have a string ``output`` (the reference), the tokenizer loads (a few seconds), given the loaded ``dataset``
    every prompt id is inside the tokenizer's vocabulary (an id past it means another tokenizer made the data,
    and the gate would decode the outputs with the wrong one), and the tokenizer decodes the first records'
    ``tok_input`` to text holding their ``input`` (``accuracy.preflight.check_tokenizer_made``: another tokenizer
    of the same size). Raises ``InputError`` (exit 2, no run folder) naming
    the file (and sample), instead of an accuracy run that ends with "accuracy gate: not run" or a FAIL."""
    tok = gate_tokenizer(rs, es)
    if tok is None:
        return None
    from accuracy.dataset import load_gate_data
    from accuracy.errors import AccuracyInputError
    from accuracy.preflight import check_tokenizer_made
    from accuracy.tokenizer import load_tokenizer

    try:
        data = load_gate_data(rs.dataset, rs.max_samples)
    except AccuracyInputError as e:
        raise InputError(f"accuracy gate: {e} (the gate's references; or run with --no-accuracy-gate)") from None
    try:
        det = load_tokenizer(tok)
    except Exception as e:  # noqa: BLE001 - any tokenizer that does not load is bad input here
        raise InputError(f"accuracy gate: the tokenizer {tok} does not load: {e} (pass --tokenizer PATH, or run "
                         "with --no-accuracy-gate)") from None
    if dataset is not None:
        _check_prompt_ids(dataset, tok, det.vocab_size)
    try:
        check_tokenizer_made(det, data.probes, rs.dataset, in_a_run=True)
    except AccuracyInputError as e:
        raise InputError(f"accuracy gate: {e}") from None
    return tok


def _check_prompt_ids(dataset: Dataset, tok: str, vocab: int) -> None:
    """``InputError`` naming the first sample whose ``tok_input`` has an id >= ``vocab`` (the gate tokenizer's)."""
    from accuracy.preflight import tokenizer_hint

    for i, prompt in enumerate(dataset.prompts):
        if prompt.size and int(prompt.max()) >= vocab:
            raise InputError(
                f"accuracy gate: {dataset.path}: record {i}, field 'tok_input': id {int(prompt.max())} is outside the "
                f"vocabulary of the tokenizer {tok} ({vocab} ids), so it did not make this dataset; "
                f"{tokenizer_hint(dataset.path)}")


def rescore_command(accuracy_log: str, dataset: str, tokenizer: str, eos_ids=(), max_samples: Optional[int] = None
                    ) -> list[str]:
    """``python -m accuracy`` scoring an accuracy run's log as its gate does: the run's dataset, gate tokenizer,
    the model's EOS ids (a tokenizer folder may know fewer) and ``--max-samples`` when the run had it."""
    cmd = ["python", "-m", "accuracy", "--accuracy-log", accuracy_log, "--dataset", dataset, "--tokenizer", tokenizer]
    cmd += ["--eos-ids", ",".join(str(e) for e in eos_ids)] if eos_ids else []
    return cmd + (["--max-samples", str(max_samples)] if max_samples else [])


def accuracy_gate_record(rs, es, model, dataset: Dataset, run_dir: Path) -> dict:
    """Run the accuracy gate on a finished accuracy run; ``run.json``'s ``accuracy``: ``{passed, scores, file,
    figure}`` (``figure``: the output-length histogram's file name in the run folder, or None),
    or ``{skipped: why}`` when the gate could not run (the tokenizer was checked before the run: ``gate_tokenizer``)."""
    try:
        import accuracy
    except ImportError as e:  # pragma: no cover - the package ships with the project
        return {"skipped": f"accuracy package unavailable: {e}"}
    try:
        tok = gate_tokenizer(rs, es)
        res = accuracy.run_gate(str(run_dir / "mlperf_log_accuracy.json"), rs.dataset, tok, str(run_dir),
                                eos_ids=list(model.eos_token_ids), max_samples=rs.max_samples)
    except Exception as e:  # noqa: BLE001 - the run itself succeeded; report why the gate did not run
        log.error("accuracy gate could not run: %s", e)
        return {"skipped": str(e)}
    histogram = (res.get("files") or {}).get("histogram")
    return {"passed": res.get("passed"), "scores": res.get("scores"), "file": str(run_dir / "accuracy.json"),
            "figure": Path(histogram).name if histogram else None}


#: Bytes set aside in each run folder (:data:`RESERVE_NAME`) from its start until the run's last record is
#: written, freed to write that record when the file system is full. The largest ``run.json`` seen is ~49 KB
#: (a Flame run on one H200); the write needs it twice over for a moment (``run.json.tmp`` beside
#: ``run.json``): 1 MiB leaves ten times that.
RECORD_RESERVE_BYTES = 1 << 20
#: The reserve file in the run folder.
RESERVE_NAME = ".run.json.reserve"
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def no_space(e: BaseException) -> bool:
    """Whether ``e`` is a write that failed for want of space (``ENOSPC``, ``EDQUOT``)."""
    return isinstance(e, OSError) and e.errno in _NO_SPACE


def write_record(run_dir: Path, record: dict) -> None:
    """Replace ``<run_dir>/run.json`` with ``record`` (JSON) atomically: written to ``run.json.tmp``, then
    renamed. ``OSError`` when the write fails (the old ``run.json`` stays; ``run.json.tmp`` is removed)."""
    tmp = run_dir / "run.json.tmp"
    try:
        tmp.write_text(json.dumps(record, indent=2, default=str))
        os.replace(tmp, run_dir / "run.json")
    except BaseException:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        raise


def reserve_record_space(run_dir: Path) -> None:
    """Allocate :data:`RECORD_RESERVE_BYTES` in ``<run_dir>/.run.json.reserve`` (real blocks, not a sparse file).
    ``OSError`` (the partial file removed) when the file system has not that much free."""
    path = run_dir / RESERVE_NAME
    try:
        with open(path, "wb") as f:
            try:
                os.posix_fallocate(f.fileno(), 0, RECORD_RESERVE_BYTES)
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                f.write(b"\0" * RECORD_RESERVE_BYTES)  # a file system without fallocate
                f.flush()
                os.fsync(f.fileno())
    except BaseException:
        path.unlink(missing_ok=True)
        raise


def release_record_space(run_dir: Path) -> None:
    """Remove the run folder's reserve (nothing when there is none)."""
    try:
        (run_dir / RESERVE_NAME).unlink(missing_ok=True)
    except OSError as e:
        log.warning("cannot remove %s: %s", run_dir / RESERVE_NAME, e)


def write_final_record(run_dir: Path, record: dict) -> None:
    """:func:`write_record`; when it fails for want of space, the reserve is freed and it is written again.
    ``OSError`` when that fails too."""
    try:
        write_record(run_dir, record)
    except OSError as e:
        if not no_space(e):
            raise
        log.warning("no space left writing %s; freeing the space set aside for it", run_dir / "run.json")
        release_record_space(run_dir)
        write_record(run_dir, record)


def options_record(options) -> dict:
    """``run.json`` ``options``: the fields of the backend's options object (None: ``{}``)."""
    if options is None:
        return {}
    if dataclasses.is_dataclass(options) and not isinstance(options, type):
        return dataclasses.asdict(options)
    return dict(options)


def initial_record(rs, es, gen, options, model, dataset: Dataset, reasons: list, command: Optional[str],
                   audit_config: Optional[str], run_dir: Path) -> dict:
    """``run.json`` as written before the SUT starts (``status`` "running").

    ``rs`` / ``es`` / ``gen``: run, engine and generation settings; ``options``: the backend's
    options object; ``model``: ``sut.engine.ModelInfo``; ``reasons``: why the run is not compliant.
    """
    return {
        "record_version": 1,
        "status": "running",
        "kind": "mlperf-loadgen",
        "sut": rs.sut,
        "scenario": rs.scenario,
        "loadgen_scenario": resolve_scenario(rs.scenario, rs.model_key).loadgen,
        "mode": rs.mode,
        "model_key": rs.model_key,
        "compliance": {"compliant": not reasons, "reasons": reasons},
        "run_settings": dataclasses.asdict(rs),
        "engine_settings": dataclasses.asdict(es),
        "generation": dataclasses.asdict(gen),
        "options": options_record(options),
        "model": {"path": model.path, "config_sha256": model.config_sha256, "vocab_size": model.vocab_size,
                  "eos_token_ids": list(model.eos_token_ids)},
        "dataset": {"path": str(Path(rs.dataset).resolve()), "sha256": dataset.sha256, "samples": len(dataset),
                    "records_in_file": dataset.total_in_file, "prompt_tokens": dataset.length_stats()},
        "versions": {"project": __version__, "mlcommons-loadgen": version("mlcommons-loadgen"),
                     "python": platform.python_version(), "flamepy": version("flamepy")},
        "host": platform.node(),
        "host_info": host_info(),
        "command": command,
        "audit_config": ({"path": str(Path(audit_config).resolve()), "sha256": file_sha256(Path(audit_config))}
                         if audit_config else None),
        "started": now_iso(),
        "output_dir": str(run_dir),
    }


def now_iso() -> str:
    """Local time with its offset, to the second (``started`` / ``finished``)."""
    return _dt.datetime.now().astimezone().isoformat(timespec="seconds")
