"""The accuracy gate around a run: its tokenizer and inputs checked before anything starts (``gate_preflight``,
exit 2 naming file and sample), the gate run on a finished accuracy run (``accuracy_gate_record``, run.json's
``accuracy``) and the command that scores the log again (``rescore_command``)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

from sut.data.dataset import Dataset
from sut.errors import InputError

log = logging.getLogger("sut.run.harness")


def gate_tokenizer(rs, es) -> Optional[str]:
    """The tokenizer the accuracy gate will load after the run: ``--tokenizer``, else the model folder; None when
    the run has no gate (``rs.mode`` not accuracy, or ``--no-accuracy-gate``). Called before anything starts.

    Raises ``InputError`` (exit 2) when there is none, naming ``--tokenizer PATH`` (fitting the run's dataset:
    the synthetic tokenizer next to synthetic data, a Llama 3 tokenizer for CNN/DailyMail) and ``--no-accuracy-gate``.
    """
    if rs.mode != "accuracy" or not rs.accuracy_gate:
        return None
    from accuracy.errors import AccuracyInputError
    from accuracy.preflight import resolve_gate_tokenizer

    try:
        return str(resolve_gate_tokenizer(rs.tokenizer, es.model, rs.dataset))
    except AccuracyInputError as e:
        raise InputError(str(e)) from None


def gate_preflight(rs, es, dataset: Optional[Dataset] = None) -> Optional[str]:
    """``gate_tokenizer``, then what the gate will read after the run, checked now: the kept dataset records each
    have a string ``output`` (the reference), the tokenizer loads (a few seconds), given the loaded ``dataset``
    every prompt id is inside the tokenizer's vocabulary (an id past it means another tokenizer made the data,
    and the gate would decode the outputs with the wrong one), and the tokenizer decodes the first records'
    ``tok_input`` to text holding their ``input`` (``accuracy.preflight.check_tokenizer_made``: another tokenizer
    of the same size). Raises ``InputError`` (exit 2, no run folder) naming
    the file (and sample), instead of an accuracy run that ends with "accuracy gate: not run" or a FAIL."""
    tok = gate_tokenizer(rs, es)
    if tok is None:
        return None
    from accuracy.dataset import load_gate_data
    from accuracy.errors import AccuracyInputError
    from accuracy.preflight import check_tokenizer_made
    from accuracy.tokenizer import load_tokenizer

    try:
        data = load_gate_data(rs.dataset, rs.max_samples)
    except AccuracyInputError as e:
        raise InputError(f"accuracy gate: {e} (the gate's references; or run with --no-accuracy-gate)") from None
    try:
        det = load_tokenizer(tok)
    except Exception as e:  # noqa: BLE001 - any tokenizer that does not load is bad input here
        raise InputError(f"accuracy gate: the tokenizer {tok} does not load: {e} (pass --tokenizer PATH, or run "
                         "with --no-accuracy-gate)") from None
    if dataset is not None:
        _check_prompt_ids(dataset, tok, det.vocab_size)
    try:
        check_tokenizer_made(det, data.probes, rs.dataset, in_a_run=True)
    except AccuracyInputError as e:
        raise InputError(f"accuracy gate: {e}") from None
    return tok


def _check_prompt_ids(dataset: Dataset, tok: str, vocab: int) -> None:
    """``InputError`` naming the first sample whose ``tok_input`` has an id >= ``vocab`` (the gate tokenizer's)."""
    from accuracy.preflight import tokenizer_hint

    for i, prompt in enumerate(dataset.prompts):
        if prompt.size and int(prompt.max()) >= vocab:
            raise InputError(
                f"accuracy gate: {dataset.path}: record {i}, field 'tok_input': id {int(prompt.max())} is outside the "
                f"vocabulary of the tokenizer {tok} ({vocab} ids), so it did not make this dataset; "
                f"{tokenizer_hint(dataset.path)}")


def rescore_command(accuracy_log: str, dataset: str, tokenizer: str, eos_ids=(), max_samples: Optional[int] = None
                    ) -> list[str]:
    """``python -m accuracy`` scoring an accuracy run's log as its gate does: the run's dataset, gate tokenizer,
    the model's EOS ids (a tokenizer folder may know fewer) and ``--max-samples`` when the run had it."""
    cmd = ["python", "-m", "accuracy", "--accuracy-log", accuracy_log, "--dataset", dataset, "--tokenizer", tokenizer]
    cmd += ["--eos-ids", ",".join(str(e) for e in eos_ids)] if eos_ids else []
    return cmd + (["--max-samples", str(max_samples)] if max_samples else [])


def accuracy_gate_record(rs, es, model, dataset: Dataset, run_dir: Path) -> dict:
    """Run the accuracy gate on a finished accuracy run; ``run.json``'s ``accuracy``: ``{passed, scores, file,
    figure}`` (``figure``: the output-length histogram's file name in the run folder, or None),
    or ``{skipped: why}`` when the gate could not run (the tokenizer was checked before the run: ``gate_tokenizer``)."""
    try:
        import accuracy
    except ImportError as e:  # pragma: no cover - the package ships with the project
        return {"skipped": f"accuracy package unavailable: {e}"}
    try:
        tok = gate_tokenizer(rs, es)
        res = accuracy.run_gate(str(run_dir / "mlperf_log_accuracy.json"), rs.dataset, tok, str(run_dir),
                                eos_ids=list(model.eos_token_ids), max_samples=rs.max_samples,
                                eos_source=f"eos_token_id of the run's model {model.path}")
    except Exception as e:  # noqa: BLE001 - the run itself succeeded; report why the gate did not run
        log.error("accuracy gate could not run: %s", e)
        return {"skipped": str(e)}
    histogram = (res.get("files") or {}).get("histogram")
    return {"passed": res.get("passed"), "scores": res.get("scores"), "file": str(run_dir / "accuracy.json"),
            "figure": Path(histogram).name if histogram else None}
