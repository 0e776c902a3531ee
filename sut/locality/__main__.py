"""``python -m sut.locality {run,describe,report}``: synthetic-locality traces (NOT an MLPerf benchmark).

``run`` compares systems (``--systems standalone flame``) and routing policies (``--policies``) on one
trace with the study's pair protocol (``sut/locality/pairs.py``): for every pair, system and policy
fresh engines (Flame: fresh sessions) with prefix caching ON, two id-shifted warm-ups, then the timed
burst; every request validated. It writes ``<output-dir>/<name>-SYNTHETIC-LOCALITY-NOT-MLPERF/`` with
``locality.json``, ``locality.png`` and each case's engine logs (``--verbose``: on the console) and
prints the report. ``report RUN...`` merges the finished cases of several runs (device sessions) into
one new run folder with the same report (``sut/locality/merge.py``). ``describe`` prints the trace's shape without starting engines. Traces are random
token ids or, with ``--text news --dataset FILE [--tokenizer PATH]``, real CNN/DailyMail text;
``--trace-preset study-no-reuse|study-reuse`` sets the study's shape (explicit flags override it).

Exit codes: 0 done; 1 a case failed (engine or session death, stall, a request that fails validation:
``locality.json`` says ``failed`` with the cause); 2 bad input, before the run folder is made and any
engine starts; 130 Ctrl-C or SIGTERM (engines stopped; the run folder removed, unless cases had finished: then
``locality.json`` says ``interrupted`` and ``report`` can merge them).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import typing
from pathlib import Path

from sut.cli_flags import add_engine_flags, engine_defaults, engine_settings_from_args
from sut.core.routing import RELEASE_GATES, ROUTERS, AffinitySettings, model_revision
from sut.core.transports.http_options import url_list
from sut.engine import EngineError, EngineSettings, GenerationSettings, ModelInfo, plan_engines, read_model_info
from sut.engine.settings import MAX_SEED
from sut.base import InputError, RunFailed
from sut.exits import BadInput, run_main, stop_on_sigterm_like_ctrl_c
from sut.locality import NOTICE
from sut.locality.merge import build, write_merged
from sut.locality.own_flags import in_own_flags
from sut.locality.pairs import PairSettings, StudyContext
from sut.locality.report import describe_table, study_tables
from sut.locality.runner import command_line, make_run_dir, prepare_trace, run_study, runtime_versions
from sut.locality.systems import SYSTEMS, parse_system_options, resolve_systems
from sut.locality.trace import TRACE_PRESETS, TraceSettings, describe, make_trace, trace_hash

log = logging.getLogger("sut.locality")

_VERBOSE_HELP = ("debug logging, and vLLM's own output (its logs, warnings and the harmless 'Chat template warmup "
                 "failed' traceback) on the console instead of RUN/<case>/engine-N.log")
#: ``-v`` of the commands that start no engine (``describe``, ``report``).
_VERBOSE_NO_ENGINE_HELP = "debug logging (this command starts no engine)"


def _defaults(cls) -> dict:
    return {f.name: f.default for f in dataclasses.fields(cls)}


_TD, _AD, _PD = _defaults(TraceSettings), _defaults(AffinitySettings), _defaults(PairSettings)


def _flags(cls) -> dict:
    """name -> (argparse type or ``{"choices": ...}``, help) of the fields of ``cls`` declared with
    ``sut.locality.knob`` (a help in their metadata)."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        if "help" in f.metadata:
            kind = [t for t in typing.get_args(hints[f.name]) if t is not type(None)] or [hints[f.name]]
            out[f.name] = ({"choices": f.metadata["choices"]} if "choices" in f.metadata else kind[0],
                           f.metadata["help"].replace("%", "%%"))
    return out


# name -> (argparse keywords, help); "(default ...)" is appended from the settings dataclass
_TRACE = _flags(TraceSettings)
_PROTOCOL = _flags(PairSettings)
_ROUTER = {
    "block_tokens": (int, "prefix_affinity: tokens per hashed block of the prompt"),
    "prefix_blocks": (int, "prefix_affinity: blocks hashed per prompt (the key covers the first "
                           "block_tokens x prefix_blocks tokens; shorter prompts go least-loaded)"),
    "release_tokens": (int, "prefix_affinity: estimated uncached prefill tokens in flight beyond which an owner's "
                            "request may go elsewhere (see --release-gate); about peak prefill tokens/s x the extra "
                            "TTFT you accept"),
    "release_gate": ({"choices": RELEASE_GATES}, "prefix_affinity: excess = release when the owner's uncached work "
                     "exceeds the least busy replica's by --release-tokens (a burst that loads every replica alike "
                     "keeps affinity); absolute = when it exceeds --release-tokens by itself (a TTFT bound per owner); never = no "
                     "release (the study's router; default of the study trace presets, else excess)"),
    "max_entries": (int, "prefix_affinity: affinity map size, block hashes (LRU)"),
    "decode_weight": (float, "least_loaded, prefix_affinity: a request's estimated work = uncached prompt tokens + "
                             "decode_weight x --max-tokens"),
}
_DEFAULT_LEN = TraceSettings().max_prompt_tokens + TraceSettings().max_tokens
_ENGINE_HELP = {
    "model": "HF model folder (config.json; weights unless --load-format dummy) (required)",
    "max_model_len": f"context length of every engine; default: the trace's longest possible prompt + --max-tokens "
                     f"({_DEFAULT_LEN:,} for the default ~8K-token documents: {_TD['doc_tokens']:,} x "
                     f"{1 + _TD['doc_jitter']:g} + BOS + question + {_TD['max_tokens']}); must not exceed the model's "
                     "max_position_embeddings (Llama 3.1: 131,072; the tiny CPU model: 8,192 -> use --doc-tokens <= 7000)",
    "device": "auto (every visible GPU, else CPU) | cuda | cpu (default auto)",
    "engines_per_device": "replicas per GPU (sharing its memory) or number of CPU replicas (default 1); every system "
                          "gets this many replicas, replica r on the same device",
}
_PRESET_HELP = ("the study's traces (../shared/research/study.md): study-no-reuse = 64 news documents x 1 question, "
                "study-reuse = 64 x 4 = 256 requests; ~8K-token documents, one shuffled burst (--rate 0), exactly 16 "
                "new tokens each (--max-tokens 16), --text news (needs --dataset); explicit flags override the preset")


def _add(group, fields: dict, defaults: dict) -> None:
    for name, (kind, help_) in fields.items():
        kw = dict(kind) if isinstance(kind, dict) else {"type": kind}
        if defaults.get(name) is not None:
            help_ += f" (default {defaults[name]})"
        group.add_argument("--" + name.replace("_", "-"), dest=name, help=help_, **kw)


def _pick(a, fields: dict) -> dict:
    """The fields given on the command line (the rest keep their dataclass defaults)."""
    return {name: getattr(a, name) for name in fields if getattr(a, name, None) is not None}


def _add_run_flags(s) -> None:
    y = s.add_argument_group("systems (sut/locality/systems.py)")
    y.add_argument("--systems", nargs="+", default=["standalone"], metavar="SYSTEM",
                   help=f"systems to compare, any of: {', '.join(SYSTEMS)} (default standalone). standalone = vLLM "
                        "engines of this host; flame = the Flame transport (needs a Flame control plane: "
                        "FLAME_ENDPOINT, see docs/locality.md) with the study's settings: batch limit 128, window 10 ms, "
                        "zlib payloads, frozen start-up heap")
    y.add_argument("--http", action="store_true", help="standalone = `vllm serve` replicas started here (the study's "
                   "standalone path) instead of in-process engines")
    y.add_argument("--server-url", nargs="+", metavar="URL", help="standalone = these running `vllm serve` servers "
                   "(one replica each, space- or comma-separated; engines are then not fresh per pair); each must "
                   "answer and serve --model before anything starts (exit 2)")
    y.add_argument("--system-option", action="append", default=[], metavar="SYSTEM.KEY=VALUE",
                   help="an option of a system's transport (JSON value, else a string), e.g. flame.batch_size=64 or "
                        "standalone.dispatch_chunk=64; repeatable")
    r = s.add_argument_group("routing (sut/core/routing AffinitySettings)")
    r.add_argument("--policies", nargs="+", help=f"routing policies, each run per system and pair: {', '.join(ROUTERS)} "
                   "(default round_robin least_loaded prefix_affinity)")
    _add(r, _ROUTER, _AD)
    g = s.add_argument_group("protocol (sut/locality/pairs.py PairSettings)")
    _add(g, _PROTOCOL, _PD)
    g.add_argument("--output-dir", default="results/locality", help="base folder of the run folders "
                   "(default results/locality)")
    g.add_argument("--run-name", help="run folder name prefix (default: time + systems)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    e = s.add_argument_group("engine (sut/engine EngineSettings; prefix caching is always ON here)")
    add_engine_flags(e, defaults=engine_defaults(), skip=("seed",), help=_ENGINE_HELP)
    e.add_argument("--engine-seed", type=int, help="vLLM seed (--seed is the trace's; default 0)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sut.locality", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging; with run also vLLM's own output "
                   "on the console instead of RUN/<case>/engine-N.log")
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("run", "describe"):
        s = sub.add_parser(name, help="the pair protocol: systems x policies x pairs" if name == "run" else
                           "print the trace's shape as a table (no engines)")
        s.add_argument("-v", "--verbose", dest="sub_verbose", action="store_true",
                       help=_VERBOSE_HELP if name == "run" else _VERBOSE_NO_ENGINE_HELP)
        t = s.add_argument_group("trace (sut/locality/trace.py TraceSettings)")
        _add(t, _TRACE, _TD)
        t.add_argument("--trace-preset", choices=sorted(TRACE_PRESETS), help=_PRESET_HELP)
        if name == "describe":
            s.add_argument("--json", action="store_true", help="print the shape as JSON instead of a table")
        else:
            _add_run_flags(s)
    r = sub.add_parser("report", help="one report from the finished cases of several runs (sut/locality/merge.py)")
    r.add_argument("-v", "--verbose", dest="sub_verbose", action="store_true", help=_VERBOSE_NO_ENGINE_HELP)
    r.add_argument("runs", nargs="+", metavar="RUN", help="run folders (each with cases.jsonl), merged in this order: "
                   "their pairs are renumbered run by run; only runs of the same trace and settings")
    r.add_argument("--output-dir", default="results/locality", help="base folder of the merged run folder "
                   "(default results/locality)")
    r.add_argument("--run-name", help="merged run folder name prefix (default: time + 'merged')")
    return p


def _trace_settings(a) -> TraceSettings:
    """The preset's trace fields (``--trace-preset``), overridden by the flags given."""
    return TraceSettings(**{**TRACE_PRESETS.get(a.trace_preset, {}).get("trace", {}), **_pick(a, _TRACE)})


def _preset_overrides(a) -> list[str]:
    """One note per setting of ``--trace-preset`` that a flag changed (the record keeps the preset's name, so it must
    also say that the shape is not the preset's)."""
    preset = TRACE_PRESETS.get(a.trace_preset)
    if not preset:
        return []
    given = {**_pick(a, _TRACE), **_pick(a, _PROTOCOL), **_pick(a, _ROUTER)}
    return [f"--trace-preset {a.trace_preset}: {k} {given[k]!r} given instead of the preset's {v!r}"
            for part in preset.values() for k, v in part.items() if k in given and given[k] != v]


def cmd_describe(a) -> int:
    ts = _trace_settings(a)
    trace = make_trace(ts)
    shape = describe(trace)
    if a.json:
        print(json.dumps(dict(shape, trace_hash=trace_hash(trace), max_prompt_tokens_possible=ts.max_prompt_tokens,
                              max_model_len_needed=ts.max_prompt_tokens + ts.max_tokens), indent=2))
    else:
        print(describe_table(ts, shape))
    return 0


def _engine(a, ts: TraceSettings) -> EngineSettings:
    """Engine settings (prefix caching on); ``BadInput`` for a context too short for the trace."""
    base = {"max_model_len": ts.max_prompt_tokens + ts.max_tokens}
    if a.engine_seed is not None and not 0 <= a.engine_seed <= MAX_SEED:
        raise BadInput(f"error: --engine-seed must be in [0, {MAX_SEED}] (vLLM's range), got {a.engine_seed}")
    # the namespace's `seed` is the trace's (--seed): the engine's comes from --engine-seed alone
    engine_args = argparse.Namespace(**{**vars(a), "seed": a.engine_seed})
    es = dataclasses.replace(engine_settings_from_args(engine_args, base), enable_prefix_caching=True)
    if es.max_model_len < ts.max_prompt_tokens + ts.max_tokens:
        raise BadInput(f"error: --max-model-len {es.max_model_len} is below the longest prompt + max_tokens "
                       f"({ts.max_prompt_tokens} + {ts.max_tokens}); leave it out to get exactly that")
    return es


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


def _protocol(a) -> PairSettings:
    run = {**TRACE_PRESETS.get(a.trace_preset, {}).get("run", {}), **_pick(a, _PROTOCOL)}
    if a.policies:
        run["policies"] = tuple(a.policies)
    ps = PairSettings(progress=not a.no_progress, **run)
    unknown = [x for x in ps.policies if x not in ROUTERS]
    if unknown:
        raise BadInput(f"error: unknown policy {unknown}; known: {', '.join(ROUTERS)}")
    return ps


def _preflight_servers(systems, es: EngineSettings) -> None:
    """`vllm serve` replicas are checked as `python -m sut run --sut vllm-http` checks them, before the run
    folder: given URLs must answer and serve ``--model`` with a long enough context; servers to start here
    must be placeable and ``server_args`` must not set the harness's settings (``HttpSUT.preflight``)."""
    from sut.http_sut import HttpSUT

    for system in systems:
        if system.transport == "http":
            try:
                HttpSUT.preflight(system.options, es)
            except InputError as e:
                raise BadInput(f"error: system {system.name}: {e}") from None


def _routing(a, revision: str) -> AffinitySettings:
    """The router knobs: the trace preset's ``routing`` (study presets: release gate ``never``), then the flags."""
    return AffinitySettings(**{**TRACE_PRESETS.get(a.trace_preset, {}).get("routing", {}), **_pick(a, _ROUTER)},
                            model_revision=revision)


def _prepare(a):
    """Every check before anything starts: settings, model, engine plan, systems, trace, warm-ups."""
    ts = _trace_settings(a)
    es = _engine(a, ts)
    ps = _protocol(a)
    model = _model(es)
    try:  # the replicas every system gets; refuses --device cuda without a GPU, too many CPU engines
        replicas = len(plan_engines(es))
    except EngineError as e:
        raise BadInput(f"error: {e}") from None
    if a.http and a.server_url:
        raise BadInput("error: --http starts servers here; --server-url uses running ones: give one of them")
    try:  # spaces or commas, as `sut run`; the transport's own URL parser (its replicas are these URLs)
        urls = list(url_list(",".join(a.server_url))) if a.server_url else []
    except ValueError as e:
        raise BadInput(f"error: --server-url: {e}") from None
    if urls:
        replicas = len(urls)
    systems = resolve_systems(a.systems, replicas, parse_system_options(a.system_option), http=a.http, urls=urls)
    _preflight_servers(systems, es)
    affinity = _routing(a, model_revision(es.model))
    prepared = prepare_trace(ts, ps.warmups)
    if affinity.block_tokens > prepared.shape["prompt_max"] and "prefix_affinity" in ps.policies:
        log.warning("--block-tokens %d is longer than every prompt (max %d): prefix_affinity has no key and "
                    "routes every request least-loaded", affinity.block_tokens, prepared.shape["prompt_max"])
    gen = GenerationSettings(max_tokens=ts.max_tokens, ignore_eos=True, eos_token_ids=model.eos_token_ids)
    return es, gen, ps, model, systems, affinity, prepared


def _run_dir(a, systems) -> Path:
    try:
        return make_run_dir(a.output_dir, a.run_name, "-".join(s.name for s in systems) or "merged")
    except FileExistsError as e:
        raise BadInput(f"error: run folder {e.filename} already exists (choose another --run-name)") from None
    except OSError as e:
        raise BadInput(f"error: cannot create the run folder under --output-dir {a.output_dir}: {e.strerror}") from None


def cmd_run(a) -> int:
    try:
        es, gen, ps, model, systems, affinity, prepared = _prepare(a)
    except ValueError as e:
        raise BadInput(f"error: {e}") from None
    made_from = _first_missing(Path(a.output_dir))
    d = _run_dir(a, systems)  # last: bad input never leaves a run folder behind
    log.warning("%s", NOTICE.upper())
    log.info("trace: %s", prepared.shape)
    stop_on_sigterm_like_ctrl_c()  # SIGTERM: engines shut down, finished cases kept (run_study)
    ctx = StudyContext(trace=prepared.trace, warmups=prepared.warmups, expected_hashes=prepared.input_hashes,
                       engine=es, generation=gen, affinity=affinity, run_dir=d, max_tokens=prepared.settings.max_tokens,
                       log_to_console=a.verbose)
    base = {"command": command_line(), "trace_preset": a.trace_preset, "runtime": runtime_versions(),
            "model": {"path": es.model, "config_sha256": model.config_sha256, "revision": affinity.model_revision},
            "engine_settings": es, "generation": gen, "router_settings": affinity, "notes": _preset_overrides(a)}
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


def _first_missing(path: Path):
    """The outermost folder of ``path`` that does not exist yet (None: all exist): what making the run folder adds."""
    path, top = path.absolute(), None
    while not path.exists():
        top, path = path, path.parent
    return top


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
    Every check and the report come first (bad input: exit 2, no folder); a failure while writing
    removes the half-written folder (a file that cannot be written: ``RunFailed``, exit 1)."""
    merged = build(a.runs, command_line())
    d = _run_dir(a, [])
    try:
        record = write_merged(merged, d)
    except BaseException as e:
        shutil.rmtree(d, ignore_errors=True)
        if isinstance(e, OSError):
            raise RunFailed(f"cannot write the merged report into {d}: {e}") from e
        raise
    print(study_tables(record))
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
