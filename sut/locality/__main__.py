"""``python -m sut.locality {run,describe}``: synthetic-locality traces (NOT an MLPerf benchmark).

``run`` builds the trace, starts the engine replicas with prefix caching ON, replays the trace
once per routing policy (prefix caches emptied in between) and writes
``<output-dir>/<name>-SYNTHETIC-LOCALITY-NOT-MLPERF/locality.json``. ``describe`` prints the
trace's shape without starting engines.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from sut.cli import ENGINE_FLAGS, BadInput, stop_on_sigterm_like_ctrl_c
from sut.locality import NOTICE
from sut.locality.router import RELEASE_GATES

log = logging.getLogger("sut.locality")


_TRACE = {"documents": int, "doc_tokens": int, "doc_jitter": float, "questions": int, "question_tokens": int,
          "max_tokens": int, "zipf_s": float, "order": str, "seed": int}
_ROUTER = {"block_tokens": int, "prefix_blocks": int, "release_tokens": int,
           "release_gate": {"choices": RELEASE_GATES, "help": "excess (default): release when the owner's uncached "
                            "work exceeds the least busy replica's by --release-tokens; absolute: when it exceeds "
                            "--release-tokens by itself"},
           "max_entries": int, "decode_weight": float}
# the engine flags of `python -m sut run`, but --seed is the trace's here (the engine's is --engine-seed)
_ENGINE = {name: {"type": typ, "help": help_} for name, (typ, help_) in ENGINE_FLAGS.items() if name != "seed"}


def _add(group, fields: dict) -> None:
    for name, typ in fields.items():
        group.add_argument("--" + name.replace("_", "-"), dest=name, **(typ if isinstance(typ, dict) else {"type": typ}))


def _pick(a, fields: dict) -> dict:
    """The fields given on the command line (the rest keep their dataclass defaults)."""
    return {name: getattr(a, name) for name in fields if getattr(a, name) is not None}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sut.locality", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("run", "describe"):
        s = sub.add_parser(name, help="replay the trace per routing policy" if name == "run" else "print the trace shape")
        t = s.add_argument_group("trace (sut/locality/trace.py TraceSettings)")
        _add(t, _TRACE)
        if name == "describe":
            continue
        r = s.add_argument_group("routing (sut/locality/router.py AffinitySettings)")
        r.add_argument("--policies", nargs="+", help="round_robin least_loaded prefix_affinity (default: all three)")
        _add(r, _ROUTER)
        g = s.add_argument_group("replay (sut/locality/runner.py LocalityRunSettings)")
        g.add_argument("--rounds", type=int, help="repeat the policies, rotating their order (default 1)")
        g.add_argument("--rate", type=float, help="arrivals per second, Poisson (default 0 = all at once)")
        g.add_argument("--output-dir", help="base folder (default results/locality)")
        g.add_argument("--run-name", help="run folder name prefix")
        g.add_argument("--no-progress", action="store_true")
        g.add_argument("--ignore-eos", action="store_true",
                       help="always generate max_tokens (dummy weights emit EOS at random)")
        e = s.add_argument_group("engine (sut/engine.py EngineSettings; prefix caching is always ON here)")
        _add(e, _ENGINE)
        e.add_argument("--enforce-eager", action="store_true", default=None)
        e.add_argument("--engine-seed", type=int, help="vLLM seed (--seed is the trace's)")
    return p


def cmd_describe(a) -> int:
    from sut.locality.trace import TraceSettings, describe, make_trace

    ts = TraceSettings(**_pick(a, _TRACE))
    print(json.dumps(dict(describe(make_trace(ts)), max_prompt_tokens=ts.max_prompt_tokens), indent=2))
    return 0


def cmd_run(a) -> int:
    from sut.base import RunFailed
    from sut.engine import EngineError, EnginePool, EngineSettings, GenerationSettings, read_model_info
    from sut.locality.router import AffinitySettings
    from sut.locality.runner import LocalityRunSettings, make_run_dir, replay, summarize, write_record
    from sut.locality.trace import TraceSettings, describe, make_trace

    ts = TraceSettings(**_pick(a, _TRACE))
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
                         f"({ts.max_prompt_tokens} + {ts.max_tokens})")
    run = {"policies": tuple(a.policies)} if a.policies else {}
    for k in ("rounds", "rate", "output_dir", "run_name"):
        if getattr(a, k) is not None:
            run[k] = getattr(a, k)
    run["progress"] = not a.no_progress
    rs = LocalityRunSettings(**run)
    affinity = AffinitySettings(**_pick(a, _ROUTER))
    try:
        model = read_model_info(es.model)
    except EngineError as e:
        raise BadInput(f"error: {e}") from None
    if es.max_model_len > model.max_position_embeddings:
        raise BadInput(f"error: max_model_len {es.max_model_len} exceeds the model's max_position_embeddings "
                         f"{model.max_position_embeddings} ({es.model}/config.json); use shorter documents")
    gen = GenerationSettings(max_tokens=ts.max_tokens, ignore_eos=a.ignore_eos, eos_token_ids=model.eos_token_ids)
    from sut.locality.router import ROUTERS

    unknown = [x for x in rs.policies if x not in ROUTERS]
    if unknown:
        raise BadInput(f"error: unknown policy {unknown}; known: {', '.join(ROUTERS)}")
    trace = make_trace(ts)
    shape = describe(trace)
    log.warning("%s", NOTICE.upper())
    log.info("trace: %s", shape)
    if affinity.block_tokens > shape["prompt_max"] and "prefix_affinity" in rs.policies:
        log.warning("--block-tokens %d is longer than every prompt (max %d): prefix_affinity has no key and "
                    "routes every request least-loaded", affinity.block_tokens, shape["prompt_max"])
    try:
        d = make_run_dir(rs)
    except FileExistsError as e:
        raise BadInput(f"error: run folder {e.filename} already exists (choose another --run-name)") from None
    except OSError as e:
        raise BadInput(f"error: cannot create the run folder under --output-dir {rs.output_dir}: {e.strerror}") from None
    stop_on_sigterm_like_ctrl_c()  # SIGTERM: engines shut down in `finally`, nothing written
    pool = EnginePool(es, gen, allow_prefix_caching=True, detail=True)
    try:
        engines = pool.start()
        records = replay(pool, trace, rs, ts.max_tokens, affinity)
    except (EngineError, RunFailed) as e:
        log.error("%s", e)
        d.rmdir()
        return 1
    except KeyboardInterrupt:
        log.error("interrupted (Ctrl-C or SIGTERM); engines stopped, nothing written")
        d.rmdir()
        return 130
    finally:
        pool.shutdown()
    summary = summarize(records)
    write_record(d, {"trace_settings": ts, "trace": shape, "engine_settings": es, "generation": gen,
                          "router_settings": affinity, "run_settings": rs, "engines": engines,
                          "command": "python -m sut.locality " + " ".join(sys.argv[1:]),
                          "summary": summary, "runs": records})
    lines = [f"{NOTICE}", f"{'policy':<16} {'out tok/s':>10} {'hit rate':>9} {'TTFT p50 s':>11} {'ratio':>7}"]
    for name, s in summary.items():
        ratio = next(v for k, v in s.items() if k.startswith("throughput_ratio_to_"))
        lines.append(f"{name:<16} {s['output_tokens_per_s']:>10.1f} {s['cache_hit_rate']:>9.3f} "
                     f"{s['ttft_p50_s']:>11.3f} {ratio:>7.3f}")
    lines.append(f"written {d / 'locality.json'}")
    print("\n".join(lines))
    return 0


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "DEBUG" if a.verbose else "WARNING")
    logging.basicConfig(level=logging.DEBUG if a.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    try:
        return {"run": cmd_run, "describe": cmd_describe}[a.cmd](a)
    except ValueError as e:
        raise BadInput(f"error: {e}") from None


if __name__ == "__main__":
    raise SystemExit(main())
