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

from sut.constants import REPO
from sut.record.read import engines_used

#: ``python -m sut run`` flags whose value is a path.
PATH_FLAGS = ("--config", "--dataset", "--output-dir", "--user-conf", "--audit-config", "--tokenizer", "--model")


#: What ``engine_facts`` says for a setting that servers given by URL did not report.
UNKNOWN_REMOTE = "unknown: not reported by the servers given by URL (fill in)"


def engine_facts(perf: dict) -> dict:
    """The engine settings the run's engines really had: each read back from the engines (``engines_used``), else
    as asked (``engine_settings``: engines the harness started apply what was asked) -- except for servers given
    by URL (``device.kind`` remote), whose settings the harness never set: there ``UNKNOWN_REMOTE``."""
    asked = perf.get("engine_settings") or {}
    used = engines_used(perf)
    read = used["engine_args"][0] if used else {}
    remote = any((e.get("device") or {}).get("kind") == "remote" for e in perf.get("engines") or [])
    keys = ("dtype", "quantization", "kv_cache_dtype", "max_num_seqs", "max_num_batched_tokens", "max_model_len")
    return {k: read[k] if k in read else (UNKNOWN_REMOTE if remote else asked.get(k)) for k in keys}


def measurements(perf: dict) -> dict:
    """``measurements.json`` content derived from a run record (the five required fields + context); engine
    settings from ``engine_facts``."""
    es = dict(perf.get("engine_settings") or {}, **engine_facts(perf))
    quant = es.get("quantization")
    if quant == UNKNOWN_REMOTE:
        weight_types = transform = UNKNOWN_REMOTE
    else:
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


def flag_values(toks: list[str]):
    """Per token of a split command line: ``(flag, "=" or "", value)``; ``--flag=value`` gives its own flag, any
    other token is the value of the token before it (``flag`` "" for the first)."""
    for i, tok in enumerate(toks):
        flag, eq, value = tok.partition("=") if tok.startswith("--") else ("", "", tok)
        yield (flag, eq, value) if eq else ((toks[i - 1] if i else ""), "", tok)


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
    for flag, eq, value in flag_values(toks):
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

    es = engine_facts(perf)  # what the engines read back, over what was asked for
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
