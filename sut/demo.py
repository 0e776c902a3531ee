"""The embedded default ("demo"): what command 1 of the README runs after installing.

Steps, each a separate ``python -m sut`` process (LoadGen's FromConfig is once per process):
1. a deterministic synthetic dataset (128 samples, CNN/DailyMail-like prompt lengths) and its
   word-level tokenizer;
2. a short Offline performance run of the standalone SUT with the tiny Llama-3-vocabulary
   model (``sut/models/tiny-llama3``, dummy weights) — LoadGen should say VALID;
3. an accuracy-mode run over the first 64 samples, scored by the accuracy gate. With random
   weights the ROUGE gate FAILS, as it must: the demo shows the pipeline, not a model.

Every run is marked NOT compliant (subset, short duration). Results go under ``output_dir``.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

log = logging.getLogger(__name__)

TINY = Path(__file__).resolve().parent / "models" / "tiny-llama3"
CPU_CONF = Path(__file__).resolve().parent.parent / "loadgen_configs" / "cpu_tiny.user.conf"
ENGINE = ["--model", str(TINY), "--load-format", "dummy", "--dtype", "float32", "--enforce-eager", "--max-model-len", "4096"]


def _sut(*args: str) -> None:
    cmd = [sys.executable, "-m", "sut", *args]
    log.info("$ %s", " ".join(cmd))
    rc = subprocess.run(cmd).returncode
    if rc != 0:
        raise SystemExit(f"demo step failed (exit {rc}): {' '.join(cmd)}")


def run_demo(out: Path) -> int:
    """Run the three steps; return 0 when both runs completed (the gate verdict is reported, not enforced)."""
    out = out.resolve()
    data = out / "data"
    _sut("synthetic", "--out", str(data / "synthetic_128.json"), "--samples", "128", "--tokenizer-out", str(data / "tokenizer"))
    _sut("run", "--sut", "vllm", "--mode", "performance", *ENGINE, "--dataset", str(data / "synthetic_128.json"),
         "--user-conf", str(CPU_CONF), "--min-duration-s", "10", "--min-query-count", "1",
         "--output-dir", str(out), "--run-name", "performance")
    _sut("run", "--sut", "vllm", "--mode", "accuracy", *ENGINE, "--dataset", str(data / "synthetic_128.json"),
         "--max-samples", "64", "--user-conf", str(CPU_CONF), "--tokenizer", str(data / "tokenizer"),
         "--output-dir", str(out), "--run-name", "accuracy")
    perf = json.loads((out / "performance-NOT-COMPLIANT" / "run.json").read_text())
    acc = json.loads((out / "accuracy-NOT-COMPLIANT" / "run.json").read_text())
    gate = acc.get("accuracy") or {}
    lines = [
        "demo finished (tiny model with random weights, synthetic data: NOT compliant, by design)",
        f"  performance run : {perf['output_dir']}",
        f"                    LoadGen {perf.get('validity')}, {perf.get('samples_per_s')} samples/s, {perf.get('tokens_per_s')} tokens/s",
        f"  accuracy run    : {acc['output_dir']}",
        f"                    {acc['ledger']['completed']} samples answered; accuracy log: mlperf_log_accuracy.json",
        f"  accuracy gate   : {'PASS' if gate.get('passed') else 'FAIL (expected: random weights)' if 'passed' in gate else gate.get('skipped')}",
        "  next: python -m sut run --help   (real model: README 'Real input')",
    ]
    log.info("\n" + "\n".join(lines))
    return 0
