"""Engine levers for one H200, measured side by side with the shipped fp8 preset (issue 15).

Every lever runs in a fresh child process (a fresh engine: vLLM does not free a GPU reliably between
``LLM`` objects in one process) over the SAME prompts: the first ``--samples`` rows of a cnn_eval-format
file, ``max_tokens`` 128, ``ignore_eos`` (dummy weights), greedy (temperature 0, as the harness asks).
The time measured is one raw ``LLM.generate`` over every prompt, after a warm-up of 64 prompts; it
excludes engine start. The shipped preset (``baseline``) runs first and again last (``baseline_end``)
so drift over the session shows; ratios are to the mean of the two. Prefix caching is off, as in
every MLPerf run: with it on (vLLM's default) a second pass over the same prompts skips their
prefill and runs ~3x faster (seen on the H200: 20,938 vs 7,303 tok/s), which would void every
in-process comparison.

Levers (``--levers``, comma-separated; names in LEVERS below):
- ``baseline``: loadgen_configs/h200_fp8.toml's engine (fp8 weights + fp8 KV, 512 seqs, 8,192 batched
  tokens, optimisation level O2 = Inductor + FULL_AND_PIECEWISE CUDA graphs, FlashAttention 3). The
  same engine also measures in-process variants that need no restart: the prompts sorted by length
  (longest first), and the sampler with temperature 1 + top_k 1 instead of temperature 0.
- ``fusion``: vLLM's custom rms_norm / quant_fp8 / silu_and_mul ops on, so that the fp8 fusion passes
  (RMSNorm + quant, SiLU-mul + quant) apply: at O2 those passes are enabled only when the custom ops
  are (vllm/config/vllm.py ``enable_norm_fusion``); otherwise Inductor fuses the torch code itself.
- ``full_graphs``: ``cudagraph_mode`` FULL (full CUDA graphs for mixed prefill/decode batches too).
- ``triton_attn``: the Triton attention backend instead of FlashAttention 3.
- ``flashinfer``: the FlashInfer backend (flashinfer-python 0.6.14, the version vLLM 0.26 pins, from the folder
  in env FLASHINFER_SITE, on PYTHONPATH for this lever only; JIT-compiles with nvcc on first use).
- ``mnbt16k``: max_num_batched_tokens 16,384 with 1,024 seqs (prefill/decode balance).
- ``profile``: not a lever: torch-profiler tables of the shipped preset, engine in-process
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), for three workloads: prefill-only (every prompt, 1 new
  token), decode-heavy (512 prompts of 64 tokens, 128 new tokens) and the real mix (256 prompts, 128
  new tokens). Kernels are put into categories (attention, fp8 GEMM, Inductor-fused elementwise =
  norms/activations/quantisation, KV-cache write, rotary, sampling, memcpy, other); GPU idle time
  between kernels is the CPU gap. Written to OUT/profile_*.json and printed as tables.

Output: one JSON line per measurement in OUT/levers.jsonl, a table on stdout, OUT/levers.json.
Example (H200): python scripts/perf_levers.py --model /root/gpu/model --dataset cnn_eval_public.json \
    --out /tmp/perf --levers baseline,fusion,full_graphs,triton_attn,profile,baseline_end
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import time
from pathlib import Path

BASE = dict(dtype="bfloat16", quantization="fp8", kv_cache_dtype="fp8", max_model_len=2668, max_num_seqs=512,
            max_num_batched_tokens=8192, gpu_memory_utilization=0.90, load_format="dummy",
            skip_tokenizer_init=True, seed=0, enable_prefix_caching=False)
LEVERS: dict[str, dict] = {
    "baseline": {},
    "baseline_end": {},
    "fusion": {"compilation_config": {"custom_ops": ["+rms_norm", "+quant_fp8", "+silu_and_mul"],
                                      "pass_config": {"fuse_norm_quant": True, "fuse_act_quant": True}}},
    "full_graphs": {"compilation_config": {"cudagraph_mode": "FULL"}},
    "triton_attn": {"attention_config": {"backend": "TRITON_ATTN"}},
    "flashinfer": {"attention_config": {"backend": "FLASHINFER"}},
    "mnbt16k": {"max_num_batched_tokens": 16384, "max_num_seqs": 1024},
    "profile": {},
}
MAX_NEW = 128


def load_prompts(path: str, n: int) -> list[list[int]]:
    """The first ``n`` ``tok_input`` lists of a cnn_eval-format JSON (optionally .gz) file."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        rows = json.load(f)
    return [list(map(int, r["tok_input"])) for r in rows[:n]]


def _llm(kwargs: dict):
    from vllm import LLM

    return LLM(**kwargs)


def _generate(llm, prompts, sp) -> tuple[float, int]:
    """(seconds, generated tokens) of one LLM.generate over ``prompts``."""
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    return dt, sum(len(o.outputs[0].token_ids) for o in outs)


def base_kwargs(model: str) -> dict:
    """BASE with the model folder and the JSON object in env PERF_BASE_OVERRIDE (CPU smoke tests) applied."""
    return dict(BASE, model=model, **json.loads(os.environ.get("PERF_BASE_OVERRIDE", "{}")))


def child(lever: str, model: str, dataset: str, n: int, out: Path) -> None:
    """Run one lever in this process and append its measurements to OUT/levers.jsonl."""
    from vllm import SamplingParams

    prompts = load_prompts(dataset, n)
    kwargs = dict(base_kwargs(model), **LEVERS[lever])
    t0 = time.perf_counter()
    llm = _llm(kwargs)
    start_s = time.perf_counter() - t0
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=1, ignore_eos=True)
    _generate(llm, prompts[:64], greedy)
    variants = [("as_given", prompts, greedy)]
    if lever == "baseline":
        variants += [("sorted_desc", sorted(prompts, key=len, reverse=True), greedy),
                     ("temp1_topk1", prompts, SamplingParams(temperature=1.0, top_k=1, max_tokens=MAX_NEW,
                                                             min_tokens=1, ignore_eos=True, seed=0)),
                     ("as_given_again", prompts, greedy)]
    for name, ps, sp in variants:
        dt, toks = _generate(llm, ps, sp)
        rec = {"lever": lever, "variant": name, "seconds": dt, "tokens": toks, "tokens_per_s": toks / dt,
               "prompts": len(ps), "engine_start_s": start_s, "engine_kwargs": kwargs}
        with open(out / "levers.jsonl", "a") as f:
            f.write(json.dumps(rec, default=str) + "\n")
        print(f"[{lever}/{name}] {toks / dt:.1f} tok/s ({toks} tokens, {dt:.2f} s)", flush=True)


def run_parent(a) -> int:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for lever in a.levers.split(","):
        if lever not in LEVERS:
            print(f"error: unknown lever {lever!r} (known: {', '.join(LEVERS)})", file=sys.stderr)
            return 2
    for lever in a.levers.split(","):
        cmd = [sys.executable, __file__, "--child", lever, "--model", a.model, "--dataset", a.dataset,
               "--samples", str(a.samples), "--out", str(out)]
        if lever == "profile":
            cmd[1] = str(Path(__file__).with_name("perf_profile.py"))
            cmd = cmd[:2] + cmd[4:]
        env = dict(os.environ)
        if lever == "profile":
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        timeout = a.timeout
        if lever == "flashinfer":  # kept apart: its JIT may take long, and its presence changes other paths
            timeout = min(timeout, a.flashinfer_timeout)
            if os.environ.get("FLASHINFER_SITE"):
                env["PYTHONPATH"] = os.pathsep.join([os.environ["FLASHINFER_SITE"], env.get("PYTHONPATH", "")])
        rc = run_child(cmd, env, out / f"{lever}.log", timeout)
        tail = (out / f"{lever}.log").read_text(errors="replace").splitlines()
        print("\n".join([ln for ln in tail if ln.startswith("[") or "Error" in ln][-12:]), flush=True)
        print(f"lever {lever}: rc {rc}", flush=True)
    summarize(out)
    return 0


def run_child(cmd: list[str], env: dict, log_path: Path, timeout: int) -> int:
    """Run one lever process, output to ``log_path``; its process group is killed after ``timeout`` s (rc 124)."""
    with open(log_path, "w") as logf:
        proc = subprocess.Popen(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            return 124


def summarize(out: Path) -> None:
    """Print every measurement with its ratio to the mean baseline (as_given) and write levers.json."""
    p = out / "levers.jsonl"
    if not p.exists():
        return
    rows = [json.loads(x) for x in p.read_text().splitlines() if x.strip()]
    base = [r["tokens_per_s"] for r in rows if r["lever"] in ("baseline", "baseline_end")
            and r["variant"] in ("as_given", "as_given_again")]
    ref = sum(base) / len(base) if base else None
    print(f"\n{'lever':<14} {'variant':<16} {'tok/s':>9} {'ratio':>7} {'start s':>8}")
    for r in rows:
        ratio = r["tokens_per_s"] / ref if ref else float("nan")
        r["ratio_to_baseline"] = ratio
        print(f"{r['lever']:<14} {r['variant']:<16} {r['tokens_per_s']:>9.1f} {ratio:>7.4f} {r['engine_start_s']:>8.1f}")
    (out / "levers.json").write_text(json.dumps({"baseline_tokens_per_s": ref, "rows": rows}, indent=2,
                                                default=str))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="Llama-3.1-8B config folder (dummy weights)")
    ap.add_argument("--dataset", required=True, help="cnn_eval-format JSON (or .json.gz) with tok_input")
    ap.add_argument("--samples", type=int, default=1020, help="first N prompts (default 1,020)")
    ap.add_argument("--out", required=True, help="result folder")
    ap.add_argument("--levers", default="baseline,fusion,full_graphs,triton_attn,profile,baseline_end")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per lever process")
    ap.add_argument("--flashinfer-timeout", type=int, default=420,
                    help="seconds for the flashinfer lever (JIT build included); env FLASHINFER_SITE = a folder "
                         "with flashinfer-python installed, put on PYTHONPATH for that lever only")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--summarize", action="store_true", help="only re-print OUT/levers.jsonl")
    a = ap.parse_args()
    if a.summarize:
        summarize(Path(a.out))
        return 0
    if a.child:
        child(a.child, a.model, a.dataset, a.samples, Path(a.out))
        return 0
    return run_parent(a)


if __name__ == "__main__":
    sys.exit(main())
