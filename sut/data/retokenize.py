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

import json
import logging
from pathlib import Path
from typing import Iterator, Optional

from accuracy.jsontext import parse_json
from sut.constants import PROMPT_TEMPLATE
from sut.errors import DatasetError

log = logging.getLogger(__name__)


def iter_source(path: str | Path) -> Iterator[tuple[str, str]]:
    """Yield ``(article, reference summary)`` from a cnn_eval JSON list or a JSONL of raw rows.

    Raises ``DatasetError`` naming the file, line/record and field on a bad row.
    """
    path = Path(path)
    text = path.read_text()
    if text.lstrip().startswith("["):
        try:
            rows = parse_json(text)
        except json.JSONDecodeError as e:
            raise DatasetError(path, f"malformed JSON: {e}") from None
        for i, r in enumerate(rows):
            if not isinstance(r, dict) or not isinstance(r.get("input"), str):
                raise DatasetError(path, "missing or not a string", i, "input")
            yield r["input"], r.get("output") or ""
        return
    for i, line in enumerate(text.splitlines()):
        if not line.strip():
            continue
        try:
            r = parse_json(line)
        except json.JSONDecodeError as e:
            raise DatasetError(path, f"malformed JSON line: {e}", i) from None
        art = r.get("article", r.get("input"))
        if not isinstance(art, str):
            raise DatasetError(path, "missing or not a string", i, "article")
        yield art, r.get("highlights", r.get("output")) or ""


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

    tok = AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)
    records = []
    rows = iter_source(source)
    if split is not None:
        src = Path(source)
        text = src.read_text()
        if text.lstrip().startswith("["):
            raise DatasetError(src, "--split applies only to JSONL rows with a 'split' field")
        recs = (parse_json(line) for line in text.splitlines() if line.strip())
        rows = ((r.get("article"), r.get("highlights")) for r in recs if r.get("split") == split)
    for article, ref in rows:
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
