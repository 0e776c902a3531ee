"""The two files ``package`` writes from run records: ``measurements.json`` and the ``README.md``.

The README gives the exact command of every run as ``run.json`` recorded it, made portable: a
path inside this repository is written relative to the repository root (the README says to run
the commands from there), a path outside it stays absolute, and a relative path that does not
exist under the repository root (it was relative to the folder the run started in) is listed.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Optional

from sut.records import engines_used

REPO = Path(__file__).resolve().parent.parent
#: ``python -m sut run`` flags whose value is a path.
PATH_FLAGS = ("--config", "--dataset", "--output-dir", "--user-conf", "--audit-config", "--tokenizer", "--model")


def measurements(perf: dict) -> dict:
    """``measurements.json`` content derived from a run record (the five required fields + context)."""
    es = perf.get("engine_settings") or {}
    quant = es.get("quantization")
    weight_types = "fp8" if quant == "fp8" else (quant or es.get("dtype") or "bf16")
    transform = ("dynamic FP8 (e4m3) quantization of the linear layers at load time (vLLM quantization=fp8)"
                 if quant == "fp8" else ("none" if not quant else f"vLLM quantization={quant} at load time"))
    model_path = (perf.get("model") or {}).get("path") or es.get("model") or ""
    return {
        "input_data_types": "int32",
        "retraining": "No",
        "starting_weights_filename": Path(model_path).name or model_path,
        "weight_data_types": weight_types,
        "weight_transformations": transform,
        "kv_cache_data_type": es.get("kv_cache_dtype") or "auto (model dtype)",
        "harness": "mlperf-llama31-vllm harness (sut run), vLLM " + str((perf.get("versions") or {}).get("vllm")),
    }


def _in_repo(path: str, repo: Path) -> Optional[str]:
    """``path`` (absolute) relative to ``repo`` if it lies inside it, else None."""
    p = Path(os.path.normpath(path))
    for root in {repo, repo.resolve()}:
        if p.is_relative_to(root):
            return p.relative_to(root).as_posix() or "."
    return None


def portable_command(command: str, repo: Path = REPO) -> tuple[str, list[str]]:
    """``command`` with absolute paths inside ``repo`` made relative to it.

    Returns ``(command, unresolved)``: ``unresolved`` lists the relative path values of
    :data:`PATH_FLAGS` that do not exist under ``repo`` (relative to wherever the run started).
    A command that ``shlex`` cannot split is returned unchanged.
    """
    try:
        toks = shlex.split(command)
    except ValueError:
        return command, []
    out, unresolved = [], []
    for i, tok in enumerate(toks):
        flag, eq, value = tok.partition("=") if tok.startswith("--") else ("", "", tok)
        if not eq:
            flag, value = (toks[i - 1] if i else ""), tok
        if value.startswith("/"):
            rel = _in_repo(value, repo)
            value = rel if rel is not None else value
        elif flag in PATH_FLAGS and value and not value.startswith("-") and not (repo / value).exists():
            unresolved.append(value)
        out.append(f"{flag}={value}" if eq else value)
    return shlex.join(out), unresolved


def readme(system: str, perf: dict, acc: dict, t06: Optional[dict], bench: str, scenario: str) -> str:
    """The ``README.md`` of a packaged scenario folder: harness, engine and the commands of the runs."""
    unresolved: list[str] = []

    def cmd(rec):
        if not rec.get("command"):
            return "(not recorded)"
        text, missing = portable_command(rec["command"])
        unresolved.extend(m for m in missing if m not in unresolved)
        return text

    used = engines_used(perf)  # what the engines read back, over what was asked for
    es = dict(perf.get("engine_settings") or {}, **(used["engine_args"][0] if used else {}))
    versions = perf.get("versions") or {}
    lines = [
        f"# {system} — {bench} {scenario}",
        "",
        f"Harness: `python -m sut run` (SUT `{perf.get('sut')}`), vLLM {versions.get('vllm')}, "
        f"torch {versions.get('torch')}, mlcommons-loadgen {versions.get('mlcommons-loadgen')}.",
        f"Engine: dtype {es.get('dtype')}, quantization {es.get('quantization')}, KV cache {es.get('kv_cache_dtype')}, "
        f"max_num_seqs {es.get('max_num_seqs')}, max_num_batched_tokens {es.get('max_num_batched_tokens')}, "
        f"max_model_len {es.get('max_model_len')}, prefix caching off.",
        "",
        "## Commands",
        "",
        "Run them from the root of the harness repository (the folder holding `sut/`): paths inside it are "
        "written relative to it, paths outside it are absolute, as each run recorded them.",
        "",
        f"Performance (LoadGen {perf.get('validity')}, {perf.get('samples_per_s')} samples/s, "
        f"{perf.get('tokens_per_s')} tokens/s):",
        "", "```", cmd(perf), "```", "",
        "Accuracy (ROUGE + output-length gate):", "", "```", cmd(acc), "```", "",
    ]
    if t06:
        lines += ["TEST06 (audit config `loadgen_configs/TEST06/audit.config`):", "", "```", cmd(t06), "```", ""]
    if unresolved:
        lines += ["These paths were given relative to the folder a run started in and are not under the repository "
                  "root: " + ", ".join(f"`{u}`" for u in unresolved) + ".", ""]
    lines += ["Before submitting: run `tools/submission/truncate_accuracy_log.py` and the submission checker "
              "of mlcommons/inference on the whole tree.", ""]
    return "\n".join(lines)
