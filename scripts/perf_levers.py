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
- ``static_act``: STATIC per-tensor fp8 activation scales instead of dynamic per-token ones: the model
  folder is copied under /tmp with an fp8 ``quantization_config`` (``activation_scheme: static``) and a
  load hook gives the dummy checkpoint usable values (scripts/perf_fp8_checkpoint.py; docs/perf.md).
- ``fp8ckpt_dynamic``: the control for ``static_act``: the same dummy fp8 checkpoint and values, dynamic
  activation scales; static_act / fp8ckpt_dynamic isolates the activation-quantisation path.
- ``static_act_fusion``: ``static_act`` with the ``fusion`` custom ops and passes (RMSNorm + static quant
  is the pattern vLLM's fusion pass was written for).
- ``profile``: not a lever: torch-profiler tables of the shipped preset, engine in-process
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), for three workloads: prefill-only (every prompt, 1 new
  token), decode-heavy (512 prompts of 64 tokens, 128 new tokens) and the real mix (256 prompts, 128
  new tokens). Kernels are put into categories (attention, fp8 GEMM, Inductor-fused elementwise =
  norms/activations/quantisation, KV-cache write, rotary, sampling, memcpy, other); GPU idle time
  between kernels is the CPU gap. Written to OUT/profile_*.json and printed as tables.

Output: one JSON line per measurement in OUT/levers.jsonl, a table on stdout, OUT/levers.json.
Example (H200): python scripts/perf_levers.py --model /root/gpu/model --dataset cnn_eval_public.json \
    --out /tmp/perf --levers baseline,fusion,full_graphs,triton_attn,profile,baseline_end
``--dry-run`` prints each lever's command, engine arguments and checkpoint plan and starts nothing.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import perf_fp8_checkpoint as fp8ckpt

BASE = dict(dtype="bfloat16", quantization="fp8", kv_cache_dtype="fp8", max_model_len=2668, max_num_seqs=512,
            max_num_batched_tokens=8192, gpu_memory_utilization=0.90, load_format="dummy",
            skip_tokenizer_init=True, seed=0, enable_prefix_caching=False)
FUSION = {"compilation_config": {"custom_ops": ["+rms_norm", "+quant_fp8", "+silu_and_mul"],
                                 "pass_config": {"fuse_norm_quant": True, "fuse_act_quant": True}}}
LEVERS: dict[str, dict] = {
    "baseline": {},
    "baseline_end": {},
    "fusion": FUSION,
    "full_graphs": {"compilation_config": {"cudagraph_mode": "FULL"}},
    "triton_attn": {"attention_config": {"backend": "TRITON_ATTN"}},
    "flashinfer": {"attention_config": {"backend": "FLASHINFER"}},
    "mnbt16k": {"max_num_batched_tokens": 16384, "max_num_seqs": 1024},
    "static_act": {},
    "fp8ckpt_dynamic": {},
    "static_act_fusion": FUSION,
    "profile": {},
}
CHECKPOINT_LEVERS = {"static_act": "static", "fp8ckpt_dynamic": "dynamic", "static_act_fusion": "static"}
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


def lever_kwargs(lever: str, model: str) -> dict:
    """The engine arguments of ``lever`` (the preset's, the lever's on top); model folder not yet replaced."""
    return dict(base_kwargs(model), **LEVERS[lever])


def start_engine(lever: str, kwargs: dict, out: Path, folder: Path | None) -> tuple[object, float, dict]:
    """(LLM, engine start seconds, extra record fields) for ``lever``.

    A checkpoint lever (CHECKPOINT_LEVERS) runs on ``folder``, the copy of the model folder with an fp8
    ``quantization_config``, with the load hook of scripts/perf_fp8_checkpoint.py installed first.
    RuntimeError when the hook did not run in the engine process.
    """
    scheme = CHECKPOINT_LEVERS.get(lever)
    if scheme is None:
        t0 = time.perf_counter()
        return _llm(kwargs), time.perf_counter() - t0, {}
    report = out / f"{lever}.hook.json"
    report.unlink(missing_ok=True)
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "fork")  # the engine core inherits the hook
    fp8ckpt.install_load_hook(report)
    t0 = time.perf_counter()
    llm = _llm(dict(kwargs, model=str(folder)))
    start_s = time.perf_counter() - t0
    counts = fp8ckpt.check_hook_report(report)
    print(f"[{lever}] fp8 checkpoint ({scheme} activations): {counts}", flush=True)
    return llm, start_s, {"checkpoint": {"quantization_config": fp8ckpt.quantization_config(scheme),
                                         "hook_counts": counts}}


def child(lever: str, model: str, dataset: str, n: int, out: Path) -> None:
    """Run one lever; a checkpoint lever's model folder copy under /tmp is removed at the end."""
    scheme = CHECKPOINT_LEVERS.get(lever)
    folder = fp8ckpt.make_checkpoint_folder(model, scheme) if scheme else None
    try:
        measure(lever, model, dataset, n, out, folder)
    finally:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)


def measure(lever: str, model: str, dataset: str, n: int, out: Path, folder: Path | None) -> None:
    """Run one lever in this process and append its measurements to OUT/levers.jsonl."""
    from vllm import SamplingParams

    prompts = load_prompts(dataset, n)
    kwargs = lever_kwargs(lever, model)
    llm, start_s, extra = start_engine(lever, kwargs, out, folder)
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
               "prompts": len(ps), "engine_start_s": start_s, "engine_kwargs": kwargs, **extra}
        with open(out / "levers.jsonl", "a") as f:
            f.write(json.dumps(rec, default=str) + "\n")
        print(f"[{lever}/{name}] {toks / dt:.1f} tok/s ({toks} tokens, {dt:.2f} s)", flush=True)


def parse_levers(text: str) -> list[str]:
    """The comma-separated lever names of ``text`` in order; ValueError naming an unknown or empty one."""
    names = [x.strip() for x in text.split(",")]
    for name in names:
        if name not in LEVERS:
            raise ValueError(f"unknown lever {name!r} (known: {', '.join(LEVERS)})")
    return names


def child_command(a, lever: str, out: Path) -> list[str]:
    """The command line of the process that runs ``lever``."""
    if lever == "profile":
        return [sys.executable, str(Path(__file__).with_name("perf_profile.py")), "--model", a.model,
                "--dataset", a.dataset, "--samples", str(a.samples), "--out", str(out)]
    return [sys.executable, __file__, "--child", lever, "--model", a.model, "--dataset", a.dataset,
            "--samples", str(a.samples), "--out", str(out)]


def print_plan(a, levers: list[str], out: Path) -> None:
    """``--dry-run``: each lever's command, engine arguments and fp8 checkpoint plan; nothing starts."""
    for lever in levers:
        print(f"lever {lever}: {' '.join(child_command(a, lever, out))}")
        if lever != "profile":
            print(f"  engine: {json.dumps(lever_kwargs(lever, a.model), sort_keys=True)}")
        if lever in CHECKPOINT_LEVERS:
            scheme = CHECKPOINT_LEVERS[lever]
            print(f"  model folder: copy of {a.model} under /tmp with quantization_config "
                  f"{json.dumps(fp8ckpt.quantization_config(scheme))} (removed after engine start)")
            print(f"  load hook: fp8 codes uniform in [-{fp8ckpt.FP8_MAX:g}, {fp8ckpt.FP8_MAX:g}], weight_scale "
                  f"1/({fp8ckpt.CODE_RMS:.1f}*sqrt(K)), RMSNorm weights 1, k/v scale {fp8ckpt.KV_SCALE:.5f}"
                  + (f", input_scale {fp8ckpt.INPUT_SCALE:.5f}" if scheme == "static" else ""))


def run_parent(a) -> int:
    out = Path(a.out)
    try:
        levers = parse_levers(a.levers)
    except ValueError as e:
        print(f"error: --levers: {e}", file=sys.stderr)
        return 2
    if a.dry_run:
        print_plan(a, levers, out)
        return 0
    out.mkdir(parents=True, exist_ok=True)
    for lever in levers:
        cmd = child_command(a, lever, out)
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
    print(f"\n{'lever':<18} {'variant':<16} {'tok/s':>9} {'ratio':>7} {'start s':>8}")
    for r in rows:
        ratio = r["tokens_per_s"] / ref if ref else float("nan")
        r["ratio_to_baseline"] = ratio
        print(f"{r['lever']:<18} {r['variant']:<16} {r['tokens_per_s']:>9.1f} {ratio:>7.4f} {r['engine_start_s']:>8.1f}")
    first = {r["lever"]: r["tokens_per_s"] for r in reversed(rows) if r["variant"] == "as_given"}
    static_vs_control = None
    if "static_act" in first and "fp8ckpt_dynamic" in first:
        static_vs_control = first["static_act"] / first["fp8ckpt_dynamic"]
        print(f"static_act / fp8ckpt_dynamic (same fp8 checkpoint; activation quantisation only): "
              f"{static_vs_control:.4f}")
    (out / "levers.json").write_text(json.dumps({"baseline_tokens_per_s": ref, "rows": rows,
                                                 "static_act_vs_fp8ckpt_dynamic": static_vs_control},
                                                indent=2, default=str))


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
    ap.add_argument("--dry-run", action="store_true", help="print each lever's plan; start nothing")
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
