"""One LoadGen run end to end: settings → dataset → SUT → LoadGen → run record.

``run_benchmark(RunSettings, EngineSettings, GenerationSettings, options)`` is what
``python -m sut run`` calls. It checks the backend's options once (``SystemUnderTest.check_options``:
the options object is what the backend gets and what ``run.json`` records), reads ``user.conf``
once per process through ``TestSettings.FromConfig`` with the official model key and scenario
(``sut.settings.loadgen``; it also loads the embedded MLPerf mlperf.conf), builds the QSL and the
SUT, runs ``StartTestWithLogSettings`` on a helper thread (so Ctrl-C and engine death are noticed at
once; ``sut.run.loadgen_watch``), and writes ``run.json`` next to LoadGen's logs (``sut.record.write``). A
run that deviates from the official settings (quick mode, dataset subset, overridden duration or QPS,
fixed output length, prefix caching, a backend's own reasons: ``SystemUnderTest.noncompliance_reasons``)
is marked not compliant in the console, the folder name and the record.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import logging
import shlex
import shutil
import time
from pathlib import Path
from typing import Any, NoReturn, Optional

from accuracy.errors import AccuracyInputError
from accuracy.loadgen_log import read_accuracy_log
from sut import exits
from sut.base import SUTContext, SystemUnderTest, get_sut
from sut.constants import TEST06_AUDIT_CONFIG
from sut.core import guard
from sut.data.dataset import Dataset, load_dataset
from sut.engine import EngineSettings, GenerationSettings, read_model_info
from sut.errors import EngineError, InputError, RunFailed, ScenarioError
from sut.record.gate import accuracy_gate_record, gate_preflight, rescore_command
from sut.record.loadgen_log import parse_loadgen_detail
from sut.record.test06 import test06_record
from sut.record.write import (
    RECORD_RESERVE_BYTES,
    initial_record,
    no_space,
    now_iso,
    other_card,
    release_record_space,
    reserve_record_space,
    streaming_latency_record,
    unread_weights,
    untested_vllm,
    write_final_record,
    write_record,
)
from sut.run.loadgen_watch import LoadGenObjects, interrupt_reason, run_loadgen
from sut.scenarios import check_backend, resolve_scenario
from sut.settings.loadgen import loadgen_test_settings
from sut.settings.run import RunSettings
from sut.settings.userconf import check_audit_config

log = logging.getLogger(__name__)


def _run_dir(rs: RunSettings, compliant: bool) -> Path:
    """Make the run folder; ``InputError`` if a ``--run-name`` folder exists or it cannot be made (before anything
    starts). A default name (``<time>-<sut>-<scenario>-<mode>``, to the second) taken by another run started in the
    same second gets ``-2``, ``-3``, ... instead."""
    name = rs.run_name or (f"{_dt.datetime.now().strftime('%Y%m%d-%H%M%S')}-{rs.sut}-{rs.scenario}-"
                           f"{rs.compliance_test or rs.mode}")
    suffix = "-NOT-COMPLIANT" if not compliant and "NOT-COMPLIANT" not in name else ""
    for n in range(1, 100 if rs.run_name is None else 2):
        d = Path(rs.output_dir) / (name + (f"-{n}" if n > 1 else "") + suffix)
        try:
            d.mkdir(parents=True, exist_ok=False)
            return d
        except FileExistsError as e:
            taken = e.filename
        except OSError as e:
            raise InputError(f"cannot create the run folder under --output-dir {rs.output_dir}: {e.strerror}") from None
    raise InputError(f"run folder {taken} already exists (choose another --run-name)")


def _check_backend(rs: RunSettings, es: EngineSettings, options: Any) -> tuple[type[SystemUnderTest], Any]:
    """The backend class and its options object (parsed once here; an object passes through).

    Raises ``InputError`` for an unknown SUT, bad options, a scenario the backend cannot run or
    engines that cannot run on this host: all before the run folder exists.
    """
    try:
        backend = get_sut(rs.sut)
    except KeyError as e:
        raise InputError(e.args[0]) from None
    backend.check_settings(es)  # e.g. vllm-http with an admission interval: before any server is contacted
    backend.check_engine(es)  # e.g. --device cuda without a GPU: exit 2 before the run folder or any server
    options = backend.check_options(options)
    try:
        check_backend(rs.sut, resolve_scenario(rs.scenario, rs.model_key))  # flame + Server: exit 2, nothing started
    except ScenarioError as e:
        raise InputError(str(e)) from None
    try:  # the one guard, before the run folder (transports call it again when they start)
        guard.check_settings(es.enable_prefix_caching, getattr(options, "allow_prefix_caching", False))
    except guard.PrefixCachingError as e:
        raise InputError(f"{e}; an experiment may pass --option allow_prefix_caching=true (the run is "
                         "then not compliant)") from None
    backend.preflight(options, es)  # e.g. a given vLLM server serves another model
    return backend, options


def _audit_config(rs: RunSettings) -> Optional[str]:
    """The audit config in effect (``--audit-config``, TEST06's); ``InputError`` if it is missing or a line of it
    is one LoadGen would reject or drop (``check_audit_config``)."""
    audit_config = rs.audit_config or (str(TEST06_AUDIT_CONFIG) if rs.compliance_test == "TEST06" else None)
    if audit_config and not Path(audit_config).is_file():  # LoadGen would silently run without it
        raise InputError(f"audit config {audit_config} is not a regular file" if Path(audit_config).exists()
                         else f"audit config not found: {audit_config}")
    if audit_config:
        check_audit_config(audit_config)
    return audit_config


def _noncompliance_reasons(gen: GenerationSettings, es: EngineSettings, audit_config: Optional[str],
                           backend: type[SystemUnderTest], options: Any) -> list[str]:
    """Why the run is not an MLPerf result, beyond its LoadGen settings (generation, audit config,
    dummy weights, prefix caching, the backend's own reasons)."""
    reasons = []
    if gen.ignore_eos:
        reasons.append("benchmark-only fixed output length (ignore_eos): outputs do not stop at EOS")
    if gen.max_tokens != 128 or gen.min_tokens != 1:
        reasons.append(f"max_tokens/min_tokens {gen.max_tokens}/{gen.min_tokens} differ from the reference 128/1")
    if audit_config:
        reasons.append(f"audit config {audit_config} in effect (a compliance test run, not a result)")
    if es.load_format == "dummy":
        reasons.append("dummy (random) weights (load_format dummy): a throughput figure, not the model under test")
    if es.enable_prefix_caching:
        reasons.append("prefix caching on: cross-query KV reuse is not allowed in MLPerf")
    if getattr(options, "allow_prefix_caching", False):
        reasons.append("option allow_prefix_caching=true: the engines may reuse KV across queries (experiments only)")
    return reasons + list(backend.noncompliance_reasons(options))


def prepare_run(rs: RunSettings, es: EngineSettings, gen: GenerationSettings, options: Any = None):
    """Everything a run checks before its folder exists: ``(backend class, options object, model info,
    generation settings with the model's EOS ids, dataset)``; an accuracy run's gate tokenizer is checked too.

    Raises ``InputError`` / ``DatasetError`` (bad input: nothing started, no run folder).
    """
    backend, options = _check_backend(rs, es, options)
    try:
        model = read_model_info(es.model)
    except EngineError as e:  # an unusable model folder is bad input
        raise InputError(str(e)) from None
    if 0 < model.max_model_len_limit < es.max_model_len:  # vLLM would refuse it only once the engine starts
        raise InputError(f"max_model_len {es.max_model_len} (--max-model-len or the preset's [engine] max_model_len) "
                         f"exceeds the model's max_position_embeddings {model.max_model_len_limit} "
                         f"({es.model}/config.json)")
    if not gen.eos_token_ids:
        gen = dataclasses.replace(gen, eos_token_ids=model.eos_token_ids)
    outside = [t for t in gen.eos_token_ids if not 0 <= t < model.vocab_size]
    if outside:  # no answer could ever end with them: every EOS check would be against ids the model cannot make
        raise InputError(f"[generation] eos_token_ids {outside} are outside the model's vocabulary [0, "
                         f"{model.vocab_size}) ({es.model}/config.json)")
    dataset = load_dataset(rs.dataset, model.vocab_size, es.max_model_len, rs.max_samples, reserve=gen.max_tokens)
    gate_preflight(rs, es, dataset)  # the gate's tokenizer, references, prompt ids: bad input now, not after the run
    return backend, options, model, gen, dataset


def open_run(rs: RunSettings, es: EngineSettings, gen: GenerationSettings, options: Any, model, dataset: Dataset,
             reasons: list[str], command: Optional[str], audit_config: Optional[str]) -> tuple[Path, dict]:
    """Make the run folder (``-NOT-COMPLIANT`` when ``reasons``), copy user.conf (and the preset, as
    ``preset.toml``) there and write the first ``run.json`` (status ``running``), with the space its failed
    record may need set aside (``sut.record.write.reserve_record_space``); returns ``(run folder, record)``.
    ``InputError`` if the folder exists or cannot be written (the folder is removed again)."""
    run_dir = _run_dir(rs, not reasons)
    if reasons:
        log.warning("THIS RUN IS NOT COMPLIANT: %s", "; ".join(reasons))
    if Path("audit.config").exists() and not rs.audit_config:
        log.warning("./audit.config exists but is ignored (pass --audit-config to use it)")
    try:
        reserve_record_space(run_dir)  # for the failed record, should the file system fill up
        record = initial_record(rs, es, gen, options, model, dataset, reasons, command, audit_config, run_dir)
        shutil.copy2(rs.user_conf, run_dir / "user.conf")
        if rs.preset:
            shutil.copy2(rs.preset, run_dir / "preset.toml")
        write_record(run_dir, record)
    except OSError as e:  # nothing started yet: no run folder left behind
        shutil.rmtree(run_dir, ignore_errors=True)
        full = (f"; a run needs {RECORD_RESERVE_BYTES >> 20} MiB free for its record, plus its logs"
                if no_space(e) else "")
        raise InputError(f"cannot write the run folder {run_dir}: {e.strerror or e}{full}") from None
    return run_dir, record


def mark_failed(record: dict, error: str) -> None:
    """``status`` failed with ``error``. A failed run has no ``validity`` (null): LoadGen's word (often VALID:
    samples answered empty count as completed) moves to ``loadgen_validity``, and ``samples_per_s`` /
    ``tokens_per_s`` to ``loadgen_samples_per_s`` / ``loadgen_tokens_per_s``: not a measurement."""
    record["status"] = "failed"
    record["error"] = error
    for key in ("validity", "samples_per_s", "tokens_per_s"):
        if record.get(key) is not None:
            record[f"loadgen_{key}"] = record[key]
            record[key] = None


def failure_cause(e: BaseException) -> str:
    """What ``run.json`` ``error`` says of an exception that ended a run."""
    if isinstance(e, KeyboardInterrupt):
        return interrupt_reason(e)
    if no_space(e):
        return f"no space left on device writing {e.filename or 'a file'} (the run folder's file system is full)"
    return f"{type(e).__name__}: {e}"


def _status_on_disk(run_dir: Path) -> Optional[str]:
    """``status`` of ``<run_dir>/run.json`` as written ("running" when it cannot be read)."""
    try:
        return json.loads((run_dir / "run.json").read_text()).get("status")
    except (OSError, ValueError, AttributeError):
        return "running"


def record_failure(run_dir: Path, record: dict, e: BaseException) -> None:
    """A run whose ``run.json`` does not yet say how it ended when ``e`` ended it (still ``running``, in
    ``record`` or on disk: a last write that failed) is recorded ``failed`` with the cause; on a full file
    system with the space set aside for it. The reserve is freed in any case; a record that cannot be written
    even so is logged, and ``e`` goes on."""
    try:
        if record.get("status") == "running" or _status_on_disk(run_dir) == "running":
            mark_failed(record, record.get("error") or failure_cause(e))
            record["finished"] = now_iso()
            try:
                write_final_record(run_dir, record)
            except OSError as w:
                log.error("cannot record the failure in %s: %s", run_dir / "run.json", w)
    finally:
        release_record_space(run_dir)


def raise_recorded(run_dir: Path, record: dict, e: BaseException) -> NoReturn:
    """Record ``e`` as the run's failure (``record_failure``), then raise it again, or a ``RunFailed`` (exit 1, no
    traceback) in its place when a write failed for want of space, in a run folder that refuses writes (read-only,
    permissions), or because the run folder was removed."""
    if isinstance(e, FileNotFoundError) and not run_dir.is_dir():
        raise RunFailed(f"the run folder {run_dir} was removed during the run: the run cannot be recorded "
                        f"({failure_cause(e)})") from e
    record_failure(run_dir, record, e)
    if no_space(e):
        raise RunFailed(f"{failure_cause(e)} (record: {run_dir / 'run.json'})") from e
    if _in_run_folder(e, run_dir):  # e.g. the folder turned read-only: a cause, not a crash
        said = "records" if _status_on_disk(run_dir) == "failed" else "could not record (it may still say 'running')"
        raise RunFailed(f"cannot write in the run folder {run_dir}: {e.strerror or e} ({e.filename}); "
                        f"run.json {said} the failure") from e
    raise e


def _in_run_folder(e: BaseException, run_dir: Path) -> bool:
    """True for an ``OSError`` about a file of ``run_dir`` (its ``filename`` there)."""
    name = getattr(e, "filename", None) if isinstance(e, OSError) else None
    return bool(name) and Path(str(name)).resolve().parent == run_dir.resolve()


def run_benchmark(rs: RunSettings, es: EngineSettings, gen: GenerationSettings, options: Any = None,
                  command: Optional[str] = None) -> dict:
    """Run one LoadGen test and return the run record (also written to ``run.json``).

    ``options``: the backend's options object, or a mapping of its fields (parsed here, once);
    ``command`` is the command line to record (the CLI passes its own); the run folder also keeps
    a copy of the user.conf it read. (Several tests over one SUT start: ``sut.run.series``.)

    Raises:
        InputError / DatasetError: bad input (before any engine starts, no run folder left).
        RunFailed / TransportError / EngineError: the run could not finish trustworthily; ``run.json``
            still records why.
    """
    backend, options, model, gen, dataset = prepare_run(rs, es, gen, options)
    ts, reasons = loadgen_test_settings(rs, len(dataset))
    audit_config = _audit_config(rs)
    reasons += _noncompliance_reasons(gen, es, audit_config, backend, options)
    run_dir, record = open_run(rs, es, gen, options, model, dataset, reasons, command, audit_config)
    try:
        return _execute(rs, es, gen, backend, options, model, dataset, ts, audit_config, run_dir, record)
    except BaseException as e:  # noqa: BLE001 - recorded, then re-raised
        raise_recorded(run_dir, record, e)
    finally:
        release_record_space(run_dir)


def _execute(rs: RunSettings, es: EngineSettings, gen: GenerationSettings, backend: type[SystemUnderTest],
             options: Any, model, dataset: Dataset, ts, audit_config: Optional[str], run_dir: Path,
             record: dict, make_sut=None, first_request_id: int = 0) -> dict:
    """Start the SUT, run LoadGen, check and record (the body of ``run_benchmark``; ``record`` last).
    ``make_sut(ctx)`` builds the SUT (default: ``backend(ctx)``); ``first_request_id``: its ledger's first id."""
    ctx = SUTContext(dataset=dataset, engine=es, generation=gen, options=options, progress=rs.progress,
                     scenario=rs.scenario, first_request_id=first_request_id, vocab_size=model.vocab_size,
                     engine_log_dir=None if rs.engine_console else str(run_dir), run_dir=str(run_dir),
                     stall_timeout_s=rs.stall_timeout_s)
    sut = (make_sut or backend)(ctx)
    error, wall = _run_sut(sut, rs, dataset, ts, audit_config, run_dir, record)
    error = _collect_results(sut, rs, run_dir, record, error, wall)
    return _finish(rs, es, model, dataset, run_dir, record, error)


def _run_sut(sut: SystemUnderTest, rs: RunSettings, dataset: Dataset, ts, audit_config: Optional[str],
             run_dir: Path, record: dict) -> tuple[Optional[str], Optional[float]]:
    """Start the SUT, run LoadGen, stop the SUT (always). Returns ``(error or None, wall seconds of the
    LoadGen test or None)``; start failures propagate (``run_benchmark`` records them)."""
    import mlperf_loadgen as lg

    objs = LoadGenObjects()
    error: Optional[str] = None
    try:
        _start_sut(sut, record, run_dir)
        error = run_loadgen(lg, sut, rs, dataset, ts, audit_config, run_dir, objs)
        error = error or sut.ledger.error or sut.end_check()
    except KeyboardInterrupt as e:
        error = interrupt_reason(e)
    finally:
        stopped = _stop_sut(sut, lg, objs)
    return error or stopped, (time.monotonic() - objs.t_start if objs.t_start else None)


def _stop_sut(sut: SystemUnderTest, lg, objs: LoadGenObjects) -> Optional[str]:
    """Stop the SUT (its engines and servers ended), close its ledger, destroy LoadGen's objects or, while its
    thread still runs, leave them to ``run_main``'s ``os._exit``. A stop signal that arrives meanwhile does not cut
    this short (``exits.stops_held``: an engine or server group half ended would outlive the run, and a normal exit
    under LoadGen's thread crashes); returns its ``interrupted (...)`` reason, else None."""
    stopped = None
    try:
        with exits.stops_held():
            try:
                sut.stop()
            finally:
                sut.ledger.close()  # every queued answer sent and counted (backends close it too; idempotent)
    except KeyboardInterrupt as e:
        stopped = interrupt_reason(e)
    finally:
        objs.destroy(lg)
        if not objs.returned:  # its C++ objects must not be destroyed under it: run_main ends with os._exit
            exits.leave_without_cleanup("LoadGen's StartTest thread")
    return stopped


def _start_sut(sut: SystemUnderTest, record: dict, run_dir: Path) -> None:
    """``sut.start()``; its engines (read-back args, devices, versions) go on disk before LoadGen starts, with
    the compliance reasons the SUT learnt as it started (``noncompliance_reasons`` in what ``start`` returns)."""
    started = dict(sut.start())
    late = started.pop("noncompliance_reasons", None) or []
    if late:
        comp = record["compliance"]
        comp["reasons"] = list(comp["reasons"]) + [r for r in late if r not in comp["reasons"]]
        comp["compliant"] = False
    record.update(started)
    engines = started.get("engines") or []
    record["prefix_caching"] = {"enabled": any(e.get("enable_prefix_caching") for e in engines),
                                "read_back_from_engines": bool(engines)}
    if engines:
        record["versions"].update(vllm=engines[0].get("vllm_version"), torch=engines[0].get("torch_version"))
        record["devices"] = [e.get("device") for e in engines]
        tuned_on = (record.get("run_settings") or {}).get("tuned_on")
        for warning in (untested_vllm(e.get("vllm_version") for e in engines), other_card(tuned_on, record["devices"]),
                        unread_weights(engines)):
            if warning:
                log.warning("%s", warning)
                record.setdefault("warnings", []).append(warning)
    write_record(run_dir, record)



def _collect_results(sut: SystemUnderTest, rs: RunSettings, run_dir: Path, record: dict, error: Optional[str],
                     wall: Optional[float]) -> Optional[str]:
    """Ledger counts, LoadGen's results, latencies and throughput into ``record``; returns the run's
    error (also one the ledger found: a sample never answered, or answered without a first token)."""
    error = error or sut.ledger.error
    led = sut.ledger
    record.update(sut.record())
    record["ledger"] = {"issued": led.issued, "completed": led.completed, "answered_empty": led.answered_empty,
                        "output_tokens": led.output_tokens}
    if error is None and led.completed != led.issued:
        error = f"{led.issued - led.completed} issued sample(s) were never answered"
    results = parse_loadgen_detail(run_dir / "mlperf_log_detail.txt")
    record["loadgen"] = results
    error = error or loadgen_logs_error(rs, run_dir, results, led.issued)
    if hasattr(led, "first_sent"):  # Server / Interactive
        record["ledger"]["first_tokens"] = led.first_sent
        record["latency"] = streaming_latency_record(rs.scenario, rs.mode == "performance", results, led, run_dir)
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
    record["finished"] = now_iso()
    return error


#: Free bytes below which ``loadgen_logs_error`` names a full file system as the cause (LoadGen writes its logs in
#: pieces of a few KiB; a summary alone is ~3 KiB).
FULL_DISK_BYTES = 1 << 20


def loadgen_logs_error(rs: RunSettings, run_dir: Path, results: dict, issued: int) -> Optional[str]:
    """Why LoadGen's logs of a run that otherwise ended well cannot stand for it (None: they can). LoadGen writes
    them through C++ streams and reports no write error, so a disk that filled (and freed) during the run, or a log
    removed meanwhile, would otherwise leave a record "ok" over missing or cut-off logs: a performance run needs
    ``mlperf_log_summary.txt`` and a result in ``mlperf_log_detail.txt``; an accuracy run needs
    ``mlperf_log_accuracy.json`` to be a JSON list of exactly one entry per issued sample."""
    if rs.mode == "performance":
        summary = run_dir / "mlperf_log_summary.txt"
        if results.get("result_validity") is None:
            return f"LoadGen's mlperf_log_detail.txt holds no result ({_logs_gone(run_dir)})"
        if not summary.is_file() or summary.stat().st_size == 0:
            return f"LoadGen's mlperf_log_summary.txt is {_logs_gone(run_dir)}"
        return None
    if rs.mode == "accuracy":
        try:
            n = len(read_accuracy_log(run_dir / "mlperf_log_accuracy.json"))
        except AccuracyInputError as e:
            return f"LoadGen's accuracy log is {_logs_gone(run_dir)} ({e})"
        if n != issued:
            return f"LoadGen's accuracy log holds {n} entries for {issued} issued samples ({_logs_gone(run_dir)})"
    return None


def _logs_gone(run_dir: Path) -> str:
    """The likely cause of bad LoadGen logs, for ``loadgen_logs_error``: a full file system when it is (the console
    then has ENOSPC lines), else the general one."""
    try:
        free = shutil.disk_usage(run_dir).free
    except OSError:
        free = None
    if free is not None and free < FULL_DISK_BYTES:
        return f"missing or cut off: the run folder's file system is full ({free:,} bytes free)"
    return "missing, unreadable or cut off: a disk that filled or a run folder changed during the run?"


def _fail(run_dir: Path, record: dict, error: str, message: str) -> RunFailed:
    """Record the run as failed with ``error`` (``mark_failed``); the ``RunFailed`` to raise says ``message``."""
    mark_failed(record, error)
    write_record(run_dir, record)
    return RunFailed(f"{message} (record: {run_dir / 'run.json'})")


def _finish(rs: RunSettings, es: EngineSettings, model, dataset: Dataset, run_dir: Path, record: dict,
            error: Optional[str]) -> dict:
    """Fail the run on ``error``, else the checks after it (TEST06, the accuracy gate); ``run.json`` final."""
    if error:
        raise _fail(run_dir, record, error, error)
    if rs.compliance_test == "TEST06":
        t06 = record["test06"] = test06_record(rs, model, run_dir, record["generation"]["max_tokens"])
        if not t06["passed"]:
            raise _fail(run_dir, record, f"TEST06 failed: {t06}",
                        f"TEST06 verification failed: {t06['verify_accuracy']!r} {t06.get('failures')}")
    record["status"] = "ok"
    if rs.mode == "accuracy" and rs.accuracy_gate:
        try:
            record["accuracy"] = accuracy_gate_record(rs, es, model, dataset, run_dir)
        except KeyboardInterrupt as e:  # exit 130; run.json must not stay "running"
            _gate_interrupted(rs, es, run_dir, record, e, getattr(model, "eos_token_ids", ()))
            raise
    write_record(run_dir, record)
    return record


def _gate_interrupted(rs: RunSettings, es: EngineSettings, run_dir: Path, record: dict, e: KeyboardInterrupt,
                      eos_ids) -> None:
    """A stop during the accuracy gate: the LoadGen run is complete (status stays ``ok``, so ``package`` takes it
    once it is scored), its ``accuracy`` says the gate was interrupted, with the command that scores it."""
    cmd = shlex.join(rescore_command(str(run_dir / "mlperf_log_accuracy.json"), str(rs.dataset),
                                     str(rs.tokenizer or es.model), eos_ids, rs.max_samples))  # gate_tokenizer's
    why = f"{interrupt_reason(e)} during the accuracy gate; the LoadGen run is complete: score it with {cmd}"
    record["accuracy"] = {"skipped": why}
    record["finished"] = now_iso()
    write_record(run_dir, record)
    log.error("%s", why)
