"""The accuracy dev gate: check a LoadGen accuracy log, score it, judge it, write the report.

Entry points: :func:`run_gate` (the stable API the ``sut`` run command calls) and
:func:`evaluate` (takes a :class:`GateSettings`; the CLI uses it).

Verdict (MLPerf submission checker, :mod:`accuracy.constants`): the gate passes iff the log
passes every check of :mod:`accuracy.loadgen_log`, each ROUGE score is ≥ 99 % of the reference,
and ``gen_len`` lies within 90–110 % of the reference. When the reference was measured on a
different number of samples than this run scored, ``gen_len`` is compared per sample:
``reference gen_len / reference gen_num × gen_num``.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from accuracy.constants import (
    ACCURACY_JSON,
    ACCURACY_TXT,
    EDGE_SAMPLES,
    GEN_LEN_MAX_FRACTION,
    GEN_LEN_MIN_FRACTION,
    HISTOGRAM_PNG,
    LLAMA31_EOS_IDS,
    MAX_NEW_TOKENS,
    REFERENCES,
    ROUGE_KEYS,
    ROUGE_MIN_FRACTION,
)
from accuracy.dataset import load_references
from accuracy.errors import AccuracyInputError
from accuracy.loadgen_log import check_log, read_accuracy_log
from accuracy.punkt_data import ensure_punkt
from accuracy.report import format_accuracy_txt, length_stats, preview, write_histogram
from accuracy.rouge import score_texts
from accuracy.tokenizer import load_tokenizer, resolve_eos_ids

log = logging.getLogger(__name__)

#: Version of the accuracy.json layout.
REPORT_VERSION = 1


@dataclass(frozen=True)
class GateSettings:
    """Everything one gate run needs.

    Attributes:
        accuracy_log: LoadGen's ``mlperf_log_accuracy.json``.
        dataset: the ``cnn_eval.json``-format dataset the run used.
        tokenizer: the model's tokenizer (see :mod:`accuracy.tokenizer` for accepted forms).
        output_dir: where ``accuracy.json``, ``accuracy.txt`` and the PNG go (created).
        reference: "auto", "datacenter", "edge" or a reference JSON file path.
        eos_ids: EOS ids; None: from ``generation_config.json`` / the tokenizer.
        max_samples: the run used only the first N dataset records.
        clean_up_spaces: force the transformers-4.x decode clean-up on/off; None: as the
            tokenizer config says (tiktoken Llama 3: on).
        write_reference: also write this run's scores as a reference JSON file there.
        max_new_tokens: output cap per sample (128).
    """

    accuracy_log: Path
    dataset: Path
    tokenizer: Path | None
    output_dir: Path
    reference: str = "auto"
    eos_ids: tuple[int, ...] | None = None
    max_samples: int | None = None
    clean_up_spaces: bool | None = None
    write_reference: Path | None = None
    max_new_tokens: int = MAX_NEW_TOKENS


@dataclass(frozen=True)
class Reference:
    """Reference scores to compare with.

    Attributes:
        name: "datacenter", "edge" or "file".
        source: where the numbers come from.
        values: rouge1/rouge2/rougeL/rougeLsum (×100) and gen_len (characters).
        gen_num: samples the reference was measured on, or None if unknown.
    """

    name: str
    source: str
    values: Mapping[str, float]
    gen_num: int | None


def _number(value: object, key: str, path: Path) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise AccuracyInputError(f"reference file {path}: '{key}' must be a finite number, got {value!r}")
    return float(value)


def load_reference_file(path: str | os.PathLike) -> Reference:
    """Read a reference JSON: ``{"rouge1", "rouge2", "rougeL", "rougeLsum", "gen_len"[, "gen_num"]}``.

    ROUGE values are ×100 (numbers or numeric strings as evaluation.py prints them),
    ``gen_len`` in characters. Other keys are ignored.

    Raises:
        AccuracyInputError: unreadable, or a key missing / not a number.
    """
    path = Path(path)
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise AccuracyInputError(
            f"reference {path} not found: pass --reference datacenter|edge|auto or an existing JSON file"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AccuracyInputError(f"reference file {path} is not readable JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise AccuracyInputError(f"reference file {path}: expected a JSON object")
    values = {}
    for key in (*ROUGE_KEYS, "gen_len"):
        if key not in raw:
            raise AccuracyInputError(f"reference file {path}: missing '{key}' (needs {', '.join(ROUGE_KEYS)}, gen_len)")
        v = raw[key]
        if isinstance(v, str):
            try:
                v = float(v)
            except ValueError:
                pass
        values[key] = _number(v, key, path)
    gen_num = raw.get("gen_num")
    if gen_num is not None:
        gen_num = int(_number(gen_num, "gen_num", path))
        if gen_num < 1:
            raise AccuracyInputError(f"reference file {path}: gen_num must be >= 1")
    return Reference("file", str(path), values, gen_num)


def resolve_reference(spec: str, n_samples: int) -> Reference:
    """Pick the reference for ``spec`` ("auto", "datacenter", "edge" or a file path).

    "auto": datacenter for 13,368 samples, edge for 5,000, otherwise datacenter (a subset run;
    ``gen_len`` then compared per sample).
    """
    spec = (spec or "auto").strip()
    if spec == "auto":
        spec = "edge" if n_samples == EDGE_SAMPLES else "datacenter"
    if spec in REFERENCES:
        ref = dict(REFERENCES[spec])
        gen_num = int(ref.pop("gen_num"))
        return Reference(spec, f"MLPerf submission checker constants.py llama3.1-8b{'-edge' if spec == 'edge' else ''}", ref, gen_num)
    return load_reference_file(spec)


def judge(scores: Mapping, ref: Reference) -> dict:
    """Compare scores with the reference; returns ``{metric: {value, reference, min[, max], ok}}``.

    ``gen_len``'s entry also has ``basis``: "total", or "per-sample" when ``ref.gen_num``
    differs from ``scores["gen_num"]`` (then ``reference`` is the scaled value).
    """
    verdict: dict = {}
    for k in ROUGE_KEYS:
        target = float(ref.values[k])
        lo = ROUGE_MIN_FRACTION * target
        verdict[k] = {"value": float(scores[k]), "reference": target, "min": round(lo, 6), "ok": bool(scores[k] >= lo)}
    gen_len, gen_num = int(scores["gen_len"]), int(scores["gen_num"])
    target = float(ref.values["gen_len"])
    basis = "total"
    if ref.gen_num is not None and ref.gen_num != gen_num:
        target = target / ref.gen_num * gen_num
        basis = "per-sample"
    lo, hi = GEN_LEN_MIN_FRACTION * target, GEN_LEN_MAX_FRACTION * target
    verdict["gen_len"] = {
        "value": gen_len,
        "reference": round(target, 3),
        "min": round(lo, 3),
        "max": round(hi, 3),
        "ok": bool(lo <= gen_len <= hi),
        "basis": basis,
    }
    return verdict


def write_reference_file(scores: Mapping, path: str | os.PathLike, note: Mapping | None = None) -> Path:
    """Write ``scores`` as a reference JSON that ``--reference FILE`` accepts.

    Keys: rouge1, rouge2, rougeL, rougeLsum, gen_len, gen_num, plus ``created`` (UTC ISO time)
    and the optional ``note`` mapping under ``source``.
    """
    path = Path(path)
    doc = {k: float(scores[k]) for k in ROUGE_KEYS}
    doc["gen_len"] = int(scores["gen_len"])
    doc["gen_num"] = int(scores["gen_num"])
    doc["created"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    if note:
        doc["source"] = dict(note)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    return path


def _plain(obj):
    """Recursively convert numpy scalars/arrays and Paths to plain JSON types."""
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    return obj


def _summary_lines(result: dict) -> list[str]:
    ref = result["reference"]
    checks = result["checks"]
    lines = [
        f"Accuracy gate: {'PASS' if result['passed'] else 'FAIL'} "
        f"(reference {ref['name']}: {ref['source']}; {checks['expected_samples']} dataset samples)"
    ]
    if result["subset"]:
        lines.append(
            f"  subset run: {checks['expected_samples']} samples, not the reference's {ref['gen_num']}; "
            "ROUGE against the full-set reference is indicative only, gen_len compared per sample"
        )
    verdict = result["verdict"]
    if verdict:
        for k in ROUGE_KEYS:
            v = verdict[k]
            lines.append(f"  {k:<10}{v['value']:>10.4f}  >= {v['min']:.4f} (99% of {v['reference']})  {'ok' if v['ok'] else 'LOW'}")
        g = verdict["gen_len"]
        lines.append(
            f"  {'gen_len':<10}{g['value']:>10d}  in [{g['min']:.1f}, {g['max']:.1f}] (characters over all samples; "
            f"{'reference scaled to this sample count' if g['basis'] == 'per-sample' else 'reference'} {g['reference']})  "
            f"{'ok' if g['ok'] else 'OUT OF RANGE'}"
        )
        lines.append(f"  {'gen_num':<10}{result['scores']['gen_num']:>10d}")
    else:
        lines.append("  not scored: the log could not be decoded")
    if checks["passed"]:
        lines.append(f"  log checks: ok ({checks['log_entries']} entries)")
    else:
        lines.append("  log checks FAILED:")
        lines += [f"    - {f}" for f in checks["failures"]]
    if checks["warnings"]["eos_not_last"]:
        lines.append(f"  warning: EOS before the last token in qsl_idx {preview(checks['warnings']['eos_not_last'])}")
    ol = result["output_lengths"]
    if ol.get("samples"):
        lines.append(
            f"  output tokens/sample: mean {ol['mean']:.1f}, p50 {ol['p50']:.1f}, p90 {ol['p90']:.1f}, max {ol['max']}; "
            f"at {ol['max_new_tokens']}-token cap {100 * ol['at_cap_share']:.1f}%, ending in EOS {100 * ol['eos_share']:.1f}%"
        )
    written = [Path(p).name for p in result["files"].values() if p]
    lines.append(f"  wrote {', '.join(written)} to {result['inputs']['output_dir']}")
    return lines


def evaluate(settings: GateSettings) -> dict:
    """Run the gate described by ``settings``; write the outputs; return the report dict.

    Returns:
        the dict also written to ``output_dir/accuracy.json``: ``passed`` (bool), ``summary``
        (str, the console summary), ``reasons`` (list of str: why it failed, empty on pass),
        ``scores`` (rouge1..rougeLsum ×100 rounded to 4 decimals, ``gen_len`` chars,
        ``gen_num``; empty if the log could not be decoded), ``checks`` (see
        :meth:`accuracy.loadgen_log.LogCheck.to_dict`), ``verdict``, ``reference``, ``subset``,
        ``output_lengths``, ``inputs``, ``files``, ``version``.

    Raises:
        AccuracyInputError: an input is missing or malformed (CLI exit code 2).
    """
    ensure_punkt()
    references = load_references(settings.dataset, settings.max_samples)
    n = len(references)
    ref = resolve_reference(settings.reference, n)
    det = load_tokenizer(settings.tokenizer, settings.clean_up_spaces)
    eos_ids, eos_source = resolve_eos_ids(settings.eos_ids, det, LLAMA31_EOS_IDS)
    entries = read_accuracy_log(settings.accuracy_log)
    log.info("accuracy log %s: %d entries; dataset %s: %d samples; EOS %s (%s)",
             settings.accuracy_log, len(entries), settings.dataset, n, list(eos_ids), eos_source)
    check = check_log(entries, n, det.vocab_size, eos_ids, settings.max_new_tokens)

    out_dir = Path(settings.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    files: dict = {"accuracy_json": str(out_dir / ACCURACY_JSON), "accuracy_txt": None, "histogram": None}

    lengths_info: dict = {"samples": 0}
    if check.dtype_error is None:
        id_arrays = [e.ids() for e in check.unique]
        eos_arr = np.asarray(eos_ids, dtype=np.int64)
        lengths = [len(a) for a in id_arrays]
        ends = [bool(len(a) and np.isin(a[-1], eos_arr)) for a in id_arrays]
        lengths_info = length_stats(lengths, ends, settings.max_new_tokens)
        if lengths:
            png = write_histogram(
                lengths, out_dir / HISTOGRAM_PNG, settings.max_new_tokens,
                title=f"{len(lengths)} samples: mean {lengths_info['mean']:.1f} tokens, "
                      f"{100 * lengths_info['at_cap_share']:.0f}% at cap, {100 * lengths_info['eos_share']:.0f}% EOS",
            )
            files["histogram"] = str(png)

    scores: dict = {}
    verdict: dict = {}
    if check.decodable and check.unique:
        log.info("detokenizing and scoring %d samples ...", len(check.unique))
        preds = det.decode_batch([e.ids() for e in check.unique])
        targets = [references[e.qsl_idx] for e in check.unique]
        scores, _ = score_texts(preds, targets)
        verdict = judge(scores, ref)
        txt = out_dir / ACCURACY_TXT
        txt.write_text(format_accuracy_txt(scores), encoding="utf-8")
        files["accuracy_txt"] = str(txt)

    passed = bool(check.passed and verdict and all(v["ok"] for v in verdict.values()))
    reasons = list(check.failures())
    if not verdict and check.passed:
        reasons.append("nothing could be scored")
    for k, v in verdict.items():
        if not v["ok"]:
            if k == "gen_len":
                reasons.append(f"gen_len {v['value']} outside [{v['min']}, {v['max']}] ({v['basis']})")
            else:
                reasons.append(f"{k} {v['value']} < {v['min']} (99% of reference {v['reference']})")
    subset = bool(ref.gen_num is not None and ref.gen_num != n)
    result = {
        "version": REPORT_VERSION,
        "passed": passed,
        "summary": "",
        "reasons": reasons,
        "scores": scores,
        "verdict": verdict,
        "checks": check.to_dict(),
        "reference": {"name": ref.name, "source": ref.source, "values": dict(ref.values), "gen_num": ref.gen_num},
        "subset": subset,
        "output_lengths": lengths_info,
        "inputs": {
            "accuracy_log": str(settings.accuracy_log),
            "dataset": str(settings.dataset),
            "dataset_samples": n,
            "max_samples": settings.max_samples,
            "tokenizer": det.description,
            "clean_up_spaces": det.clean_up_spaces,
            "eos_ids": list(eos_ids),
            "eos_ids_source": eos_source,
            "output_dir": str(out_dir),
        },
        "files": files,
    }
    if settings.write_reference is not None:
        if check.passed and scores:
            path = write_reference_file(scores, settings.write_reference, {
                "accuracy_log": str(settings.accuracy_log), "dataset": str(settings.dataset),
                "max_samples": settings.max_samples, "tokenizer": det.description})
            files["reference_written"] = str(path)
            log.info("wrote reference %s", path)
        else:
            files["reference_written"] = None
            log.error("not writing reference %s: the log failed its checks or could not be scored", settings.write_reference)
    lines = _summary_lines(result)
    result["summary"] = "\n".join(lines)
    result = _plain(result)
    Path(files["accuracy_json"]).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    (log.info if passed else log.warning)("%s", result["summary"])
    return result


def run_gate(
    accuracy_log: str,
    dataset: str,
    tokenizer: str,
    output_dir: str,
    reference: str = "auto",
    eos_ids: Sequence[int] | None = None,
    max_samples: int | None = None,
) -> dict:
    """Check, score and judge a LoadGen accuracy log; write ``accuracy.json``, ``accuracy.txt``
    and ``output_lengths.png`` into ``output_dir``.

    Args:
        accuracy_log: path of ``mlperf_log_accuracy.json`` (little-endian int32 ids in ``data``).
        dataset: path of the ``cnn_eval.json``-format dataset the run used.
        tokenizer: the model's tokenizer: HF folder / model folder with ``tokenizer.json``, a
            ``tokenizer.json`` file, or a Llama 3 tiktoken ``tokenizer.model``.
        output_dir: folder for the outputs (created if needed).
        reference: "auto" (datacenter for 13,368 samples, edge for 5,000, else datacenter
            compared per sample), "datacenter", "edge", or a reference JSON file.
        eos_ids: EOS token ids; None: ``generation_config.json`` next to the tokenizer, else
            the tokenizer's EOS, else (tiktoken Llama 3) 128001, 128008, 128009.
        max_samples: the run used only the first N dataset records; the dataset is then
            treated as those N records.

    Returns:
        the report dict written to ``accuracy.json``; at least ``passed`` (bool), ``scores``
        (dict) and ``checks`` (dict). See :func:`evaluate`.

    Raises:
        AccuracyInputError: missing/malformed input (file, tokenizer, NLTK punkt_tab data,
            empty or non-LoadGen log, bad reference file).
    """
    return evaluate(
        GateSettings(
            accuracy_log=Path(accuracy_log),
            dataset=Path(dataset),
            tokenizer=Path(tokenizer) if tokenizer else None,
            output_dir=Path(output_dir),
            reference=reference,
            eos_ids=tuple(int(e) for e in eos_ids) if eos_ids else None,
            max_samples=max_samples,
        )
    )
