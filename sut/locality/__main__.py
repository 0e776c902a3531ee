"""``python -m sut.locality {run,describe,report}``: synthetic-locality traces (NOT an MLPerf benchmark).

``run`` compares systems (``--systems standalone flame``) and routing policies (``--policies``) on one
trace with the study's pair protocol (``sut/locality/pairs.py``): for every pair, system and policy
fresh engines (Flame: fresh sessions) with prefix caching ON, two id-shifted warm-ups, then the timed
burst; every request validated. It writes ``<output-dir>/<name>-SYNTHETIC-LOCALITY-NOT-MLPERF/`` with
``locality.json``, ``locality.png`` and each case's engine logs (``--verbose``: on the console) and
prints the report. ``report RUN...`` merges the finished cases of several runs (device sessions) into
one new run folder with the same report (``sut/locality/merge.py``). ``describe`` prints the trace's shape without starting engines. Traces are random
token ids or, with ``--text news --dataset FILE [--tokenizer PATH]``, real CNN/DailyMail text;
``--trace-preset study-no-reuse|study-reuse`` sets the study's shape, ``--trace-preset arrivals|variable-answers|
hot-prefixes|eviction|replica-loss`` one of the workloads beyond it (``sut/locality/workloads``; explicit flags
override a preset).

Exit codes: 0 done; 1 a case failed (engine or session death, stall, a request that fails validation:
``locality.json`` says ``failed`` with the cause); 2 bad input, before the run folder is made and any
engine starts; 130 Ctrl-C or SIGTERM (engines stopped; the run folder removed, unless cases had finished: then
``locality.json`` says ``interrupted`` and ``report`` can merge them).
"""

from __future__ import annotations

if __name__ == "__main__":  # outside the project's environment: say how to enter it before the imports below fail
    from sut.exits import require_environment

    require_environment()

import argparse
import json
import logging
import os
import shutil
from pathlib import Path

from sut.core.routing import model_revision
from sut.core.transport import transport_class
from sut.core.transports.http_options import url_list
from sut.data.paths import first_missing
from sut.engine import (
    EngineSettings,
    GenerationSettings,
    ModelInfo,
    check_step_budget,
    check_weights_present,
    plan_engines,
    read_model_info,
)
from sut.errors import BadInput, EngineError, InputError, RunFailed
from sut.exits import ShortUsageParser, run_main, stop_on_sigterm_like_ctrl_c
from sut.locality import NOTICE
from sut.locality.cli_args import (
    POLICIES,
    _engine,
    _preset_overrides,
    _protocol,
    _routing,
    _trace_settings,
    _workload,
    add_commands,
)
from sut.locality.merge import build, write_merged
from sut.locality.own_flags import in_own_flags
from sut.locality.pairs import StudyContext
from sut.locality.report import describe_table, study_tables
from sut.locality.runner import command_line, make_run_dir, prepare_trace, run_study, runtime_versions
from sut.locality.systems import parse_system_options, resolve_systems
from sut.locality.trace import describe, make_trace, trace_hash
from sut.locality.workloads.eviction import size_documents
from sut.locality.workloads.hot_prefixes import popularity
from sut.locality.workloads.report import workload_shape

log = logging.getLogger("sut.locality")


def build_parser() -> argparse.ArgumentParser:
    """The command line (its flags and the settings read from them: ``sut.locality.cli_args``)."""
    return add_commands(ShortUsageParser(prog="python -m sut.locality", description=__doc__,
                                         formatter_class=argparse.RawDescriptionHelpFormatter))


def cmd_describe(a) -> int:
    ts, ws = _trace_settings(a), _workload(a)
    if ws.working_set and ws.kv_tokens:  # eviction sized against a given capacity: the run's very trace
        ts = size_documents(ts, ws.working_set, ws.kv_tokens)
    trace = make_trace(ts)
    shape = describe(trace)
    if ts.zipf_s > 0:
        shape["popularity"] = popularity(trace)
    if a.json:
        print(json.dumps(dict(shape, trace_hash=trace_hash(trace), max_prompt_tokens_possible=ts.max_prompt_tokens,
                              max_model_len_needed=ts.max_prompt_tokens + ts.max_tokens,
                              preset=a.trace_preset, workload=workload_shape(ts, ws, shape)), indent=2, default=list))
    else:
        print(describe_table(ts, shape, ws, a.trace_preset))
    return 0


def _model(es: EngineSettings) -> ModelInfo:
    """The model folder's facts; ``BadInput`` if it is unusable or too short for ``max_model_len``."""
    try:
        model = read_model_info(es.model)
    except EngineError as e:
        raise BadInput(f"error: {e}") from None
    if es.max_model_len > model.max_position_embeddings:
        raise BadInput(f"error: max_model_len {es.max_model_len} exceeds the model's max_position_embeddings "
                       f"{model.max_position_embeddings} ({es.model}/config.json); use shorter documents "
                       "(--doc-tokens) or fewer --max-tokens")
    return model


def _preflight_servers(systems, es: EngineSettings) -> None:
    """`vllm serve` replicas are checked as `python -m sut run --sut vllm-http` checks them, before the run
    folder: given URLs must answer and serve ``--model`` with a long enough context; servers to start here
    must be placeable and ``server_args`` must not set the harness's settings (``HttpSUT.preflight``)."""
    from sut.http_sut import HttpSUT

    for system in systems:
        if system.transport == "http":
            try:
                HttpSUT.preflight(system.options, es, confirm_prefix_caching=False)  # a study allows it
            except InputError as e:
                raise BadInput(f"error: system {system.name}: {e}") from None


def _check_workload(ts, ws, systems, replicas: int, rate: float, warmups: int) -> None:
    """The workloads' own checks before anything starts (``ValueError`` naming the flag)."""
    if ws.load_levels and rate:
        raise ValueError(f"--rate {rate:g} and --load-levels: the levels set the arrival rates (level x capacity); "
                         "give one of them")
    if ts.answers != "fixed":
        for s in systems:
            if not transport_class(s.transport).per_request_max_tokens:
                raise ValueError(f"--answers {ts.answers}: system {s.name}'s transport ({s.transport}) cannot ask each "
                                 "request its own answer length; use the in-process engines (leave out --http and "
                                 "--server-url) or --answers fixed")
    if ws.kill_after and replicas < 2:
        raise ValueError(f"--kill-after: replica-loss needs at least 2 replicas, the systems have {replicas} "
                         "(--engines-per-device 2 on one device)")
    if ws.kill_after and ws.kill_when == "time" and not warmups:
        raise ValueError("--kill-when time fires the kill at --kill-after x the last warm-up's wall time: give "
                         "--warmups 1 or more, or --kill-when answers")
    if ws.kill_after and ws.kill_replica >= replicas:
        raise ValueError(f"--kill-replica {ws.kill_replica}: the systems have replicas 0..{replicas - 1}")
    if ws.load_levels and ws.capacity_policy not in POLICIES:
        raise ValueError(f"--capacity-policy {ws.capacity_policy!r}: unknown policy; known: {', '.join(POLICIES)}")


def _prepare(a):
    """Every check before anything starts: settings, model, engine plan, systems, trace, warm-ups."""
    ts, ws = _trace_settings(a), _workload(a)
    if ws.working_set and ws.kv_tokens:
        ts = size_documents(ts, ws.working_set, ws.kv_tokens)
    es = _engine(a, ts, ws)
    ps = _protocol(a)
    model = _model(es)
    try:  # the replicas every system gets; refuses --device cuda without a GPU, too many CPU engines
        plan = plan_engines(es)
    except EngineError as e:
        raise BadInput(f"error: {e}") from None
    replicas = len(plan)
    if ws.working_set and not ws.kv_blocks and all(s.kind == "cpu" for s in plan):
        raise ValueError("eviction on CPU engines needs --kv-blocks N: without it every engine gets the CPU backend's "
                         "whole KV space (VLLM_CPU_KVCACHE_SPACE), so a trace sized to it runs thousands of requests "
                         "and one sized by --kv-tokens evicts nothing; docs/locality.md's CPU shape is --kv-blocks 12")
    if a.http and a.server_url:
        raise BadInput("error: --http starts servers here; --server-url uses running ones: give one of them")
    try:  # spaces or commas, as `sut run`; the transport's own URL parser (its replicas are these URLs)
        urls = list(url_list(",".join(a.server_url))) if a.server_url else []
    except ValueError as e:
        raise BadInput(f"error: --server-url: {e}") from None
    if urls:
        replicas = len(urls)
    systems = resolve_systems(a.systems, replicas, parse_system_options(a.system_option), http=a.http, urls=urls)
    _check_workload(ts, ws, systems, replicas, ps.rate, ps.warmups)
    _preflight_servers(systems, es)
    if any(s.transport == "local" for s in systems):  # engines in this process tree load --model from this host
        try:
            check_step_budget(es, plan)  # vLLM's default step budget there (vllm serve's: _preflight_servers)
            check_weights_present(es)
        except EngineError as e:
            raise BadInput(f"error: {e}") from None
    affinity = _routing(a, model_revision(es.model))
    prepared = prepare_trace(ts, ps.warmups, extra=max(0, len(ws.load_levels) - 1))
    if affinity.block_tokens > prepared.shape["prompt_max"] and "prefix_affinity" in ps.policies:
        log.warning("--block-tokens %d is longer than every prompt (max %d): prefix_affinity has no key and "
                    "routes every request least-loaded", affinity.block_tokens, prepared.shape["prompt_max"])
    gen = GenerationSettings(max_tokens=ts.max_tokens, ignore_eos=True, eos_token_ids=model.eos_token_ids)
    return es, gen, ps, model, systems, affinity, prepared, ws


def _run_dir(a, systems, made_from) -> Path:
    """Make the run folder under ``--output-dir``; ``BadInput`` when it exists or cannot be made, after removing
    the ``--output-dir`` folders made on the way (``made_from``: :func:`sut.data.paths.first_missing`'s answer)."""
    try:
        preset = getattr(a, "trace_preset", None)  # report (a merge) has none
        label = "-".join(([preset] if preset else []) + [s.name for s in systems]) or "merged"
        return make_run_dir(a.output_dir, a.run_name, label)
    except FileExistsError as e:
        raise BadInput(f"error: run folder {e.filename} already exists (choose another --run-name)") from None
    except OSError as e:
        _remove_made_empty(Path(a.output_dir), made_from)
        raise BadInput(f"error: cannot create the run folder under --output-dir {a.output_dir}: {e.strerror}") from None


def cmd_run(a) -> int:
    try:
        es, gen, ps, model, systems, affinity, prepared, ws = _prepare(a)
    except ValueError as e:
        raise BadInput(f"error: {e}") from None
    made_from = first_missing(Path(a.output_dir))
    d = _run_dir(a, systems, made_from)  # last: bad input never leaves a run folder behind
    log.warning("%s", NOTICE.upper())
    log.info("trace: %s", prepared.shape)
    stop_on_sigterm_like_ctrl_c()  # SIGTERM: engines shut down, finished cases kept (run_study)
    ctx = StudyContext(trace=prepared.trace, warmups=prepared.warmups, expected_hashes=prepared.input_hashes,
                       engine=es, generation=gen, affinity=affinity, run_dir=d, max_tokens=prepared.settings.max_tokens,
                       log_to_console=a.verbose, workload=ws, vocab_size=model.vocab_size)
    base = {"command": command_line(), "trace_preset": a.trace_preset, "runtime": runtime_versions(),
            "model": {"path": es.model, "config_sha256": model.config_sha256, "revision": affinity.model_revision},
            "engine_settings": es, "generation": gen, "router_settings": affinity, "notes": _preset_overrides(a)}
    if ws.load_levels:  # the pair report compares goodput per load level
        base["report_metric"] = "goodput_per_s"
    for note in base["notes"]:
        log.warning("%s", note)
    try:
        record, error = run_study(systems, prepared, ctx, ps, base)
    except KeyboardInterrupt:
        if (d / "locality.json").is_file():  # cases had finished: run_study recorded the run interrupted
            log.warning("kept the finished cases in %s (locality.json says interrupted; python -m sut.locality "
                        "report %s [RUN...] merges them)", d, d)
        else:
            shutil.rmtree(d, ignore_errors=True)
            _remove_made_empty(Path(a.output_dir), made_from)
        raise
    print(study_tables(record))
    if error:
        log.error("run failed: %s (record: %s)", error, record["record_path"])
        return 1
    return 0


def _remove_made_empty(base: Path, made_from) -> None:
    """Remove the folders of ``--output-dir`` this run made (from ``base`` up to ``made_from``) while empty."""
    if made_from is None:
        return
    path = base.absolute()
    while True:
        try:
            path.rmdir()
        except OSError:
            return
        if path == made_from:
            return
        path = path.parent


def cmd_report(a) -> int:
    """Merge the runs' finished cases into a new run folder; print its report (``sut.locality.merge``).
    Every check and the report come first (bad input: exit 2, no folder); a failure while writing or
    rendering the console table removes the half-written folder and the ``--output-dir`` folders it made (a file
    that cannot be written: ``RunFailed``, exit 1)."""
    merged = build(a.runs, command_line())
    made_from = first_missing(Path(a.output_dir))
    d = _run_dir(a, [], made_from)
    try:
        tables = study_tables(write_merged(merged, d))
    except BaseException as e:
        shutil.rmtree(d, ignore_errors=True)
        _remove_made_empty(Path(a.output_dir), made_from)
        if isinstance(e, OSError):
            raise RunFailed(f"cannot write the merged report into {d}: {e}") from e
        raise
    print(tables)
    return 0


def _main(argv) -> int:
    a = build_parser().parse_args(argv)
    a.verbose = a.verbose or a.sub_verbose
    # vLLM's INFO lines (KV-cache size, ...) go to RUN/<case>/engine-N.log; with --verbose DEBUG to the console
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "DEBUG" if a.verbose else "INFO")
    logging.basicConfig(level=logging.DEBUG if a.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    if a.cmd == "report":
        return cmd_report(a)
    if a.cmd == "describe":
        try:
            return cmd_describe(a)
        except ValueError as e:
            raise BadInput(f"error: {e}") from None
    try:
        return cmd_run(a)
    except (BadInput, InputError, RunFailed) as e:
        in_own_flags(e)
        raise


def main(argv=None) -> int:
    return run_main(_main, argv, messages={"interrupted": "interrupted ({}); engines stopped"},
                    logger=log)


if __name__ == "__main__":
    raise SystemExit(main())
