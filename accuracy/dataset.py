"""Reference summaries from an MLPerf ``cnn_eval.json``-format dataset.

File format (mlcommons/inference ``language/llama3.1-8b/download_cnndm.py``): a JSON list of
records ``{"instruction", "input", "tok_input", "output"}``; ``output`` is the reference
summary (CNN/DailyMail ``highlights``), the only field the gate reads. Record ``i`` is LoadGen's
``qsl_idx`` ``i``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from accuracy.errors import AccuracyInputError


def load_references(path: str | os.PathLike, max_samples: int | None = None) -> list[str]:
    """The ``output`` strings of the dataset, in file order.

    Args:
        path: the dataset JSON.
        max_samples: keep only the first N records (a run that used only the first N).

    Returns:
        one reference string per kept record.

    Raises:
        AccuracyInputError: missing/unreadable file, not a list of records, a record without
            a string ``output``, or ``max_samples`` < 1 or larger than the file.
    """
    path = Path(path)
    try:
        with open(path, encoding="utf-8") as f:
            records = json.load(f)
    except FileNotFoundError:
        raise AccuracyInputError(f"dataset {path} not found: pass --dataset PATH/cnn_eval.json") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AccuracyInputError(f"dataset {path} is not readable JSON: {exc}") from None
    if not isinstance(records, list) or not records:
        raise AccuracyInputError(f"dataset {path}: expected a non-empty JSON list of records (cnn_eval.json format)")
    if max_samples is not None:
        if max_samples < 1 or max_samples > len(records):
            raise AccuracyInputError(f"max_samples={max_samples} but dataset {path} has {len(records)} records")
        records = records[:max_samples]
    refs = []
    for i, rec in enumerate(records):
        out = rec.get("output") if isinstance(rec, dict) else None
        if not isinstance(out, str):
            raise AccuracyInputError(f"dataset {path}: record {i} has no string field 'output' (the reference summary)")
        refs.append(out)
    return refs
