"""Where the time goes in one engine step on the H200: torch-profiler summary tables.

Runs the shipped fp8 preset (scripts/bench/perf_levers.py BASE) with the engine in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set by the caller or here) and profiles three workloads after a
warm-up, each under ``torch.profiler`` with CPU + CUDA activities:

- ``prefill``: the first 256 prompts, 1 new token (prefill-only steps, up to 8,192 batched tokens each);
- ``decode``: 512 prompts cut to 64 tokens, 128 new tokens (decode-heavy steps of up to 512 sequences);
- ``mixed``: the first 256 real prompts, 128 new tokens (what the Offline run does: prefill chunks
  riding along decode steps).

For each workload the kernels of the Chrome trace (``cat`` = kernel / gpu_memcpy / gpu_memset) are
summed per category (CATEGORIES below, first matching pattern wins, by kernel name); ``busy`` is the
union of kernel intervals, ``wall`` the span from the first to the last GPU activity, and ``gap`` =
wall - busy is the time the GPU waits for the CPU (scheduling, input preparation, sampling on the
CPU side, Python). The engine-step count comes from wrapping ``LLMEngine.step``; the profiler itself
adds CPU cost, so absolute times are a little slower than unprofiled runs (compare shares, not tok/s).

Writes OUT/profile_<workload>.json (categories, top 25 kernels, steps, wall, busy, gap) and prints
tables. Usage: VLLM_ENABLE_V1_MULTIPROCESSING=0 python scripts/bench/perf_profile.py --model M --dataset F --out D
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from perf_levers import base_kwargs, load_prompts  # noqa: E402

CATEGORIES = [
    # Inductor-generated Triton kernels first: on this preset they fuse RMSNorm / SiLU-mul with the dynamic
    # per-token fp8 quantisation of the activations (abs, max, div, clamp), whatever GEMM their name mentions.
    ("norm_act_quant", r"^triton_|rms|norm|silu|act_and_mul|quant|fused_add"),
    ("kv_cache_write", r"reshape_and_cache|concat_and_cache|cache_kernel"),
    ("attention", r"flash|fmha|attn|attention|paged"),
    ("fp8_gemm", r"cutlass_3x_gemm|scaled_mm|fp8.*gemm|gemm.*fp8|e4m3"),
    ("bf16_gemm_cublas", r"nvjet|cublas|gemm|xmma|sm90_|wgmma|matmul"),  # lm_head (not quantised) and the like
    ("rotary", r"rotary|rope"),
    ("sampling", r"argmax|topk|top_k|softmax|sampl|gumbel|sort|exponential|log_softmax|reduce"),
    ("embedding_logits", r"embedding|index_select|gather|lm_head"),
    ("elementwise_copy", r"elementwise|copy|fill|cat|index|scatter|vectorized"),
]


def categorize(name: str, cat: str) -> str:
    """The category of one GPU activity: ``cat`` is the Chrome-trace category (kernel, gpu_memcpy, gpu_memset)."""
    if cat != "kernel":
        return "memcpy_memset"
    low = name.lower()
    for label, pat in CATEGORIES:
        if re.search(pat, low):
            return label
    return "other"


def recategorize(res: dict) -> dict:
    """Categories of a written profile recomputed from its top kernels with today's CATEGORIES (ms and share of
    all kernel time; what the top kernels do not cover is ``not_in_top_kernels``)."""
    cats: dict[str, float] = {}
    for k in res["top_kernels"]:
        cat = "memcpy_memset" if k["name"].startswith("Memcpy") or k["name"].startswith("Memset") else "kernel"
        c = categorize(k["name"], cat)
        cats[c] = cats.get(c, 0.0) + k["ms"]
    cats["not_in_top_kernels"] = max(0.0, res["kernel_ms_total"] - sum(cats.values()))
    total = res["kernel_ms_total"]
    res = dict(res, categories_ms=dict(sorted(cats.items(), key=lambda kv: -kv[1])))
    res["categories_share"] = {k: v / total for k, v in res["categories_ms"].items()}
    return res


def summarize_trace(path: Path, steps: int, wall_s: float, tokens: int) -> dict:
    """Category sums, busy/gap and the top kernels of one Chrome trace (times in ms)."""
    events = json.loads(path.read_text()).get("traceEvents", [])
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    if not gpu:
        return {"error": "no GPU activity in the trace"}
    cats: dict[str, float] = {}
    kern: dict[str, list] = {}
    spans = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in gpu)
    for e in gpu:
        c = categorize(e.get("name", ""), e["cat"])
        cats[c] = cats.get(c, 0.0) + e["dur"] / 1000
        k = kern.setdefault(e.get("name", "")[:120], [0.0, 0, c])
        k[0] += e["dur"] / 1000
        k[1] += 1
    busy, cur_s, cur_e = 0.0, spans[0][0], spans[0][1]
    for s, t in spans[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            cur_s, cur_e = s, t
        else:
            cur_e = max(cur_e, t)
    busy += cur_e - cur_s
    span_ms = (spans[-1][1] - spans[0][0]) / 1000
    busy_ms = busy / 1000
    total = sum(cats.values())
    top = sorted(kern.items(), key=lambda kv: -kv[1][0])[:25]
    return {
        "steps": steps, "wall_s_profiled": wall_s, "generated_tokens": tokens,
        "gpu_span_ms": span_ms, "gpu_busy_ms": busy_ms, "cpu_gap_ms": span_ms - busy_ms,
        "cpu_gap_share": (span_ms - busy_ms) / span_ms if span_ms else None,
        "ms_per_step": span_ms / steps if steps else None,
        "kernel_ms_total": total,
        "categories_ms": dict(sorted(cats.items(), key=lambda kv: -kv[1])),
        "categories_share": {k: v / total for k, v in sorted(cats.items(), key=lambda kv: -kv[1])},
        "top_kernels": [{"name": n, "ms": v[0], "calls": v[1], "category": v[2]} for n, v in top],
    }


def profile_workload(llm, name: str, prompts, max_tokens: int, out: Path) -> dict:
    import torch
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True)
    engine = llm.llm_engine
    orig_step, count = engine.step, [0]

    def counted_step(*args, **kwargs):
        count[0] += 1
        return orig_step(*args, **kwargs)

    engine.step = counted_step
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    engine.step = orig_step
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    with tempfile.TemporaryDirectory() as td:
        trace = Path(td) / "trace.json"
        prof.export_chrome_trace(str(trace))
        res = summarize_trace(trace, count[0], wall, tokens)
    res["workload"] = name
    res["prompts"] = len(prompts)
    res["prompt_tokens"] = sum(map(len, prompts))
    (out / f"profile_{name}.json").write_text(json.dumps(res, indent=2))
    return res


def print_table(res: dict) -> None:
    print(f"\n== {res['workload']}: {res['prompts']} prompts, {res['prompt_tokens']} prompt tokens, "
          f"{res.get('generated_tokens')} new tokens, {res.get('steps')} engine steps")
    if "error" in res:
        print("  ", res["error"])
        return
    print(f"   GPU span {res['gpu_span_ms']:.1f} ms, busy {res['gpu_busy_ms']:.1f} ms, CPU gap "
          f"{res['cpu_gap_ms']:.1f} ms ({100 * res['cpu_gap_share']:.1f} %), {res['ms_per_step']:.2f} ms/step")
    for k, v in res["categories_ms"].items():
        print(f"   {k:<18} {v:>10.1f} ms {100 * res['categories_share'][k]:>6.1f} %")
    for t in res["top_kernels"][:10]:
        print(f"     {t['ms']:>9.1f} ms {t['calls']:>7} x  [{categorize(t['name'], 'kernel')}] {t['name'][:90]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--dataset")
    ap.add_argument("--samples", type=int, default=1020)
    ap.add_argument("--out", required=True)
    ap.add_argument("--summarize", action="store_true",
                    help="only re-print OUT/profile_*.json with today's categories (no engine)")
    a = ap.parse_args()
    out = Path(a.out)
    if a.summarize:
        for name in ("prefill", "decode", "mixed"):
            if (out / f"profile_{name}.json").exists():
                print_table(recategorize(json.loads((out / f"profile_{name}.json").read_text())))
        return 0
    out.mkdir(parents=True, exist_ok=True)
    if not (a.model and a.dataset):
        ap.error("--model and --dataset are needed to profile")
    from vllm import LLM, SamplingParams

    prompts = load_prompts(a.dataset, a.samples)
    llm = LLM(**base_kwargs(a.model))
    llm.generate([{"prompt_token_ids": p} for p in prompts[:64]],
                 SamplingParams(temperature=0.0, max_tokens=MAX_WARM, ignore_eos=True), use_tqdm=False)
    short = [p[:64] for p in prompts[:512]]
    for name, ps, mt in (("prefill", prompts[:256], 1), ("decode", short, 128), ("mixed", prompts[:256], 128)):
        print_table(profile_workload(llm, name, ps, mt, out))
    return 0


MAX_WARM = 128

if __name__ == "__main__":
    sys.exit(main())
