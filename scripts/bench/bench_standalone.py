"""Overhead benchmark: raw vLLM ``LLM.generate`` vs the standalone SUT under LoadGen.

Both sides run in ONE process over the SAME started engines (one started ``local`` transport:
same weights, settings, memory state) and the SAME token inputs, alternating raw → SUT → raw →
SUT … ``--repeats`` times:

- raw: each engine worker runs one plain ``LLM.generate`` over its share of the prompts
  (time = the slowest engine's generate call);
- SUT: ``--sut vllm`` (``TransportSUT`` over the started transport, ``least_loaded`` routing),
  LoadGen Offline, performance mode, one query holding every prompt exactly once
  (``min_query_count`` = N, performance sample count = N); time and tokens/s are LoadGen's own
  (``result_tokens_per_second`` in ``mlperf_log_detail.txt``).

Prints output tokens/s of both and their ratio per repeat, overall (total tokens / total time)
and the median of the per-round ratios (robust to the ~20 % run-to-run noise of shared CPUs);
writes a JSON file.
Target: SUT ≥ 99.5 % of raw on a GPU, ≥ 98 % on CPU. Not a compliant MLPerf run.

Example (CPU, tiny model):
  python scripts/bench/bench_standalone.py --model sut/models/tiny-llama3 --load-format dummy --dtype float32 \
      --enforce-eager --max-model-len 4096 --dataset results/demo/data/synthetic_256.json --samples 128
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from sut.base import SUTContext  # noqa: E402
from sut.constants import MAX_NEW_TOKENS, SCENARIO_MODEL_KEYS  # noqa: E402
from sut.core.transport import Transport, TransportSpec, make_transport  # noqa: E402
from sut.data.dataset import QuerySampleLibrary, load_dataset  # noqa: E402
from sut.engine import GenerationSettings, read_model_info  # noqa: E402
from sut.ledger.response import cut_at_first_eos  # noqa: E402
from sut.run.harness import parse_loadgen_detail  # noqa: E402
from sut.settings.flags import add_engine_flags, engine_settings_from_args  # noqa: E402
from sut.standalone import StandaloneSUT  # noqa: E402

log = logging.getLogger("bench")


def raw_round(transport: Transport, prompts, eos) -> dict:
    """Split prompts over engines by tokens, run one LLM.generate per engine, return tokens/s."""
    engines = transport.pool.engines
    shares: list[list] = [[] for _ in engines]
    load = [0] * len(engines)
    for i, p in enumerate(prompts):
        k = min(range(len(load)), key=load.__getitem__)
        shares[k].append((i, p))
        load[k] += len(p) + MAX_NEW_TOKENS
    for e, share in zip(engines, shares):
        if share:
            e.raw_generate_start(share)
    secs, tokens = 0.0, 0
    for e, share in zip(engines, shares):
        if share:
            dt, res = e.raw_generate_result()
            secs = max(secs, dt)
            tokens += sum(len(cut_at_first_eos(c.token_ids, eos)) for c in res)
    return {"seconds": secs, "tokens": tokens, "tokens_per_s": tokens / secs}


def sut_round(transport: Transport, ctx, settings_fn, outdir: Path) -> dict:
    import mlperf_loadgen as lg

    sut = StandaloneSUT(ctx, transport=transport)  # attaches to the started transport; its stop leaves it running
    sut.start()
    qsl = QuerySampleLibrary(ctx.dataset, len(ctx.dataset))
    handle = lg.ConstructSUT(sut.issue_queries, sut.flush_queries)
    out = lg.LogOutputSettings()
    out.outdir = str(outdir)
    ls = lg.LogSettings()
    ls.log_output = out
    ls.enable_trace = False
    t0 = time.monotonic()
    lg.StartTestWithLogSettings(handle, qsl.handle, settings_fn(), ls, str(outdir / "no-audit.config"))
    wall = time.monotonic() - t0
    sut.stop()
    transport.attach(_LogFailures())  # until the next round
    lg.DestroySUT(handle)
    qsl.destroy()
    if sut.ledger.error:
        raise RuntimeError(sut.ledger.error)
    res = parse_loadgen_detail(outdir / "mlperf_log_detail.txt")
    return {"tokens_per_s": float(res["result_tokens_per_second"]), "tokens": sut.ledger.output_tokens,
            "samples": sut.ledger.completed, "wall_s": wall, "validity": res.get("result_validity"),
            "errors": res.get("errors")}


def offline_settings(user_conf: str, n: int):
    """LoadGen Offline performance settings: one query of every one of the ``n`` prompts exactly once
    (``TestSettings.FromConfig`` may run once per process: the settings are reused for every round)."""
    import mlperf_loadgen as lg

    ts = lg.TestSettings()
    ts.scenario = lg.TestScenario.Offline
    ts.FromConfig(user_conf, SCENARIO_MODEL_KEYS["Offline"], "Offline")
    ts.mode = lg.TestMode.PerformanceOnly
    ts.min_duration_ms = 0
    ts.min_query_count = n
    ts.offline_expected_qps = 1.0
    ts.performance_sample_count_override = n
    return ts


class _LogFailures:
    """The transport's sink between SUT rounds: raw results come back through the engine handles."""

    def on_first(self, replica, firsts):
        pass

    def on_results(self, replica, results):
        log.error("replica %d: %d results outside a SUT round", replica, len(results))

    def on_fatal(self, event):
        log.error("engine failure: %s", event.message)


def report(rows: list[dict], facts: dict) -> dict:
    """Print the per-round table, the overall ratio and the median round ratio; return the summary."""
    raw_tps = sum(x["raw"]["tokens"] for x in rows) / sum(x["raw"]["seconds"] for x in rows)
    sut_tps = sum(x["sut"]["tokens"] for x in rows) / sum(x["sut"]["tokens"] / x["sut"]["tokens_per_s"] for x in rows)
    median_ratio = float(np.median([x["ratio"] for x in rows]))
    print(f"\n{'repeat':>6} {'raw tok/s':>12} {'SUT tok/s':>12} {'ratio':>8}")
    for x in rows:
        print(f"{x['repeat']:>6} {x['raw']['tokens_per_s']:>12.1f} {x['sut']['tokens_per_s']:>12.1f} {x['ratio']:>8.4f}")
    print(f"{'all':>6} {raw_tps:>12.1f} {sut_tps:>12.1f} {sut_tps / raw_tps:>8.4f}   "
          f"(tokens raw/SUT per round: {rows[-1]['raw']['tokens']}/{rows[-1]['sut']['tokens']})")
    print(f"median of the per-round ratios: {median_ratio:.4f}")
    return dict(facts, raw_tokens_per_s=raw_tps, sut_tokens_per_s=sut_tps, ratio=sut_tps / raw_tps,
                median_round_ratio=median_ratio, rows=rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--samples", type=int, help="first N samples (default all)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--ignore-eos", action="store_true", help="fixed 128-token outputs (dummy weights)")
    ap.add_argument("--user-conf", default=str(Path(__file__).resolve().parents[2] / "user.conf"))
    ap.add_argument("--json", help="write results here")
    add_engine_flags(ap.add_argument_group("engine"))
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")

    es = engine_settings_from_args(a)
    model = read_model_info(es.model)
    gen = GenerationSettings(ignore_eos=a.ignore_eos, eos_token_ids=model.eos_token_ids)
    ds = load_dataset(a.dataset, model.vocab_size, es.max_model_len, a.samples)
    n = len(ds)

    ts = offline_settings(a.user_conf, n)
    transport = make_transport("local", TransportSpec(engine=es, generation=gen))
    records = transport.start(_LogFailures())
    try:
        raw_round(transport, ds.prompts[: min(16, n)], gen.eos_token_ids)  # warm-up
        ctx = SUTContext(dataset=ds, engine=es, generation=gen, progress=False, vocab_size=model.vocab_size)
        rows = []
        with tempfile.TemporaryDirectory() as td:
            for r in range(a.repeats):
                raw = raw_round(transport, ds.prompts, gen.eos_token_ids)
                d = Path(td) / f"sut{r}"
                d.mkdir()
                s = sut_round(transport, ctx, lambda: ts, d)
                rows.append({"repeat": r, "raw": raw, "sut": s, "ratio": s["tokens_per_s"] / raw["tokens_per_s"]})
                log.info("repeat %d: raw %.1f tok/s, SUT %.1f tok/s, ratio %.4f", r, raw["tokens_per_s"],
                         s["tokens_per_s"], rows[-1]["ratio"])
    finally:
        transport.stop()
    summary = report(rows, dict(samples=n, repeats=a.repeats, engines=transport.replicas,
                                engine_settings=dataclasses.asdict(es), ignore_eos=a.ignore_eos,
                                vllm=records[0].info["vllm_version"], device=records[0].info["device"]))
    if a.json:
        Path(a.json).write_text(json.dumps(summary, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
