"""``python -m sut.locality {run,describe}``: synthetic-locality traces (NOT an MLPerf benchmark).

``run`` builds the trace, starts the engine replicas with prefix caching ON, replays the trace
once per routing policy (prefix caches emptied in between) and writes
``<output-dir>/<name>-SYNTHETIC-LOCALITY-NOT-MLPERF/locality.json``; vLLM's own output goes to
``engine-N.log`` in that folder (``--verbose``: to the console). ``describe`` prints the trace's
shape as a table without starting engines. Traces are random token ids or, with ``--text news
--dataset FILE [--tokenizer PATH]``, real CNN/DailyMail text; ``--trace-preset study-no-reuse|study-reuse``
sets the study's shape (explicit flags override it).

Bad input (a missing model, a context too short for the trace, ``--device cuda`` without a GPU, ...)
exits 2 before the run folder is made; an engine death or a lost request exits 1 and keeps only the
engine logs; Ctrl-C or SIGTERM exits 130 and writes nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import sys
from pathlib import Path

from sut.base import RunFailed
from sut.cli import ENGINE_FLAGS, BadInput, stop_on_sigterm_like_ctrl_c
from sut.engine import EngineError, EnginePool, EngineSettings, GenerationSettings, ModelInfo, read_model_info
from sut.locality import NOTICE
from sut.locality.report import describe_table, run_tables
from sut.core.routing import RELEASE_GATES, ROUTERS, AffinitySettings
from sut.locality.runner import (LocalityRunSettings, kv_cache_summary, make_run_dir, replay, summarize,
                                 write_record)
from sut.locality.trace import ORDERS, TEXTS, TRACE_PRESETS, TraceSettings, describe, make_trace, trace_hash

log = logging.getLogger("sut.locality")

_VERBOSE_HELP = ("debug logging, and vLLM's own output (its logs, warnings and the harmless 'Chat template warmup "
                 "failed' traceback) on the console instead of RUN/engine-N.log")


def _defaults(cls) -> dict:
    return {f.name: f.default for f in dataclasses.fields(cls)}


_TD, _AD, _RD = _defaults(TraceSettings), _defaults(AffinitySettings), _defaults(LocalityRunSettings)

# name -> (argparse keywords, help); "(default ...)" is appended from the settings dataclass
_TRACE = {
    "documents": (int, "number of documents"),
    "doc_tokens": (int, "mean document length, tokens"),
    "doc_jitter": (float, "document lengths are uniform in doc_tokens x [1 - j, 1 + j]"),
    "questions": (int, "questions per document (their mean when --zipf-s > 0)"),
    "question_tokens": (int, "mean question length, tokens (uniform +-50%%)"),
    "max_tokens": (int, "output tokens per request (at most; exactly with --ignore-eos)"),
    "zipf_s": (float, "document popularity: 0 = every document gets --questions questions; s > 0 = weights "
                      "1 / rank^s, a few hot documents draw most questions"),
    "order": ({"choices": ORDERS}, "arrival order: shuffled (random), by_document (all questions of a document "
                                   "together), round_robin (question 0 of every document, then question 1, ...: "
                                   "the longest reuse distance)"),
    "seed": (int, "trace seed: the same settings always give the same trace"),
    "text": ({"choices": TEXTS}, "random token ids, or news: documents concatenated from the CNN/DailyMail articles of "
                                 "--dataset, each followed by a question from a few templates (sut/locality/news.py)"),
    "dataset": (str, "--text news: a cnn_eval-format JSON file (a list of records with input, tok_input)"),
    "tokenizer": (str, "--text news: the model's tokenizer (HF folder or tokenizer.json, or a Llama 3 tiktoken "
                       "tokenizer.model or its folder); left out: the file's tok_input ids, with the prompt template "
                       "common to all records (BOS included) stripped"),
}
_ROUTER = {
    "block_tokens": (int, "prefix_affinity: tokens per hashed block of the prompt"),
    "prefix_blocks": (int, "prefix_affinity: blocks hashed per prompt (the key covers the first "
                           "block_tokens x prefix_blocks tokens; shorter prompts go least-loaded)"),
    "release_tokens": (int, "prefix_affinity: estimated uncached prefill tokens in flight beyond which an owner's "
                            "request may go elsewhere (see --release-gate); about peak prefill tokens/s x the extra "
                            "TTFT you accept"),
    "release_gate": ({"choices": RELEASE_GATES}, "prefix_affinity: excess = release when the owner's uncached work "
                     "exceeds the least busy replica's by --release-tokens (a burst that loads every replica alike "
                     "keeps affinity); absolute = when it exceeds --release-tokens by itself (a TTFT bound per owner)"),
    "max_entries": (int, "prefix_affinity: affinity map size, block hashes (LRU)"),
    "decode_weight": (float, "least_loaded, prefix_affinity: a request's estimated work = uncached prompt tokens + "
                             "decode_weight x --max-tokens"),
}
_RUN = {
    "rounds": (int, "repeat the policies this many times, rotating their order each round"),
    "rate": (float, "arrivals per second, Poisson; 0 = every request at once (a burst)"),
    "arrival_seed": (int, "seed of the Poisson arrival times"),
    "warmup_requests": (int, "requests sent round-robin before the first policy (caches emptied afterwards), so "
                             "that no policy pays for first-use costs"),
    "stall_timeout_s": (float, "fail the run when no request finishes for this many seconds"),
    "output_dir": (str, "base folder of the run folders"),
    "run_name": (str, "run folder name prefix (default: time + policies)"),
}
_DEFAULT_LEN = TraceSettings().max_prompt_tokens + TraceSettings().max_tokens
_ENGINE_HELP = {
    "max_model_len": f"context length of every engine; default: the trace's longest possible prompt + --max-tokens "
                     f"({_DEFAULT_LEN:,} for the default ~8K-token documents: {_TD['doc_tokens']:,} x "
                     f"{1 + _TD['doc_jitter']:g} + BOS + question + {_TD['max_tokens']}); must not exceed the model's "
                     "max_position_embeddings (Llama 3.1: 131,072; the tiny CPU model: 8,192 -> use --doc-tokens <= 7000)",
    "device": "auto (every visible GPU, else CPU) | cuda | cpu (default auto)",
    "engines_per_device": "replicas per GPU (sharing its memory) or number of CPU replicas (default 1)",
}
_PRESET_HELP = ("the study's traces (../shared/research/study.md): study-no-reuse = 64 news documents x 1 question, "
                "study-reuse = 64 x 4 = 256 requests; ~8K-token documents, one shuffled burst (--rate 0), exactly 16 "
                "new tokens each (--max-tokens 16, --ignore-eos on), --text news (needs --dataset); explicit flags "
                "override the preset")
# the engine flags of `python -m sut run`, but --seed is the trace's here (the engine's is --engine-seed)
_ED = _defaults(EngineSettings)


def _engine_help(name: str, help_: str) -> str:
    if name in _ENGINE_HELP:
        return _ENGINE_HELP[name]
    if name == "model":
        return help_ + " (required)"
    if name == "quantization":
        return help_ + " (default none)"
    return help_ + (f" (default {_ED[name]})" if _ED.get(name) is not None else " (default: vLLM's)")


_ENGINE = {name: {"type": typ, "help": _engine_help(name, help_)}
           for name, (typ, help_) in ENGINE_FLAGS.items() if name != "seed"}


def _add(group, fields: dict, defaults: dict) -> None:
    for name, (kind, help_) in fields.items():
        kw = dict(kind) if isinstance(kind, dict) else {"type": kind}
        if defaults.get(name) is not None:
            help_ += f" (default {defaults[name]})"
        group.add_argument("--" + name.replace("_", "-"), dest=name, help=help_, **kw)


def _pick(a, fields: dict) -> dict:
    """The fields given on the command line (the rest keep their dataclass defaults)."""
    return {name: getattr(a, name) for name in fields if getattr(a, name, None) is not None}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sut.locality", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-v", "--verbose", action="store_true", help=_VERBOSE_HELP)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("run", "describe"):
        s = sub.add_parser(name, help="replay the trace per routing policy" if name == "run" else
                           "print the trace's shape as a table (no engines)")
        s.add_argument("-v", "--verbose", dest="sub_verbose", action="store_true", help=_VERBOSE_HELP)
        t = s.add_argument_group("trace (sut/locality/trace.py TraceSettings)")
        _add(t, _TRACE, _TD)
        t.add_argument("--trace-preset", choices=sorted(TRACE_PRESETS), help=_PRESET_HELP)
        if name == "describe":
            s.add_argument("--json", action="store_true", help="print the shape as JSON instead of a table")
            continue
        r = s.add_argument_group("routing (sut/core/routing AffinitySettings)")
        r.add_argument("--policies", nargs="+", help=f"routing policies, each measured on emptied prefix caches, in "
                       f"this order: {', '.join(ROUTERS)} (default: all three)")
        _add(r, _ROUTER, _AD)
        g = s.add_argument_group("replay (sut/locality/runner.py LocalityRunSettings)")
        _add(g, _RUN, _RD)
        g.add_argument("--no-progress", action="store_true", help="no progress bar")
        g.add_argument("--ignore-eos", action="store_true",
                       help="always generate --max-tokens (dummy weights emit EOS at random)")
        e = s.add_argument_group("engine (sut/engine.py EngineSettings; prefix caching is always ON here)")
        for ename, kw in _ENGINE.items():
            e.add_argument("--" + ename.replace("_", "-"), dest=ename, **kw)
        e.add_argument("--enforce-eager", action="store_true", default=None, help="no CUDA graphs / torch.compile")
        e.add_argument("--engine-seed", type=int, help="vLLM seed (--seed is the trace's; default 0)")
    return p


def _trace_settings(a) -> TraceSettings:
    """The preset's trace fields (``--trace-preset``), overridden by the flags given."""
    return TraceSettings(**{**TRACE_PRESETS.get(a.trace_preset, {}).get("trace", {}), **_pick(a, _TRACE)})


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


def _settings(a) -> tuple[TraceSettings, EngineSettings, LocalityRunSettings, AffinitySettings]:
    """The four settings objects from the flags (``ValueError`` for a bad value, ``BadInput`` for
    a missing model or a context too short for the trace)."""
    ts = _trace_settings(a)
    eng = _pick(a, _ENGINE)
    if "model" not in eng:
        raise BadInput("error: --model is required")
    eng.setdefault("max_model_len", ts.max_prompt_tokens + ts.max_tokens)
    if a.enforce_eager:
        eng["enforce_eager"] = True
    if a.engine_seed is not None:
        eng["seed"] = a.engine_seed
    es = EngineSettings(enable_prefix_caching=True, **eng)
    if es.max_model_len < ts.max_prompt_tokens + ts.max_tokens:
        raise BadInput(f"error: --max-model-len {es.max_model_len} is below the longest prompt + max_tokens "
                       f"({ts.max_prompt_tokens} + {ts.max_tokens}); leave it out to get exactly that")
    run = {**TRACE_PRESETS.get(a.trace_preset, {}).get("run", {}), **_pick(a, _RUN)}
    if a.policies:
        run["policies"] = tuple(a.policies)
    rs = LocalityRunSettings(progress=not a.no_progress, **run)
    unknown = [x for x in rs.policies if x not in ROUTERS]
    if unknown:
        raise BadInput(f"error: unknown policy {unknown}; known: {', '.join(ROUTERS)}")
    return ts, es, rs, AffinitySettings(**_pick(a, _ROUTER))


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


def _run_dir(rs: LocalityRunSettings) -> Path:
    try:
        return make_run_dir(rs)
    except FileExistsError as e:
        raise BadInput(f"error: run folder {e.filename} already exists (choose another --run-name)") from None
    except OSError as e:
        raise BadInput(f"error: cannot create the run folder under --output-dir {rs.output_dir}: {e.strerror}") from None


def cmd_run(a) -> int:
    ts, es, rs, affinity = _settings(a)
    model = _model(es)
    ignore_eos = a.ignore_eos or TRACE_PRESETS.get(a.trace_preset, {}).get("ignore_eos", False)
    gen = GenerationSettings(max_tokens=ts.max_tokens, ignore_eos=ignore_eos, eos_token_ids=model.eos_token_ids)
    try:  # plans the replicas: refuses --device cuda without a GPU, too many CPU engines
        pool = EnginePool(es, gen, allow_prefix_caching=True, detail=True)
    except EngineError as e:
        raise BadInput(f"error: {e}") from None
    trace = make_trace(ts)
    shape = describe(trace)
    log.warning("%s", NOTICE.upper())
    log.info("trace: %s", shape)
    if affinity.block_tokens > shape["prompt_max"] and "prefix_affinity" in rs.policies:
        log.warning("--block-tokens %d is longer than every prompt (max %d): prefix_affinity has no key and "
                    "routes every request least-loaded", affinity.block_tokens, shape["prompt_max"])
    d = _run_dir(rs)  # last: bad input never leaves a run folder behind
    stop_on_sigterm_like_ctrl_c()  # SIGTERM: engines shut down, nothing written
    try:
        try:
            engines = pool.start(log_dir=None if a.verbose else d)
            records = replay(pool, trace, rs, ts.max_tokens, affinity)
        finally:
            pool.shutdown()
    except (EngineError, RunFailed) as e:
        log.error("%s", e)
        if any(d.iterdir()):
            log.error("run failed; the engine logs are kept in %s (no locality.json)", d)
        else:
            d.rmdir()
        return 1
    except KeyboardInterrupt:
        log.error("interrupted (Ctrl-C or SIGTERM); engines stopped, nothing written")
        shutil.rmtree(d, ignore_errors=True)
        return 130
    summary = summarize(records)
    write_record(d, {"trace_settings": ts, "trace": shape, "engine_settings": es, "generation": gen,
                     "router_settings": affinity, "run_settings": rs, "engines": engines,
                     "kv_cache": kv_cache_summary(engines, shape),
                     "command": "python -m sut.locality " + " ".join(sys.argv[1:]),
                     "summary": summary, "runs": records})
    print(run_tables(records, summary, engines, shape, d / "locality.json"))
    return 0


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    a.verbose = a.verbose or a.sub_verbose
    # vLLM's INFO lines (KV-cache size, ...) go to RUN/engine-N.log; with --verbose DEBUG to the console
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "DEBUG" if a.verbose else "INFO")
    logging.basicConfig(level=logging.DEBUG if a.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    try:
        return {"run": cmd_run, "describe": cmd_describe}[a.cmd](a)
    except ValueError as e:
        raise BadInput(f"error: {e}") from None


if __name__ == "__main__":
    raise SystemExit(main())
