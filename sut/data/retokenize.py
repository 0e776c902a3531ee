"""Build a cnn_eval-format file from article/summary text with any HF tokenizer.

Needed when a model's tokenizer differs from the Llama 3 tokenizer that made ``tok_input``.
Prompt construction follows mlcommons/inference ``download_cnndm.py``: the plain MLPerf template
(no chat template) filled with the article, encoded with the tokenizer's defaults
(``add_special_tokens=True``, so BOS is added exactly when the tokenizer adds it, as the
reference's ``AutoTokenizer.encode`` does), no truncation.

Input: a cnn_eval JSON list (``input``/``output`` fields) or a JSONL file of CNN/DailyMail rows
(``article``/``highlights`` fields).
"""

from __future__ import annotations

import itertools
import json
import logging
from pathlib import Path
from typing import Iterator, Optional

from accuracy.jsontext import parse_json
from sut.constants import PROMPT_TEMPLATE
from sut.errors import DatasetError

log = logging.getLogger(__name__)


def _source_text(path: Path) -> str:
    """The text of the source file: a regular file of at most ``MAX_DATASET_BYTES``, UTF-8 (a BOM is dropped), read
    as the run reads a dataset (``accuracy.dataset``: a FIFO or device is refused from its ``stat``, never opened).
    Raises ``DatasetError`` naming the file."""
    from accuracy.dataset import MAX_DATASET_BYTES, DatasetFileError, read_dataset_bytes, wide_encoding

    try:
        raw = read_dataset_bytes(path, MAX_DATASET_BYTES)
    except DatasetFileError as e:
        raise DatasetError(path, e.reason) from None
    wide = wide_encoding(raw[:4])
    try:
        if wide:
            raise UnicodeError(wide)
        return raw.decode("utf-8-sig")
    except UnicodeError:
        raise DatasetError(path, f"is not UTF-8 text ({wide or 'undecodable bytes'}): convert it to UTF-8 "
                                 "first") from None


def _jsonl_rows(path: Path, text: str, split: Optional[str]) -> Iterator[tuple[str, str]]:
    """``(article, highlights)`` of each JSONL row (of ``split`` when given); ``DatasetError`` naming the line."""
    for i, line in enumerate(text.splitlines()):
        if not line.strip():
            continue
        try:
            r = parse_json(line)
        except json.JSONDecodeError as e:
            raise DatasetError(path, f"malformed JSON line: {e}", i) from None
        if not isinstance(r, dict):
            raise DatasetError(path, f"a JSONL row must be a JSON object, got {type(r).__name__}", i)
        if split is not None and r.get("split") != split:
            continue
        art = r.get("article", r.get("input"))
        if not isinstance(art, str):
            raise DatasetError(path, "missing or not a string", i, "article")
        yield art, r.get("highlights", r.get("output")) or ""


def iter_source(path: str | Path, split: Optional[str] = None) -> Iterator[tuple[str, str]]:
    """Yield ``(article, reference summary)`` from a cnn_eval JSON list or a JSONL of raw rows (with ``split``:
    only JSONL rows whose ``split`` field equals it).

    Raises ``DatasetError`` naming the file, line/record and field on a bad row, a file that is no regular UTF-8
    file, or ``split`` given for a JSON list.
    """
    path = Path(path)
    text = _source_text(path)
    if text.lstrip().startswith("["):
        if split is not None:
            raise DatasetError(path, "--split applies only to JSONL rows with a 'split' field")
        try:
            rows = parse_json(text)
        except json.JSONDecodeError as e:
            raise DatasetError(path, f"malformed JSON: {e}") from None
        for i, r in enumerate(rows):
            if not isinstance(r, dict) or not isinstance(r.get("input"), str):
                raise DatasetError(path, "missing or not a string", i, "input")
            yield r["input"], r.get("output") or ""
        return
    yield from _jsonl_rows(path, text, split)


def retokenize(source: str | Path, tokenizer: str, out: str | Path, max_samples: Optional[int] = None,
               split: Optional[str] = None) -> dict:
    """Write a cnn_eval-format file whose ``tok_input`` comes from ``tokenizer`` (a HF folder).

    Args:
        source: cnn_eval JSON or JSONL of raw rows.
        tokenizer: local HF tokenizer folder (no network).
        out: output JSON path.
        max_samples: keep the first N rows.
        split: for JSONL rows with a ``split`` field, keep only this split (e.g. ``validation``).

    Returns: ``{"samples": n, "max_prompt_tokens": m, "mean_prompt_tokens": x}``.
    """
    from transformers import AutoTokenizer

    rows = iter_source(source, split)
    first = next(rows, None)  # the source's errors before the tokenizer loads (seconds)
    try:
        tok = AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)
    except Exception as e:  # transformers raises OSError, ValueError, KeyError... for a folder it cannot load
        raise DatasetError(tokenizer, f"--tokenizer: not a loadable Hugging Face tokenizer folder "
                                      f"({str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__})"
                           ) from None
    records = []
    for article, ref in itertools.chain([] if first is None else [first], rows):
        prompt = PROMPT_TEMPLATE.format(input=article)
        ids = tok(prompt, add_special_tokens=True)["input_ids"]
        records.append({"instruction": {"llama": PROMPT_TEMPLATE}, "input": article, "tok_input": [int(t) for t in ids],
                        "output": ref})
        if max_samples is not None and len(records) >= max_samples:
            break
    if not records:
        raise DatasetError(source, "no rows selected")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(records, separators=(",", ":")))
    lens = [len(r["tok_input"]) for r in records]
    stats = {"samples": len(records), "max_prompt_tokens": max(lens), "mean_prompt_tokens": sum(lens) / len(lens)}
    log.info("wrote %s: %s", out, stats)
    return stats
