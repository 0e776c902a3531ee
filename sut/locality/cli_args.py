"""``python -m sut.locality``'s command line: the flags of ``run``, ``describe`` and ``report``
(``add_commands``; the trace and protocol flags come from the settings dataclasses' ``knob`` fields) and the
settings read back from the parsed arguments (a ``--trace-preset``'s values, then the flags given).
``sut/locality/__main__.py`` dispatches the commands."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import typing

from sut.core.routing import RELEASE_GATES, ROUTERS, AffinitySettings
from sut.engine import EngineSettings
from sut.engine.settings import MAX_SEED
from sut.errors import BadInput
from sut.locality.pairs import PairSettings
from sut.locality.systems import SYSTEMS
from sut.locality.trace import TRACE_PRESETS as STUDY_PRESETS
from sut.locality.trace import TraceSettings
from sut.locality.workloads import POLICY_VARIANTS, WORKLOAD_PRESETS, WorkloadSettings
from sut.settings.flags import add_engine_flags, engine_defaults, engine_settings_from_args
from sut.settings.run import check_folder_name

#: Every ``--trace-preset``: the study's two (``sut.locality.trace``) and the five workloads
#: (``sut.locality.workloads``).
TRACE_PRESETS = {**STUDY_PRESETS, **WORKLOAD_PRESETS}
#: Policy names ``--policies`` takes: the routing policies and their locality variants.
POLICIES = (*ROUTERS, *POLICY_VARIANTS)

_VERBOSE_HELP = ("debug logging, and vLLM's own output (its logs, warnings and the harmless 'Chat template warmup "
                 "failed' traceback) on the console instead of RUN/<case>/engine-N.log")
#: ``-v`` of the commands that start no engine (``describe``, ``report``).
_VERBOSE_NO_ENGINE_HELP = "debug logging (this command starts no engine)"



def _folder_name(value: str) -> str:
    """argparse type of ``--run-name``: a plain folder name inside ``--output-dir`` (exit 2 otherwise)."""
    try:
        return check_folder_name(value, "--run-name")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None

def _defaults(cls) -> dict:
    return {f.name: f.default for f in dataclasses.fields(cls)}


_TD, _AD, _PD = _defaults(TraceSettings), _defaults(AffinitySettings), _defaults(PairSettings)
_WD = _defaults(WorkloadSettings)


def _flags(cls) -> dict:
    """name -> (argparse type or ``{"choices": ...}``, help) of the fields of ``cls`` declared with
    ``sut.locality.knob`` (a help in their metadata)."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        if "help" in f.metadata:
            kind = [t for t in typing.get_args(hints[f.name]) if t is not type(None)] or [hints[f.name]]
            if "nargs" in f.metadata:  # a list of values: its item type and count in the metadata
                kind = [{"type": f.metadata["type"], "nargs": f.metadata["nargs"]}]
            out[f.name] = ({"choices": f.metadata["choices"]} if "choices" in f.metadata else kind[0],
                           f.metadata["help"].replace("%", "%%"))
    return out


# name -> (argparse keywords, help); "(default ...)" is appended from the settings dataclass
_TRACE = _flags(TraceSettings)
_PROTOCOL = _flags(PairSettings)
_WORKLOAD = _flags(WorkloadSettings)
_ROUTER = {
    "block_tokens": (int, "prefix_affinity: tokens per hashed block of the prompt"),
    "prefix_blocks": (int, "prefix_affinity: blocks hashed per prompt (the key covers the first "
                           "block_tokens x prefix_blocks tokens; shorter prompts go least-loaded)"),
    "release_tokens": (int, "prefix_affinity: estimated tokens of work in flight (uncached prefill + decode) beyond "
                            "which an owner's request may go elsewhere (see --release-gate); about peak tokens/s x "
                            "the extra latency you accept"),
    "release_gate": ({"choices": RELEASE_GATES}, "prefix_affinity: excess = release when the owner's estimated work "
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
_PRESET_HELP = ("the study's traces (docs/study.md): study-no-reuse = 64 news documents x 1 question, "
                "study-reuse = 64 x 4 = 256 requests; ~8K-token documents, one shuffled burst (--rate 0), exactly 16 "
                "new tokens each (--max-tokens 16), --text news (needs --dataset). Beyond the study "
                "(sut/locality/workloads, docs/locality.md): arrivals (Poisson at 50/80/95%% of the burst capacity, "
                "TTFT/TPOT and goodput), variable-answers (16-512 new tokens, log-uniform), hot-prefixes (Zipf s 1.1, "
                "per-replica load, affinity with and without release), eviction (working set 3x one replica's KV "
                "cache), replica-loss (replica 0 killed mid-trace); `describe --trace-preset NAME` shows one. "
                "Explicit flags override the preset")


def _add(group, fields: dict, defaults: dict) -> None:
    for name, (kind, help_) in fields.items():
        kw = dict(kind) if isinstance(kind, dict) else {"type": kind}
        if defaults.get(name) not in (None, ()):
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
    y.add_argument("--server-url", nargs="+", action="extend", metavar="URL",
                   help="standalone = these running `vllm serve` servers (one replica each, space- or comma-separated, "
                   "or the flag repeated; engines are then not fresh per pair); each must "
                   "answer and serve --model before anything starts (exit 2)")
    y.add_argument("--system-option", action="append", default=[], metavar="SYSTEM.KEY=VALUE",
                   help="an option of a system's transport (JSON value, else a string), e.g. flame.batch_size=64 or "
                        "standalone.dispatch_chunk=64; repeatable")
    r = s.add_argument_group("routing (sut/core/routing AffinitySettings)")
    r.add_argument("--policies", nargs="+", help="routing policies, each run per system and pair: "
                   f"{', '.join(POLICIES)} "
                   "(prefix_affinity_never: prefix_affinity with release gate never; default round_robin least_loaded "
                   "prefix_affinity, or the preset's)")
    _add(r, _ROUTER, _AD)
    g = s.add_argument_group("protocol (sut/locality/pairs.py PairSettings)")
    _add(g, _PROTOCOL, _PD)
    g.add_argument("--output-dir", default="results/locality", help="base folder of the run folders "
                   "(default results/locality)")
    g.add_argument("--run-name", type=_folder_name, help="run folder name prefix (default: time + systems)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    e = s.add_argument_group("engine (sut/engine EngineSettings; prefix caching is always ON here)")
    add_engine_flags(e, defaults=engine_defaults(), skip=("seed",), help=_ENGINE_HELP)
    e.add_argument("--engine-seed", type=int, help="vLLM seed (--seed is the trace's; default 0)")


def add_commands(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the commands (``run``, ``describe``, ``report``) and their flags to ``p`` (``python -m sut.locality``'s
    parser, ``build_parser``); returns ``p``."""
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
        w = s.add_argument_group("workloads beyond the study (sut/locality/workloads WorkloadSettings)")
        _add(w, _WORKLOAD, _WD)
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
    r.add_argument("--run-name", type=_folder_name, help="merged run folder name prefix (default: time + 'merged')")
    return p


def _trace_settings(a) -> TraceSettings:
    """The preset's trace fields (``--trace-preset``), overridden by the flags given."""
    return TraceSettings(**{**TRACE_PRESETS.get(a.trace_preset, {}).get("trace", {}), **_pick(a, _TRACE)})


def _preset_overrides(a) -> list[str]:
    """One note per setting of ``--trace-preset`` that a flag changed (the record keeps the preset's name, so it must
    also say that the shape is not the preset's), and one for ``--documents`` when eviction sizes the documents
    instead (with or without a preset, whatever its value)."""
    preset = TRACE_PRESETS.get(a.trace_preset) or {}
    given = {**_pick(a, _TRACE), **_pick(a, _PROTOCOL), **_pick(a, _ROUTER), **_pick(a, _WORKLOAD)}
    if getattr(a, "policies", None):
        given["policies"] = tuple(a.policies)
    sized = "documents" in given and {**preset.get("workload", {}), **_pick(a, _WORKLOAD)}.get("working_set")
    notes = [f"--documents {given['documents']!r} given, not used: eviction sizes the documents from the KV cache "
             "(--working-set)"] if sized else []
    return notes + [f"--trace-preset {a.trace_preset}: {k} {given[k]!r} given instead of the preset's {v!r}"
                    for part in preset.values() for k, v in part.items()
                    if k in given and given[k] != v and not (sized and k == "documents")]


#: Knobs that act only while another one is on: knob -> (the knob that switches it on, its workload).
_NEEDS = {**dict.fromkeys(("capacity", "capacity_policy", "ttft_target_s", "tpot_target_s"),
                          ("load_levels", "arrivals")),
          "kv_tokens": ("working_set", "eviction"),
          **dict.fromkeys(("kill_when", "kill_replica", "retries", "loss_timeout_s"), ("kill_after", "replica-loss"))}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _workload(a) -> WorkloadSettings:
    """The preset's ``workload`` knobs, overridden by the flags given (``ValueError`` for a bad value, or for a
    flag that would change nothing: ``_inert``)."""
    ws = WorkloadSettings(**{**TRACE_PRESETS.get(a.trace_preset, {}).get("workload", {}), **_pick(a, _WORKLOAD)})
    _inert({**_pick(a, _WORKLOAD), **_pick(a, _TRACE)}, ws, _trace_settings(a))
    return ws


def _inert(given: dict, ws: WorkloadSettings, ts: TraceSettings) -> None:
    """``ValueError`` naming a flag given on the command line that its workload ignores because the knob that
    switches that workload on is off (``_NEEDS``; ``--min-answer-tokens`` without ``--answers log_uniform``):
    the run would record it and measure without it."""
    for name in given:
        on, workload = _NEEDS.get(name, (None, None))
        if on and not getattr(ws, on):
            raise ValueError(f"{_flag(name)} applies to {workload} only, which {_flag(on)} switches on (here off): "
                             f"give {_flag(on)} or a --trace-preset {workload}, or leave {_flag(name)} out")
    if "min_answer_tokens" in given and ts.answers == "fixed":
        raise ValueError("--min-answer-tokens applies to --answers log_uniform only (here fixed: every answer is "
                         "--max-tokens long); give --answers log_uniform or leave --min-answer-tokens out")


def _engine(a, ts: TraceSettings, ws: WorkloadSettings = WorkloadSettings()) -> EngineSettings:
    """Engine settings (prefix caching on; ``--kv-blocks``: every engine's KV-cache blocks); ``BadInput`` for a
    context too short for the trace."""
    base = {"max_model_len": ts.max_prompt_tokens + ts.max_tokens}
    if ws.kv_blocks:
        base["num_gpu_blocks_override"] = ws.kv_blocks
    if a.engine_seed is not None and not 0 <= a.engine_seed <= MAX_SEED:
        raise BadInput(f"error: --engine-seed must be in [0, {MAX_SEED}] (vLLM's range), got {a.engine_seed}")
    # the namespace's `seed` is the trace's (--seed): the engine's comes from --engine-seed alone
    engine_args = argparse.Namespace(**{**vars(a), "seed": a.engine_seed})
    es = dataclasses.replace(engine_settings_from_args(engine_args, base), enable_prefix_caching=True)
    if es.max_model_len < ts.max_prompt_tokens + ts.max_tokens:
        raise BadInput(f"error: --max-model-len {es.max_model_len} is below the longest prompt + max_tokens "
                       f"({ts.max_prompt_tokens} + {ts.max_tokens}); leave it out to get exactly that")
    return es


def _protocol(a) -> PairSettings:
    run = {**TRACE_PRESETS.get(a.trace_preset, {}).get("run", {}), **_pick(a, _PROTOCOL)}
    if a.policies:
        run["policies"] = tuple(a.policies)
    ps = PairSettings(progress=not a.no_progress, **run)
    unknown = [x for x in ps.policies if x not in POLICIES]
    if unknown:
        near = [m for x in unknown for m in difflib.get_close_matches(x.replace("-", "_"), POLICIES, n=1)]
        hint = f" (did you mean {', '.join(near)}?)" if near else ""
        raise BadInput(f"error: unknown policy {unknown}{hint}; known: {', '.join(POLICIES)}")
    return ps


def _routing(a, revision: str) -> AffinitySettings:
    """The router knobs: the trace preset's ``routing`` (study presets: release gate ``never``), then the flags."""
    return AffinitySettings(**{**TRACE_PRESETS.get(a.trace_preset, {}).get("routing", {}), **_pick(a, _ROUTER)},
                            model_revision=revision)
