"""The embedded default ("demo"): what command 1 of the README runs after installing.

Steps, each a separate ``python -m sut`` process (LoadGen's FromConfig is once per process), all
with the same engine, generation and dataset settings so that ``python -m sut package
--allow-noncompliant`` can lay the three runs out as a (rehearsal) submission tree:

1. a deterministic synthetic dataset (:data:`SAMPLES` samples, CNN/DailyMail-like prompt
   lengths) and its word-level tokenizer (the tokenizer that made the dataset's ids, hence the
   one the accuracy gate needs);
2. a short Offline performance run of the standalone SUT with the tiny Llama-3-vocabulary
   model (``sut/models/tiny-llama3``, dummy weights) of at least :data:`PERF_MIN_SAMPLES` samples and 10 s —
   LoadGen should say VALID on 2 cores (a much faster host finishes them in under 10 s: INVALID, min duration);
3. an accuracy-mode run over every sample, scored by the accuracy gate. With random weights
   the ROUGE gate FAILS, as it must: the demo shows the pipeline, not a model;
4. a TEST06 compliance run (``--compliance-test TEST06``) and its checks.

Every run is marked NOT compliant (subset, short duration). The data go to ``<output_dir>/data/``
(rewritten identically by every demo: same seed, same files); the runs of each demo go to their
own folder ``<output_dir>/<YYYYmmdd-HHMMSS>/`` (a second demo never collides with the first).
The demo ends by printing the ``python -m accuracy`` command that re-scores its accuracy run and
the ``python -m sut package --allow-noncompliant ...`` command that lays out its three runs.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import shlex
import subprocess
import sys
from pathlib import Path

from accuracy.preflight import SYNTHETIC_TOKENIZER_DIR
from sut.constants import REPO, TINY_MODEL

log = logging.getLogger(__name__)

TINY = TINY_MODEL
CPU_CONF = REPO / "loadgen_configs" / "cpu_tiny.user.conf"
ENGINE = ["--model", str(TINY), "--load-format", "dummy", "--dtype", "float32", "--enforce-eager", "--max-model-len", "4096"]
#: Samples in the demo's dataset; every run uses all of them (no --max-samples anywhere).
SAMPLES = 64
#: Samples the performance run issues at least (its one Offline query): cpu_tiny.user.conf's target_qps of 3 gives
#: only 33 in 10 s, which idle 2 cores finish in ~5 s (6.7 samples/s measured 2026-12-03: INVALID, min duration);
#: 128 take ~18 s there (7.1 samples/s: VALID) and ~40 s on busy cores.
PERF_MIN_SAMPLES = 128
#: The three runs: role -> run folder name (the harness appends -NOT-COMPLIANT).
RUN_NAMES = {"performance": "performance", "accuracy": "accuracy", "test06": "test06"}


def _sut(*args: str) -> None:
    cmd = [sys.executable, "-m", "sut", *args]
    log.info("$ %s", " ".join(cmd))
    rc = subprocess.run(cmd).returncode
    if rc != 0:
        raise SystemExit(f"demo step failed (exit {rc}): {' '.join(cmd)}")


def _shown(path: Path) -> str:
    """``path`` relative to the working directory when it lies under it (shorter to copy), else absolute."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path.resolve())


def package_command(out: Path, runs: dict[str, Path]) -> list[str]:
    """The ``python -m sut package --allow-noncompliant`` command that lays out the demo's runs.

    Args:
        out: the demo's folder; the tree goes to ``out/submission``.
        runs: run folders by role ("performance", "accuracy", "test06").
    """
    return ["python", "-m", "sut", "package", "--allow-noncompliant", "--out", _shown(out / "submission"),
            "--system", "1xCPU_tiny_demo", "--submitter", "demo",
            "--performance", _shown(runs["performance"]), "--accuracy", _shown(runs["accuracy"]),
            "--test06", _shown(runs["test06"])]


def run_demo(output_dir: Path, stamp: str | None = None) -> int:
    """Run the steps into ``output_dir/<stamp>/``; return 0 when every run completed.

    The accuracy gate's verdict and TEST06's checks are reported, not enforced (random weights).

    Raises:
        SystemExit: a step failed (its exit code and command in the message).
    """
    stamp = stamp or _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = (Path(output_dir) / stamp).resolve()
    data = Path(output_dir).resolve() / "data"  # deterministic: the same files for every demo
    dataset, tokenizer = data / f"synthetic_{SAMPLES}.json", data / SYNTHETIC_TOKENIZER_DIR
    _sut("synthetic", "--out", str(dataset), "--samples", str(SAMPLES), "--tokenizer-out", str(tokenizer))
    common = ["--sut", "vllm", *ENGINE, "--dataset", str(dataset), "--user-conf", str(CPU_CONF), "--output-dir", str(out)]
    _sut("run", "--mode", "performance", *common, "--min-duration-s", "10", "--min-query-count", str(PERF_MIN_SAMPLES),
         "--run-name", RUN_NAMES["performance"])
    _sut("run", "--mode", "accuracy", *common, "--tokenizer", str(tokenizer), "--run-name", RUN_NAMES["accuracy"])
    _sut("run", "--compliance-test", "TEST06", *common, "--run-name", RUN_NAMES["test06"])
    runs = {role: out / f"{name}-NOT-COMPLIANT" for role, name in RUN_NAMES.items()}
    recs = {role: json.loads((d / "run.json").read_text()) for role, d in runs.items()}
    log.info("demo summary:\n%s", "\n".join(_summary(out, data, runs, recs)))
    return 0


def _rescore_command(acc_dir: Path, data: Path, acc: dict) -> list[str]:
    """``python -m accuracy`` on the accuracy run, with the run's dataset, tokenizer and EOS ids
    (the synthetic tokenizer knows only one EOS id; the run used the model's)."""
    from sut.record.gate import rescore_command

    return rescore_command(_shown(acc_dir / "mlperf_log_accuracy.json"), _shown(data / f"synthetic_{SAMPLES}.json"),
                           _shown(data / SYNTHETIC_TOKENIZER_DIR), (acc.get("model") or {}).get("eos_token_ids") or ())


def _summary(out: Path, data: Path, runs: dict[str, Path], recs: dict[str, dict]) -> list[str]:
    perf, acc, t06 = recs["performance"], recs["accuracy"], recs["test06"]
    gate = acc.get("accuracy") or {}
    verdict = "PASS" if gate.get("passed") else "FAIL (expected: random weights)" if "passed" in gate else gate.get("skipped")
    test06 = t06.get("test06") or {}
    return [
        "demo finished (tiny model with random weights, synthetic data: NOT compliant, by design)",
        f"  performance run : {_shown(runs['performance'])}",
        f"                    LoadGen {perf.get('validity')}, {perf.get('samples_per_s')} samples/s, {perf.get('tokens_per_s')} tokens/s",
        f"  accuracy run    : {_shown(runs['accuracy'])}",
        f"                    {acc['ledger']['completed']} samples answered; accuracy gate {verdict}",
        f"  TEST06 run      : {_shown(runs['test06'])}",
        f"                    {test06.get('samples')} responses checked: {'pass' if test06.get('passed') else 'FAIL'}",
        "  (the commands below run in the project's environment: . .venv/bin/activate first)",
        "  re-score the accuracy run (with the tokenizer that made the dataset's ids, written next to it):",
        "    " + shlex.join(_rescore_command(runs["accuracy"], data, acc)),
        "  lay the three runs out as a rehearsal submission tree:",
        "    " + shlex.join(package_command(out, runs)),
        "  next: python -m sut run --help   (real inputs and models: docs/inputs.md)",
    ]
