"""The accuracy dev gate: check a LoadGen accuracy log, score it, judge it, write the report.

Entry points: :func:`run_gate` (the stable API the ``sut`` run command calls) and
:func:`evaluate` (takes a :class:`GateSettings`; the CLI uses it). The reference scores and
:func:`judge` live in :mod:`accuracy.reference` (still importable from here).

Verdict (MLPerf submission checker, :mod:`accuracy.constants`): the gate passes iff the log
passes every check of :mod:`accuracy.loadgen_log`, each ROUGE score is ≥ 99 % of the reference,
and ``gen_len`` lies within 90–110 % of the reference. When the reference was measured on a
different number of samples than this run scored, ``gen_len`` is compared per sample:
``reference gen_len / reference gen_num × gen_num``.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from accuracy.constants import ACCURACY_JSON, ACCURACY_TXT, HISTOGRAM_PNG, LLAMA31_EOS_IDS, MAX_NEW_TOKENS, ROUGE_KEYS
from accuracy.dataset import load_gate_data
from accuracy.loadgen_log import LogCheck, check_log, read_accuracy_log
from accuracy.preflight import check_tokenizer_made
from accuracy.punkt_data import ensure_punkt
from accuracy.reference import (  # noqa: F401
    Reference,
    gen_len_basis,
    gen_len_reason,
    judge,
    load_reference_file,
    resolve_reference,
    write_reference_file,
)
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
        eos_source: where the given ``eos_ids`` came from, for the log and ``accuracy.json``
            (``--eos-ids``, ``.../run.json model.eos_token_ids``, ...).
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
    eos_source: str = "--eos-ids"
    max_samples: int | None = None
    clean_up_spaces: bool | None = None
    write_reference: Path | None = None
    max_new_tokens: int = MAX_NEW_TOKENS


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
            f"  {'gen_len':<10}{g['value']:>10d}, required in [{g['min']:.1f}, {g['max']:.1f}] ({gen_len_basis(g)})  "
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


def _output_lengths(check: LogCheck, eos_ids: Sequence[int], max_new_tokens: int, out_dir: Path) -> tuple[dict, str | None]:
    """``(length_stats of the unique responses, histogram PNG written or None)``; ``{"samples": 0}`` when
    the log's bytes are not int32 ids."""
    if check.dtype_error is not None:
        return {"samples": 0}, None
    id_arrays = [e.ids() for e in check.unique]
    eos_arr = np.asarray(eos_ids, dtype=np.int64)
    lengths = [len(a) for a in id_arrays]
    ends = [bool(len(a) and np.isin(a[-1], eos_arr)) for a in id_arrays]
    info = length_stats(lengths, ends, max_new_tokens)
    if not lengths:
        return info, None
    png = write_histogram(
        lengths, out_dir / HISTOGRAM_PNG, max_new_tokens,
        title=f"{len(lengths)} samples: mean {info['mean']:.1f} tokens, "
              f"{100 * info['at_cap_share']:.0f}% at cap, {100 * info['eos_share']:.0f}% EOS",
    )
    return info, str(png)


def _score(check: LogCheck, det, references: Sequence[str], ref: Reference, out_dir: Path) -> tuple[dict, dict, str | None]:
    """``(scores, verdict, accuracy.txt written or None)``; all empty when nothing can be decoded."""
    if not (check.decodable and check.unique):
        return {}, {}, None
    log.info("detokenizing and scoring %d samples ...", len(check.unique))
    preds = det.decode_batch([e.ids() for e in check.unique])
    targets = [references[e.qsl_idx] for e in check.unique]
    scores, _ = score_texts(preds, targets)
    txt = out_dir / ACCURACY_TXT
    txt.write_text(format_accuracy_txt(scores), encoding="utf-8")
    return scores, judge(scores, ref), str(txt)


def _reasons(check: LogCheck, verdict: dict) -> list[str]:
    """Why the gate failed: the log's failed checks, then each metric out of its range."""
    reasons = list(check.failures())
    if not verdict and check.passed:
        reasons.append("nothing could be scored")
    for k, v in verdict.items():
        if v["ok"]:
            continue
        if k == "gen_len":
            reasons.append(gen_len_reason(v))
        else:
            reasons.append(f"{k} {v['value']} < {v['min']} (99% of reference {v['reference']})")
    return reasons


def _write_reference(settings: GateSettings, check: LogCheck, scores: dict, tokenizer: str) -> str | None:
    """``--write-reference``: this run's scores as a reference file, only when its log passed and was scored."""
    if not (check.passed and scores):
        log.error("not writing reference %s: the log failed its checks or could not be scored", settings.write_reference)
        return None
    path = write_reference_file(scores, settings.write_reference, {
        "accuracy_log": str(settings.accuracy_log), "dataset": str(settings.dataset),
        "max_samples": settings.max_samples, "tokenizer": tokenizer})
    log.info("wrote reference %s", path)
    return str(path)


def evaluate(settings: GateSettings) -> dict:
    """Run the gate described by ``settings``; write the outputs; return the report dict.

    Returns:
        the dict also written to ``output_dir/accuracy.json``: ``passed`` (bool), ``summary``
        (str, the console summary), ``reasons`` (list of str: why it failed, empty on pass),
        ``scores`` (rouge1..rougeLsum ×100 rounded to 4 decimals, ``gen_len`` chars,
        ``gen_num``; empty if the log could not be decoded), ``checks`` (see
        :meth:`accuracy.loadgen_log.LogCheck.to_dict`), ``verdict``, ``reference``, ``subset``,
        ``output_lengths``, ``inputs`` (``accuracy_log_sha256``: the scored log's, which ``python -m sut
        package`` compares), ``files``, ``version``.

    Raises:
        AccuracyInputError: an input is missing or malformed, or the tokenizer did not make the dataset
            (CLI exit code 2; nothing written).
    """
    ensure_punkt()
    data = load_gate_data(settings.dataset, settings.max_samples)
    references = data.references
    n = len(references)
    ref = resolve_reference(settings.reference, n)
    det = load_tokenizer(settings.tokenizer, settings.clean_up_spaces)
    eos_ids, eos_source = resolve_eos_ids(settings.eos_ids, det, LLAMA31_EOS_IDS, settings.eos_source)
    entries = read_accuracy_log(settings.accuracy_log)
    check_tokenizer_made(det, data.probes, settings.dataset)
    log_sha256 = hashlib.sha256(Path(settings.accuracy_log).read_bytes()).hexdigest()  # package: the log scored
    log.info("accuracy log %s: %d entries; dataset %s: %d samples; EOS %s (%s)",
             settings.accuracy_log, len(entries), settings.dataset, n, list(eos_ids), eos_source)
    check = check_log(entries, n, det.vocab_size, eos_ids, settings.max_new_tokens)

    out_dir = Path(settings.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    lengths_info, histogram = _output_lengths(check, eos_ids, settings.max_new_tokens, out_dir)
    scores, verdict, txt = _score(check, det, references, ref, out_dir)
    files: dict = {"accuracy_json": str(out_dir / ACCURACY_JSON), "accuracy_txt": txt, "histogram": histogram}
    passed = bool(check.passed and verdict and all(v["ok"] for v in verdict.values()))
    result = {
        "version": REPORT_VERSION, "passed": passed, "summary": "", "reasons": _reasons(check, verdict),
        "scores": scores, "verdict": verdict, "checks": check.to_dict(),
        "reference": {"name": ref.name, "source": ref.source, "values": dict(ref.values), "gen_num": ref.gen_num},
        "subset": bool(ref.gen_num is not None and ref.gen_num != n),
        "output_lengths": lengths_info,
        "inputs": {
            "accuracy_log": str(settings.accuracy_log), "accuracy_log_sha256": log_sha256,
            "dataset": str(settings.dataset), "dataset_samples": n,
            "max_samples": settings.max_samples, "tokenizer": det.description, "clean_up_spaces": det.clean_up_spaces,
            "eos_ids": list(eos_ids), "eos_ids_source": eos_source, "output_dir": str(out_dir),
        },
        "files": files,
    }
    if settings.write_reference is not None:
        files["reference_written"] = _write_reference(settings, check, scores, det.description)
    result["summary"] = "\n".join(_summary_lines(result))
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
    eos_source: str = "run_gate(eos_ids=...)",
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
        eos_source: where ``eos_ids`` came from, as the log and ``accuracy.json``
            (``inputs.eos_ids_source``) name it.

    Returns:
        the report dict written to ``accuracy.json``; at least ``passed`` (bool), ``scores``
        (dict) and ``checks`` (dict). See :func:`evaluate`.

    Raises:
        AccuracyInputError: missing/malformed input (file, tokenizer, NLTK punkt_tab data,
            empty or non-LoadGen log, bad reference file), or a tokenizer that did not make the dataset
            (:func:`accuracy.preflight.check_tokenizer_made`).
    """
    return evaluate(
        GateSettings(
            accuracy_log=Path(accuracy_log),
            dataset=Path(dataset),
            tokenizer=Path(tokenizer) if tokenizer else None,
            output_dir=Path(output_dir),
            reference=reference,
            eos_ids=tuple(int(e) for e in eos_ids) if eos_ids else None,
            eos_source=eos_source,
            max_samples=max_samples,
        )
    )
