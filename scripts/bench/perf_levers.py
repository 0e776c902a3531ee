"""Engine levers for one H200, measured side by side with the shipped fp8 preset.

Every lever runs in a fresh child process (a fresh engine: vLLM does not free a GPU reliably between
``LLM`` objects in one process) over the SAME prompts: the first ``--samples`` rows of a cnn_eval-format
file, ``max_tokens`` 128, ``ignore_eos`` (dummy weights), greedy (temperature 0, as the harness asks).
The time measured is one raw ``LLM.generate`` over every prompt, after a warm-up over the first
``--warmup`` prompts (default 64; recorded in every row as ``warmup``); it excludes engine start. The
shipped preset (``baseline``) runs first and again last (``baseline_end``) so drift over the session
shows; ratios are to the mean of the two. Prefix caching is off, as in
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
- ``lpt2048`` / ``lpt1024``: ``long_prefill_token_threshold`` 2,048 / 1,024 on the preset (EngineArgs field in
  vLLM 0.26 and 0.32): a prompt's prefill chunk per step is capped at that many tokens, so one long prompt
  cannot take a whole 8,192-token step and more requests are prefilled per step. Rows carry
  ``prompts_over_long_prefill_threshold`` (of the first 1,020 cnn_eval prompts, 9 exceed 2,048 and 305
  exceed 1,024).
- ``gc_off``: Python's cyclic GC disabled in vLLM's engine core process (scheduler, worker and sampler run
  there with one GPU) by ``gc.disable()`` sent through ``LLM.collective_rpc`` right after engine start
  (scripts/bench/perf_engine_gc.py: why this mechanism and what vLLM does with the GC itself). The lever fails
  (rc 1, no row) unless the engine core answers from another pid with GC disabled, after start and after
  every pass. A second pass, ``frontend_gc_off_too``, also disables GC in the lever (front-end) process.
  Every lever's rows carry ``engine_core_gc``: the engine core's GC state and its collections per
  generation and pause time (ms) during the pass.
- ``static_act``: STATIC per-tensor fp8 activation scales instead of dynamic per-token ones: the model
  folder is copied under /tmp with an fp8 ``quantization_config`` (``activation_scheme: static``) and a
  load hook gives the dummy checkpoint usable values (scripts/bench/perf_fp8_checkpoint.py; docs/perf.md).
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

Warm-up length is a setting, not a lever: ``--warmup 1020`` against the default 64 (``summarize`` takes
ratios to the baseline rows at the default warm-up when a folder holds several warm-ups).

Output: one JSON line per measurement in OUT/levers.jsonl, a table on stdout, OUT/levers.json.
Example (H200): python scripts/bench/perf_levers.py --model /root/gpu/model --dataset cnn_eval_public.json \
    --out /tmp/perf --levers baseline,fusion,full_graphs,triton_attn,profile,baseline_end
``--dry-run`` prints each lever's command, engine arguments, passes, GC mechanism and checkpoint plan and
starts nothing.
"""

from __future__ import annotations

import argparse
import gc
import gzip
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import perf_engine_gc as engine_gc
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
    "lpt2048": {"long_prefill_token_threshold": 2048},
    "lpt1024": {"long_prefill_token_threshold": 1024},
    "gc_off": {},
    "static_act": {},
    "fp8ckpt_dynamic": {},
    "static_act_fusion": FUSION,
    "profile": {},
}
CHECKPOINT_LEVERS = {"static_act": "static", "fp8ckpt_dynamic": "dynamic", "static_act_fusion": "static"}
EXTRA_PASSES = {"baseline": ("sorted_desc", "temp1_topk1", "as_given_again"), "gc_off": ("frontend_gc_off_too",)}
MAX_NEW = 128
DEFAULT_WARMUP = 64


class InputError(ValueError):
    """A bad input (dataset file, env PERF_BASE_OVERRIDE, output folder); the message names the file, field and row
    or the variable. Commands report it and exit 2 before anything starts."""


def _json_kind(value) -> str:
    """JSON's name of ``value``'s type (object, array, string, ...), for messages."""
    names = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    return names.get(type(value), "number")


def load_prompts(path: str, n: int) -> list[list[int]]:
    """The first ``n`` ``tok_input`` lists (token ids, ints >= 0) of a cnn_eval-format JSON (optionally .gz) file:
    a JSON array of objects. InputError naming the file when it cannot be read, is not JSON or not an array, and
    the row index and field when one of the first ``n`` rows has no non-empty integer list under ``tok_input``."""
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            rows = json.load(f)
    except OSError as e:  # missing, a folder, unreadable, a broken .gz
        raise InputError(f"--dataset {path}: cannot read it ({type(e).__name__}: {e})") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise InputError(f"--dataset {path}: not JSON ({e})") from None
    if not isinstance(rows, list):
        raise InputError(f"--dataset {path}: a JSON array of rows with 'tok_input' expected, got a JSON "
                         f"{_json_kind(rows)}")
    return [_tok_input(path, i, row) for i, row in enumerate(rows[:n])]


def _tok_input(path: str, i: int, row) -> list[int]:
    """Row ``i``'s ``tok_input`` as a list of ints; InputError naming the file, the row and the field."""
    if not isinstance(row, dict):
        raise InputError(f"--dataset {path}: row {i}: a JSON object expected, got a JSON {_json_kind(row)}")
    if "tok_input" not in row:
        raise InputError(f"--dataset {path}: row {i}: no 'tok_input' field (fields: {', '.join(map(str, row))})")
    ids = row["tok_input"]
    if not (isinstance(ids, list) and ids and all(type(x) is int and x >= 0 for x in ids)):
        raise InputError(f"--dataset {path}: row {i}: 'tok_input' must be a non-empty array of token ids "
                         f"(integers >= 0)")
    return list(ids)


def _llm(kwargs: dict):
    from vllm import LLM

    return LLM(**kwargs)


def _generate(llm, prompts, sp) -> tuple[float, int]:
    """(seconds, generated tokens) of one LLM.generate over ``prompts``."""
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    return dt, sum(len(o.outputs[0].token_ids) for o in outs)


def base_override() -> dict:
    """The JSON object in env PERF_BASE_OVERRIDE (engine arguments over BASE; {} when unset or blank). InputError
    naming the variable when it is not JSON, not an object, or sets ``model`` (that is the command's --model)."""
    text = os.environ.get("PERF_BASE_OVERRIDE", "")
    if not text.strip():
        return {}
    try:
        value = json.loads(text)
    except ValueError as e:
        raise InputError(f"env PERF_BASE_OVERRIDE: not JSON ({e}): {text[:200]!r}") from None
    if not isinstance(value, dict):
        raise InputError(f"env PERF_BASE_OVERRIDE: a JSON object of engine arguments expected, got a JSON "
                         f"{_json_kind(value)}: {text[:200]!r}")
    if "model" in value:
        raise InputError("env PERF_BASE_OVERRIDE: must not set 'model' (the model folder is the command's --model)")
    return value


def base_kwargs(model: str) -> dict:
    """BASE with the model folder and the JSON object in env PERF_BASE_OVERRIDE (CPU smoke tests) applied;
    InputError as ``base_override``."""
    return dict(BASE, model=model, **base_override())


def lever_kwargs(lever: str, model: str) -> dict:
    """The engine arguments of ``lever`` (the preset's, the lever's on top); model folder not yet replaced."""
    return dict(base_kwargs(model), **LEVERS[lever])


def start_engine(lever: str, kwargs: dict, out: Path, folder: Path | None) -> tuple[object, float, dict]:
    """(LLM, engine start seconds, extra record fields) for ``lever``.

    A checkpoint lever (CHECKPOINT_LEVERS) runs on ``folder``, the copy of the model folder with an fp8
    ``quantization_config``, with the load hook of scripts/bench/perf_fp8_checkpoint.py installed first.
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


def child(lever: str, model: str, dataset: str, n: int, out: Path, warmup: int) -> None:
    """Run one lever; a checkpoint lever's model folder copy under /tmp is removed at the end."""
    scheme = CHECKPOINT_LEVERS.get(lever)
    folder = fp8ckpt.make_checkpoint_folder(model, scheme) if scheme else None
    try:
        measure(lever, model, dataset, n, out, folder, warmup)
    finally:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)


def pass_names(lever: str) -> tuple[str, ...]:
    """The timed passes of ``lever`` on its one engine, in order (``as_given`` first, always)."""
    return ("as_given",) + EXTRA_PASSES.get(lever, ())


def passes(lever: str, prompts: list, greedy, sampling_params_cls) -> list[tuple[str, list, object]]:
    """(name, prompts, SamplingParams) of each pass of ``lever`` (``pass_names``)."""
    temp1 = sampling_params_cls(temperature=1.0, top_k=1, max_tokens=MAX_NEW, min_tokens=1, ignore_eos=True, seed=0)
    build = {"as_given": (prompts, greedy), "sorted_desc": (sorted(prompts, key=len, reverse=True), greedy),
             "temp1_topk1": (prompts, temp1), "as_given_again": (prompts, greedy),
             "frontend_gc_off_too": (prompts, greedy)}  # measure() disables this process's GC before it
    return [(name, *build[name]) for name in pass_names(lever)]


def probe_gc(llm, lever: str, disable: bool = False) -> dict | None:
    """The engine core's GC state (perf_engine_gc); None when the probe fails, except for ``gc_off`` (raises)."""
    try:
        state = engine_gc.engine_gc_state(llm, disable)
    except Exception as e:  # noqa: BLE001 - a failed probe must not cost the other levers their rows
        if lever == "gc_off":
            raise RuntimeError(f"gc_off: the GC probe could not run in the engine core: {e}") from e
        print(f"[{lever}] engine core GC probe failed: {e!r}", flush=True)
        return None
    if lever == "gc_off":
        engine_gc.require_off(state, "after gc.disable()" if disable else "at a probe around a pass")
    return state


def lever_fields(lever: str, kwargs: dict, prompts: list[list[int]]) -> dict:
    """Record fields that say what a lever did beyond its engine arguments."""
    fields = {}
    lpt = kwargs.get("long_prefill_token_threshold")
    if lpt:
        fields["prompts_over_long_prefill_threshold"] = sum(len(p) > lpt for p in prompts)
    if lever == "gc_off":
        fields["gc_mechanism"] = engine_gc.MECHANISM
    return fields


def measure(lever: str, model: str, dataset: str, n: int, out: Path, folder: Path | None, warmup: int) -> None:
    """Run one lever in this process and append its measurements to OUT/levers.jsonl.

    RuntimeError (no row written) when ``gc_off`` cannot show GC disabled in a separate engine core process.
    """
    from vllm import SamplingParams

    prompts = load_prompts(dataset, n)
    kwargs = lever_kwargs(lever, model)
    llm, start_s, extra = start_engine(lever, kwargs, out, folder)
    extra.update(lever_fields(lever, kwargs, prompts))
    probe_gc(llm, lever, disable=lever == "gc_off")
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=1, ignore_eos=True)
    warmup_s, _ = _generate(llm, prompts[:warmup], greedy)
    for name, ps, sp in passes(lever, prompts, greedy, SamplingParams):
        if name == "frontend_gc_off_too":
            gc.disable()
        before = probe_gc(llm, lever)
        dt, toks = _generate(llm, ps, sp)
        after = probe_gc(llm, lever)
        rec = {"lever": lever, "variant": name, "seconds": dt, "tokens": toks, "tokens_per_s": toks / dt,
               "prompts": len(ps), "warmup": warmup, "warmup_s": warmup_s, "engine_start_s": start_s,
               "frontend_gc_enabled": gc.isenabled(),
               "engine_core_gc": engine_gc.pass_record(before, after) if before and after else None,
               "engine_kwargs": kwargs, **extra}
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
            "--samples", str(a.samples), "--warmup", str(a.warmup), "--out", str(out)]


def print_plan(a, levers: list[str], out: Path) -> None:
    """``--dry-run``: each lever's command, engine arguments, passes, GC and fp8 checkpoint plan; nothing starts."""
    for lever in levers:
        print(f"lever {lever}: {' '.join(child_command(a, lever, out))}")
        if lever != "profile":
            print(f"  engine: {json.dumps(lever_kwargs(lever, a.model), sort_keys=True)}")
            print(f"  passes: warm-up over the first {a.warmup} prompts, then {', '.join(pass_names(lever))}")
        if lever == "gc_off":
            print(f"  GC: {engine_gc.MECHANISM}; fails unless the engine core (another pid) reports GC disabled")
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
    try:
        base_override()
        if not a.dry_run:
            load_prompts(a.dataset, a.samples)  # the children read it: a bad file fails here, before any folder
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
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


def baseline_refs(rows: list[dict]) -> tuple[float | None, dict[int, float]]:
    """(reference tok/s, mean baseline tok/s per warm-up length) from the baseline rows of ``rows``.

    Baseline rows are ``baseline``/``baseline_end`` passes ``as_given``/``as_given_again``; a row without
    ``warmup`` is from before it was recorded (always 64). The reference is the mean at the default warm-up,
    or at the only warm-up present; None with several warm-ups but none at the default, or no baseline.
    """
    by_warmup: dict[int, list[float]] = {}
    for r in rows:
        if r["lever"] in ("baseline", "baseline_end") and r["variant"] in ("as_given", "as_given_again"):
            by_warmup.setdefault(r.get("warmup", DEFAULT_WARMUP), []).append(r["tokens_per_s"])
    means = {w: sum(v) / len(v) for w, v in sorted(by_warmup.items())}
    ref = means.get(DEFAULT_WARMUP, next(iter(means.values())) if len(means) == 1 else None)
    return ref, means


def _gc_cell(r: dict) -> str:
    """Engine core GC during the pass: collections (all generations) / pause ms; '-' when not recorded."""
    g = r.get("engine_core_gc")
    return f"{sum(g['collections'])}/{g['pause_ms']:.1f}" if g else "-"


def summarize(out: Path) -> None:
    """Print every measurement with its ratio to the mean baseline (``baseline_refs``) and write levers.json."""
    p = out / "levers.jsonl"
    if not p.exists():
        return
    rows = [json.loads(x) for x in p.read_text().splitlines() if x.strip()]
    ref, by_warmup = baseline_refs(rows)
    print(f"\n{'lever':<18} {'variant':<20} {'warmup':>6} {'tok/s':>9} {'ratio':>7} {'start s':>8} "
          f"{'core GC n/ms':>12}")
    for r in rows:
        ratio = r["tokens_per_s"] / ref if ref else float("nan")
        r["ratio_to_baseline"] = ratio
        print(f"{r['lever']:<18} {r['variant']:<20} {r.get('warmup', DEFAULT_WARMUP):>6} {r['tokens_per_s']:>9.1f} "
              f"{ratio:>7.4f} {r['engine_start_s']:>8.1f} {_gc_cell(r):>12}")
    if len(by_warmup) > 1:
        print("baseline by warm-up: " + ", ".join(f"{w}: {v:.1f} tok/s" for w, v in by_warmup.items()))
    first = {r["lever"]: r["tokens_per_s"] for r in reversed(rows) if r["variant"] == "as_given"}
    static_vs_control = None
    if "static_act" in first and "fp8ckpt_dynamic" in first:
        static_vs_control = first["static_act"] / first["fp8ckpt_dynamic"]
        print(f"static_act / fp8ckpt_dynamic (same fp8 checkpoint; activation quantisation only): "
              f"{static_vs_control:.4f}")
    (out / "levers.json").write_text(json.dumps({"baseline_tokens_per_s": ref, "baseline_by_warmup": by_warmup,
                                                 "rows": rows, "static_act_vs_fp8ckpt_dynamic": static_vs_control},
                                                indent=2, default=str))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="Llama-3.1-8B config folder (dummy weights)")
    ap.add_argument("--dataset", required=True, help="cnn_eval-format JSON (or .json.gz) with tok_input")
    ap.add_argument("--samples", type=int, default=1020, help="first N prompts (default 1,020)")
    ap.add_argument("--warmup", type=int, default=None,
                    help=f"warm-up pass over the first N prompts before the timed passes (1..--samples; "
                         f"default {DEFAULT_WARMUP}, or --samples if fewer); recorded in every row")
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
    a.warmup = min(DEFAULT_WARMUP, a.samples) if a.warmup is None else a.warmup
    if not 1 <= a.warmup <= a.samples:
        print(f"error: --warmup {a.warmup}: must be between 1 and --samples ({a.samples})", file=sys.stderr)
        return 2
    if a.summarize:
        summarize(Path(a.out))
        return 0
    if a.child:
        child(a.child, a.model, a.dataset, a.samples, Path(a.out), a.warmup)
        return 0
    return run_parent(a)


if __name__ == "__main__":
    sys.exit(main())
