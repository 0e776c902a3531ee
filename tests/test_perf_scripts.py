"""The H200 performance scripts' arithmetic (scripts/bench/perf_profile.py, scripts/bench/perf_levers.py), on made-up data."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

sys.path.insert(0, str(ROOT / "scripts" / "bench"))
import perf_levers  # noqa: E402
import perf_profile  # noqa: E402


@pytest.mark.parametrize("name,cat,want", [
    ("void flash::FlashAttnFwdSm90<...>", "kernel", "attention"),
    ("sm90_xmma_gemm_e4m3e4m3_bf16_f32_tn", "kernel", "fp8_gemm"),
    ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT", "kernel", "bf16_gemm_cublas"),
    ("triton_red_fused__to_copy_abs_clamp_cutlass_scaled_mm_div_max_mul_reciprocal_silu", "kernel", "norm_act_quant"),
    ("_gumbel_sample_kernel", "kernel", "sampling"),
    ("void vllm::cutlass_3x_gemm_fp8<...>", "kernel", "fp8_gemm"),
    ("triton_poi_fused_mul_silu_0", "kernel", "norm_act_quant"),
    ("void vllm::reshape_and_cache_flash_kernel<...>", "kernel", "kv_cache_write"),
    ("void at::native::reduce_kernel<argmax>", "kernel", "sampling"),
    ("Memcpy HtoD (Pageable -> Device)", "gpu_memcpy", "memcpy_memset"),
    ("some_unknown_kernel_name", "kernel", "other"),
])
def test_categorize(name, cat, want):
    assert perf_profile.categorize(name, cat) == want


def test_summarize_trace_busy_gap_and_shares(tmp_path):
    # Three kernels (µs): [0, 100) attention, [50, 150) gemm (overlaps), [300, 400) triton; one CPU event.
    events = [
        {"cat": "kernel", "name": "flash_fwd", "ts": 0, "dur": 100},
        {"cat": "kernel", "name": "cutlass_3x_gemm_sm90_fp8", "ts": 50, "dur": 100},
        {"cat": "kernel", "name": "triton_red_fused_rms", "ts": 300, "dur": 100},
        {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 1000},
    ]
    p = tmp_path / "t.json"
    p.write_text(json.dumps({"traceEvents": events}))
    res = perf_profile.summarize_trace(p, steps=2, wall_s=0.001, tokens=4)
    assert res["gpu_span_ms"] == pytest.approx(0.4)
    assert res["gpu_busy_ms"] == pytest.approx(0.25)  # union of [0,150) and [300,400)
    assert res["cpu_gap_ms"] == pytest.approx(0.15)
    assert res["ms_per_step"] == pytest.approx(0.2)
    assert res["categories_ms"] == pytest.approx({"attention": 0.1, "fp8_gemm": 0.1, "norm_act_quant": 0.1})
    assert sum(res["categories_share"].values()) == pytest.approx(1.0)
    assert res["top_kernels"][0]["calls"] == 1


def test_summarize_trace_without_gpu_activity(tmp_path):
    p = tmp_path / "t.json"
    p.write_text(json.dumps({"traceEvents": [{"cat": "cpu_op", "name": "x", "ts": 0, "dur": 5}]}))
    assert "error" in perf_profile.summarize_trace(p, 1, 0.1, 1)


def test_lever_ratios_use_mean_of_both_baselines(tmp_path, capsys):
    rows = [
        {"lever": "baseline", "variant": "as_given", "tokens_per_s": 100.0, "engine_start_s": 1.0},
        {"lever": "baseline", "variant": "as_given_again", "tokens_per_s": 110.0, "engine_start_s": 1.0},
        {"lever": "fusion", "variant": "as_given", "tokens_per_s": 126.0, "engine_start_s": 1.0},
        {"lever": "baseline_end", "variant": "as_given", "tokens_per_s": 90.0, "engine_start_s": 1.0},
    ]
    (tmp_path / "levers.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    perf_levers.summarize(tmp_path)
    out = json.loads((tmp_path / "levers.json").read_text())
    assert out["baseline_tokens_per_s"] == pytest.approx(100.0)
    fusion = [r for r in out["rows"] if r["lever"] == "fusion"][0]
    assert fusion["ratio_to_baseline"] == pytest.approx(1.26)


def test_unknown_lever_exits_2(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench" / "perf_levers.py"), "--model", "m", "--dataset", "d",
                        "--out", str(tmp_path / "o"), "--levers", "baseline,warp_drive"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "warp_drive" in r.stderr


def test_recategorize_uses_top_kernels_and_keeps_the_remainder():
    res = {"kernel_ms_total": 10.0, "top_kernels": [
        {"name": "triton_red_fused__to_copy_abs_clamp_cutlass_scaled_mm_div", "ms": 3.0, "calls": 1},
        {"name": "void vllm::cutlass_3x_gemm_sm90_fp8<...>", "ms": 5.0, "calls": 1},
        {"name": "Memcpy HtoD (Pinned -> Device)", "ms": 1.0, "calls": 1}]}
    out = perf_profile.recategorize(res)
    assert out["categories_ms"] == pytest.approx({"fp8_gemm": 5.0, "norm_act_quant": 3.0, "memcpy_memset": 1.0,
                                                  "not_in_top_kernels": 1.0})
    assert out["categories_share"]["fp8_gemm"] == pytest.approx(0.5)


def test_lever_ratios_use_the_default_warmup_baseline_when_warmups_are_mixed(tmp_path, capsys):
    rows = [
        {"lever": "baseline", "variant": "as_given", "tokens_per_s": 100.0, "engine_start_s": 1.0},  # before warmup
        {"lever": "baseline_end", "variant": "as_given", "tokens_per_s": 102.0, "engine_start_s": 1.0, "warmup": 64},
        {"lever": "baseline", "variant": "as_given", "tokens_per_s": 104.0, "engine_start_s": 1.0, "warmup": 1020},
        {"lever": "gc_off", "variant": "as_given", "tokens_per_s": 103.02, "engine_start_s": 1.0, "warmup": 64,
         "engine_core_gc": {"collections": [0, 0, 0], "pause_ms": 0.0}},
    ]
    (tmp_path / "levers.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    perf_levers.summarize(tmp_path)
    out = json.loads((tmp_path / "levers.json").read_text())
    assert out["baseline_tokens_per_s"] == pytest.approx(101.0)
    assert out["baseline_by_warmup"] == {"64": pytest.approx(101.0), "1020": pytest.approx(104.0)}
    ratios = {(r["lever"], r.get("warmup")): r["ratio_to_baseline"] for r in out["rows"]}
    assert ratios[("baseline", 1020)] == pytest.approx(104.0 / 101.0)
    assert ratios[("gc_off", 64)] == pytest.approx(1.02)
    printed = capsys.readouterr().out
    assert "baseline by warm-up: 64: 101.0 tok/s, 1020: 104.0 tok/s" in printed and "0/0.0" in printed


def test_single_nondefault_warmup_is_its_own_reference():
    rows = [{"lever": "baseline", "variant": "as_given", "tokens_per_s": 90.0, "warmup": 1020},
            {"lever": "baseline_end", "variant": "as_given", "tokens_per_s": 110.0, "warmup": 1020}]
    assert perf_levers.baseline_refs(rows) == (pytest.approx(100.0), {1020: pytest.approx(100.0)})
    rows.append({"lever": "baseline", "variant": "as_given", "tokens_per_s": 50.0, "warmup": 8})
    assert perf_levers.baseline_refs(rows)[0] is None


@pytest.mark.parametrize("warmup", ["0", "1021"])
def test_warmup_outside_one_to_samples_exits_2(tmp_path, warmup):
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench" / "perf_levers.py"), "--model", "m", "--dataset", "d",
                        "--out", str(tmp_path / "o"), "--warmup", warmup, "--dry-run"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and f"--warmup {warmup}: must be between 1 and --samples" in r.stderr
    assert not (tmp_path / "o").exists()


def test_dry_run_plans_gc_off_lpt2048_and_the_warmup(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench" / "perf_levers.py"), "--model", "m", "--dataset", "d",
                        "--out", str(tmp_path / "o"), "--warmup", "1020", "--dry-run",
                        "--levers", "baseline,gc_off,lpt2048,baseline_end"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    plans = r.stdout.split("lever ")[1:]
    assert [p.split(":")[0] for p in plans] == ["baseline", "gc_off", "lpt2048", "baseline_end"]
    assert all("--warmup 1020" in p and "warm-up over the first 1020 prompts" in p for p in plans)
    assert "then as_given, frontend_gc_off_too" in plans[1] and "collective_rpc" in plans[1]
    assert "GC:" not in plans[0] + plans[2] + plans[3]
    assert '"long_prefill_token_threshold": 2048' in plans[2] and "long_prefill" not in plans[0]
    assert not (tmp_path / "o").exists()


def test_default_warmup_is_capped_at_samples(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench" / "perf_levers.py"), "--model", "m", "--dataset", "d",
                        "--out", str(tmp_path / "o"), "--samples", "5", "--levers", "baseline", "--dry-run"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "--samples 5 --warmup 5 " in r.stdout, r.stderr


def test_load_prompts_reads_gz_and_names_the_file_row_and_field_of_a_bad_dataset(tmp_path):
    import gzip

    good = tmp_path / "d.json.gz"
    with gzip.open(good, "wt") as f:
        json.dump([{"tok_input": [5, 6]}, {"tok_input": [7]}, {"bad": 1}], f)
    assert perf_levers.load_prompts(str(good), 2) == [[5, 6], [7]]  # rows past n are not read
    bad = tmp_path / "b.json"
    for content, says in (("{", "not JSON"), ('{"tok_input": [1]}', "a JSON array of rows"),
                          ('[{"tok_input": [1]}, 3]', "row 1: a JSON object expected"),
                          ('[{"tok_input": [1]}, {"tok_input": [1.5]}]', "row 1: 'tok_input' must be"),
                          ('[{"tok_input": []}]', "row 0: 'tok_input' must be a non-empty")):
        bad.write_text(content)
        with pytest.raises(perf_levers.InputError, match=f"b.json: {says}"):
            perf_levers.load_prompts(str(bad), 5)


@pytest.mark.parametrize("override, says", [
    ("{x", "not JSON"), ("7", "a JSON object of engine arguments expected, got a JSON number"),
    ('{"model": "/m"}', "must not set 'model'")])
def test_a_bad_perf_base_override_exits_2_naming_it_and_makes_no_folder(tmp_path, override, says, monkeypatch):
    monkeypatch.setenv("PERF_BASE_OVERRIDE", override)
    with pytest.raises(perf_levers.InputError, match=f"PERF_BASE_OVERRIDE: {says}"):
        perf_levers.base_kwargs("m")
    monkeypatch.setenv("PERF_BASE_OVERRIDE", ' {"max_num_seqs": 640} ')
    assert perf_levers.base_kwargs("m")["max_num_seqs"] == 640
    for dry in (["--dry-run"], []):
        r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench" / "perf_levers.py"), "--model", "m",
                            "--dataset", "d", "--out", str(tmp_path / "o"), "--levers", "baseline", *dry],
                           env=dict(os.environ, PERF_BASE_OVERRIDE=override),
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and f"PERF_BASE_OVERRIDE: {says}" in r.stderr and not (tmp_path / "o").exists()


def test_a_missing_dataset_exits_2_before_any_lever_or_folder(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench" / "perf_levers.py"), "--model", "m",
                        "--dataset", str(tmp_path / "nope.json"), "--out", str(tmp_path / "o"), "--levers", "baseline"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "nope.json: cannot read it (FileNotFoundError" in r.stderr
    assert not (tmp_path / "o").exists()
