"""The MLPerf ``cnn_eval.json`` dataset and LoadGen's query sample library (QSL).

File format (mlcommons/inference ``language/llama3.1-8b/download_cnndm.py``): a JSON list of
records ``{"instruction", "input", "tok_input", "output"}``; ``tok_input`` is the Llama 3
token ids of the filled prompt template, BOS included, and is what the SUT feeds to the model
as is. The file is JSON in ``ACCEPTED_ENCODING`` (UTF-8, with or without BOM), read by the same
function as the accuracy gate reads it (``accuracy.dataset.read_dataset_json``), never a pickle,
and nothing here unpickles.

Every record is validated before LoadGen starts; the first bad record raises one
:class:`DatasetError` naming the file, the record index and the field.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from accuracy.dataset import NOT_FOUND, WHERE_DATA, DatasetFileError, read_dataset_json, sha256_file
from sut.constants import OUTPUT_RESERVE
from sut.errors import DatasetError

log = logging.getLogger(__name__)


@dataclass
class Dataset:
    """A validated cnn_eval-format dataset held in memory.

    Attributes:
        path: the file it came from.
        sha256: hex digest of the file bytes.
        prompts: one int32 array per sample (``tok_input`` as given, shape ``(prompt_len,)``).
        references: reference summaries (``output``), '' where absent.
        total_in_file: number of records in the file (before ``max_samples``).
    """

    path: str
    sha256: str
    prompts: list[np.ndarray]
    references: list[str] = field(default_factory=list)
    total_in_file: int = 0

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def prompt_lengths(self) -> np.ndarray:
        """Prompt lengths in tokens, int64 array of shape ``(len(self),)``."""
        return np.fromiter((len(p) for p in self.prompts), dtype=np.int64, count=len(self.prompts))

    def length_stats(self) -> dict:
        """Mean / p50 / p99 / min / max prompt length in tokens (plain floats and ints)."""
        lens = self.prompt_lengths
        return {
            "n": int(len(lens)),
            "mean": float(lens.mean()),
            "p50": float(np.percentile(lens, 50)),
            "p99": float(np.percentile(lens, 99)),
            "min": int(lens.min()),
            "max": int(lens.max()),
        }


def _read_records(path: Path) -> list:
    """The file's records through the gate's reader (``accuracy.dataset.read_dataset_json``): one reader
    and one set of accepted encodings (UTF-8, with or without BOM) for the run and the gate."""
    try:
        return read_dataset_json(path)
    except DatasetFileError as e:
        raise DatasetError(path, e.reason + (f" ({WHERE_DATA})" if e.reason == NOT_FOUND else "")) from None


def validate_record(path: str | os.PathLike, index: int, rec: object, vocab_size: int, max_prompt_len: int) -> np.ndarray:
    """Check one record and return its prompt as an int32 array.

    Raises:
        DatasetError: missing/empty ``tok_input``, a non-integer id, an id outside
            ``[0, vocab_size)``, or a prompt longer than ``max_prompt_len`` tokens.
    """
    if not isinstance(rec, dict):
        raise DatasetError(path, f"record must be a JSON object, got {type(rec).__name__}", index)
    tok = rec.get("tok_input")
    if tok is None:
        raise DatasetError(path, "missing", index, "tok_input")
    if not isinstance(tok, list) or not tok:
        raise DatasetError(path, "must be a non-empty list of token ids", index, "tok_input")
    for pos, t in enumerate(tok):
        if type(t) is not int:  # bool and float are rejected on purpose
            raise DatasetError(path, f"id at position {pos} is {t!r}, not an integer", index, "tok_input")
    try:
        arr = np.asarray(tok, dtype=np.int64)
    except OverflowError:
        raise DatasetError(path, "an id does not fit in 64 bits (outside the model vocabulary)", index, "tok_input") from None
    bad = np.flatnonzero((arr < 0) | (arr >= vocab_size))
    if bad.size:
        p = int(bad[0])
        raise DatasetError(path, f"id {int(arr[p])} at position {p} is outside the model vocabulary [0, {vocab_size})", index, "tok_input")
    if len(arr) > max_prompt_len:
        raise DatasetError(
            path,
            f"prompt has {len(arr)} tokens, more than {max_prompt_len} (max_model_len less the answer's "
            "[generation] max_tokens); raise --max-model-len (prompts are never truncated)",
            index,
            "tok_input",
        )
    out = rec.get("output", "")
    if out is not None and not isinstance(out, str):
        raise DatasetError(path, f"must be a string, got {type(out).__name__}", index, "output")
    return arr.astype(np.int32)


def load_dataset(path: str | os.PathLike, vocab_size: int, max_model_len: int, max_samples: int | None = None,
                 reserve: int = OUTPUT_RESERVE) -> Dataset:
    """Load and validate a cnn_eval-format file.

    Args:
        path: the JSON file.
        vocab_size: the model's vocabulary size (``config.json`` ``vocab_size``); ids must be below it.
        max_model_len: the engine's context length; prompts may use at most ``max_model_len - reserve``.
        max_samples: keep only the first N records (a subset run; never compliant).
        reserve: room kept for the answer, the run's ``max_tokens`` (default 128, MLPerf's).

    Raises:
        DatasetError: on the first bad file or record.
    """
    path = Path(path)
    records = _read_records(path)
    total = len(records)
    if max_samples is not None:
        if max_samples <= 0:
            raise DatasetError(path, f"max_samples must be positive, got {max_samples}")
        if max_samples > total:
            raise DatasetError(path, f"--max-samples {max_samples} is more than the {total} records in the file")
        records = records[:max_samples]
    max_prompt_len = max_model_len - reserve
    if max_prompt_len <= 0:
        raise DatasetError(path, f"max_model_len {max_model_len} leaves no room for a prompt and {reserve} new tokens "
                                 "([generation] max_tokens)")
    prompts, refs = [], []
    for i, rec in enumerate(records):
        prompts.append(validate_record(path, i, rec, vocab_size, max_prompt_len))
        refs.append(rec.get("output") or "")
    ds = Dataset(str(path), sha256_file(path), prompts, refs, total)
    log.info("dataset %s: %d samples (of %d in file), prompt tokens %s", path, len(ds), total, ds.length_stats())
    return ds


class QuerySampleLibrary:
    """LoadGen QSL over a :class:`Dataset` (all samples stay in RAM; load/unload only record).

    Args:
        dataset: the validated dataset; total sample count = ``len(dataset)``.
        performance_sample_count: from LoadGen settings (MLPerf mlperf.conf: 13,368 for
            ``llama3_1-8b``); capped at the dataset size, which makes a run non-compliant.
    """

    def __init__(self, dataset: Dataset, performance_sample_count: int):
        import mlperf_loadgen as lg

        self.dataset = dataset
        self.total_sample_count = len(dataset)
        self.performance_sample_count = min(performance_sample_count, len(dataset))
        self.loaded: set[int] = set()
        self.handle = lg.ConstructQSL(self.total_sample_count, self.performance_sample_count, self._load, self._unload)

    def _load(self, indices: Sequence[int]) -> None:
        self.loaded.update(indices)

    def _unload(self, indices: Sequence[int]) -> None:
        self.loaded.difference_update(indices)

    def destroy(self) -> None:
        import mlperf_loadgen as lg

        lg.DestroyQSL(self.handle)
