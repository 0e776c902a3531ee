"""A dummy fp8 *checkpoint* for the static-activation-scale levers of scripts/bench/perf_levers.py.

The shipped preset quantises a bf16 model online (``quantization="fp8"`` on a config without
``quantization_config``): vLLM 0.26 then uses ``Fp8PerTensorOnlineLinearMethod`` with DYNAMIC per-token
activation scales, so every linear layer's input needs a row max before its fp8 GEMM. A calibrated fp8
checkpoint (ModelOpt / llm-compressor, as MLPerf submitters use) instead declares
``quantization_config = {"quant_method": "fp8", "activation_scheme": "static"}``: vLLM then uses
``Fp8LinearMethod`` with ``kFp8StaticTensorSym`` (one fp32 ``input_scale`` per layer, the quantisation a
plain multiply + clamp that Inductor fuses into the norm / SiLU-mul kernel, no reduction).

``make_checkpoint_folder`` copies a model folder (config + tokenizer/generation files, never weights)
into a fresh folder under /tmp with that ``quantization_config``. With ``load_format="dummy"`` vLLM then
creates fp8 weight, ``weight_scale`` and ``input_scale`` parameters and fills all of them with
uniform(-1e-3, 1e-3) (vllm/model_executor/model_loader/weight_utils.py ``initialize_single_dummy_weight``,
same in 0.26 and 0.32): ~98 % of the fp8 weight codes become 0 (e4m3's smallest step is 2**-9) and the
scales are tiny and of random sign. That takes no other kernel path (no NaN/inf or zero-scale check in
the static quant or ``cutlass_scaled_mm``), but zero operands draw less power than the baseline's
full-range codes, which can flatter a power-limited fp8 GEMM. ``install_load_hook`` therefore sets
checkpoint-like values right after the dummy fill and before ``process_weights_after_loading`` (so
requantisation, compilation and CUDA-graph capture all see them): see ``set_checkpoint_values``.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from pathlib import Path

FP8_MAX = 448.0  # largest float8_e4m3fn value (torch.finfo(torch.float8_e4m3fn).max)
CODE_RMS = FP8_MAX / math.sqrt(3.0)  # rms of codes drawn uniformly from [-448, 448]
ACT_MAX = 8.0  # activations kept O(1) by the unit-gain weights; |x| <= 8 quantises without saturation
INPUT_SCALE = ACT_MAX / FP8_MAX  # per-tensor static activation scale of every fp8 linear layer
KV_SCALE = ACT_MAX / FP8_MAX  # per-tensor k/v cache scale (q_scale left absent: vLLM then uses k_scale)
WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
SCHEMES = ("static", "dynamic")


def quantization_config(scheme: str) -> dict:
    """The ``quantization_config`` of an fp8-serialized per-tensor checkpoint; ``scheme`` in SCHEMES."""
    if scheme not in SCHEMES:
        raise ValueError(f"activation scheme {scheme!r}: expected one of {SCHEMES}")
    return {"quant_method": "fp8", "activation_scheme": scheme}


def make_checkpoint_folder(src: str | Path, scheme: str, root: str | Path = "/tmp") -> Path:
    """Copy the model folder ``src`` (no weight files) to a new folder under ``root``, fp8 config added.

    Raises FileNotFoundError without ``src/config.json``, ValueError when that config already carries a
    ``quantization_config`` (the levers start from the bf16 config the shipped preset quantises online).
    """
    src = Path(src)
    cfg_path = src / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{cfg_path}: no config.json in the model folder")
    cfg = json.loads(cfg_path.read_text())
    if "quantization_config" in cfg:
        raise ValueError(f"{cfg_path}: already has a quantization_config; give the bf16 config folder")
    cfg["quantization_config"] = quantization_config(scheme)
    dest = Path(tempfile.mkdtemp(prefix=f"perf_fp8ckpt_{scheme}_", dir=str(root)))
    for f in src.iterdir():
        if f.is_file() and f.name != "config.json" and not f.name.endswith(WEIGHT_FILES):
            shutil.copy2(f, dest / f.name)
    (dest / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return dest


def _is_fp8_linear(module) -> bool:
    import torch

    w = getattr(module, "weight", None)
    return (w is not None and w.dtype == torch.float8_e4m3fn and hasattr(module, "weight_scale")
            and hasattr(module, "input_size_per_partition"))


def set_checkpoint_values(model, seed: int = 0) -> dict:
    """Give every fp8 layer of ``model`` (raw checkpoint layout, before processing) checkpoint-like values.

    - fp8 linear (``weight`` (N, K) float8_e4m3fn + ``weight_scale`` per shard): codes uniform over
      [-448, 448], as the baseline's online-quantised dummy weights; ``weight_scale`` 1 / (CODE_RMS * sqrt(K))
      so each layer maps rms-1 inputs to rms-1 outputs; ``input_scale`` (static only) INPUT_SCALE.
    - RMSNorm (class name ending in ``RMSNorm``): weight 1, so activations stay O(1) through the stack.
    - attention (``k_scale``/``v_scale`` parameters): KV_SCALE; ``q_scale``/``prob_scale`` -1 (absent).
    Returns the counts {"fp8_linear", "input_scales", "norms", "kv_scales"}.
    """
    import torch

    counts = {"fp8_linear": 0, "input_scales": 0, "norms": 0, "kv_scales": 0}
    gen = None
    with torch.no_grad():
        for module in model.modules():
            if _is_fp8_linear(module):
                w = module.weight
                if gen is None:
                    gen = torch.Generator(device=w.device)
                    gen.manual_seed(seed)
                codes = torch.empty(w.shape, dtype=torch.float16, device=w.device)
                w.copy_(codes.uniform_(-FP8_MAX, FP8_MAX, generator=gen).to(w.dtype))
                module.weight_scale.fill_(1.0 / (CODE_RMS * math.sqrt(module.input_size_per_partition)))
                counts["fp8_linear"] += 1
                if isinstance(getattr(module, "input_scale", None), torch.Tensor):
                    module.input_scale.fill_(INPUT_SCALE)
                    counts["input_scales"] += 1
            elif type(module).__name__.endswith("RMSNorm") and isinstance(getattr(module, "weight", None),
                                                                          torch.Tensor):
                module.weight.fill_(1.0)
                counts["norms"] += 1
            elif isinstance(getattr(module, "k_scale", None), torch.Tensor) and hasattr(module, "v_scale"):
                module.k_scale.fill_(KV_SCALE)
                module.v_scale.fill_(KV_SCALE)
                for name in ("q_scale", "prob_scale"):
                    if isinstance(getattr(module, name, None), torch.Tensor):
                        getattr(module, name).fill_(-1.0)
                counts["kv_scales"] += 1
    return counts


def install_load_hook(report: Path) -> None:
    """Make vLLM's dummy loader call ``set_checkpoint_values`` after its fill and write the counts to ``report``.

    Patches ``DummyModelLoader.load_weights`` in this process; the engine-core process inherits it
    only when it is forked (vLLM's default on CUDA: ``VLLM_WORKER_MULTIPROC_METHOD=fork`` and CUDA not yet
    initialised) or runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``). The caller checks ``report``
    after the engine started (``check_hook_report``): a spawned engine would silently load plain dummy values.
    """
    from vllm.model_executor.model_loader import dummy_loader

    original = dummy_loader.DummyModelLoader.load_weights

    def load_weights(self, model, model_config):
        original(self, model, model_config)
        report.write_text(json.dumps(set_checkpoint_values(model)))

    dummy_loader.DummyModelLoader.load_weights = load_weights


def check_hook_report(report: Path) -> dict:
    """The counts the load hook wrote; RuntimeError when it did not run or found no fp8 linear layer."""
    if not report.is_file():
        raise RuntimeError(f"{report}: the fp8 checkpoint load hook did not run in the engine process "
                           "(engine core spawned instead of forked?)")
    counts = json.loads(report.read_text())
    if not counts.get("fp8_linear"):
        raise RuntimeError(f"{report}: the load hook found no fp8 linear layer ({counts})")
    return counts
