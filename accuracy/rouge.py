"""Post-processing and ROUGE scoring exactly as mlcommons/inference
``language/llama3.1-8b/evaluation.py`` does it (paraphrased in the research notes §4.1).

1. ``strip()`` each text, split into sentences with ``nltk.sent_tokenize`` as the reference's
   pinned nltk 3.8.1 does it (:mod:`accuracy.sentences`; nltk ≥ 3.10.2 also splits after a
   sentence-final curly quote), join them with ``"\\n"`` (rougeLsum treats newlines as sentence
   boundaries). Applied to predictions and references alike.
2. Per sample, ``rouge_score.rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL",
   "rougeLsum"], use_stemmer=True).score(reference, prediction)`` F-measure (this is what HF
   ``evaluate``'s "rouge" metric computes with ``use_aggregator=False``).
3. Per type: mean over samples × 100, rounded to 4 decimals.
4. ``gen_len`` = total characters of the post-processed predictions (newlines included);
   ``gen_num`` = number of predictions.
"""

from __future__ import annotations

import logging
from typing import Sequence

from accuracy.constants import ROUGE_DECIMALS, ROUGE_KEYS

log = logging.getLogger(__name__)


def postprocess_text(texts: Sequence[str]) -> list[str]:
    """evaluation.py's ``postprocess_text`` for one list: strip, sentence-split (nltk 3.8.1's
    splitting, :func:`accuracy.sentences.split_all`), join with "\\n".

    Requires the NLTK ``punkt_tab`` data (see :func:`accuracy.punkt_data.ensure_punkt`).
    """
    from accuracy.sentences import split_all

    return ["\n".join(sents) for sents in split_all([t.strip() for t in texts])]


def rouge_per_sample(predictions: Sequence[str], references: Sequence[str]) -> dict[str, list[float]]:
    """F-measures per sample for each ROUGE type.

    Args:
        predictions, references: ``n`` post-processed strings each, paired by position.

    Returns:
        ``{type: [f_0, ..., f_{n-1}]}`` for the types in :data:`ROUGE_KEYS`, each in [0, 1].

    Raises:
        ValueError: the lists differ in length.
    """
    from rouge_score import rouge_scorer

    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions vs {len(references)} references")
    scorer = rouge_scorer.RougeScorer(list(ROUGE_KEYS), use_stemmer=True)
    out: dict[str, list[float]] = {k: [] for k in ROUGE_KEYS}
    for ref, pred in zip(references, predictions):
        scores = scorer.score(ref, pred)
        for k in ROUGE_KEYS:
            out[k].append(float(scores[k].fmeasure))
    return out


def aggregate_rouge(per_sample: dict[str, list[float]], decimals: int | None = ROUGE_DECIMALS) -> dict[str, float]:
    """Mean × 100 per type (rounded to ``decimals``; None keeps full precision).

    Raises:
        ValueError: a type has no samples.
    """
    result = {}
    for k, values in per_sample.items():
        if not values:
            raise ValueError(f"no samples to average for {k}")
        mean = 100.0 * sum(values) / len(values)
        result[k] = round(mean, decimals) if decimals is not None else mean
    return result


def score_texts(predictions: Sequence[str], references: Sequence[str]) -> tuple[dict, list[str]]:
    """Post-process and score raw decoded predictions against raw references.

    Returns:
        ``(scores, processed_predictions)`` with ``scores`` = ``{rouge1, rouge2, rougeL,
        rougeLsum: float (×100, 4 decimals), gen_len: int (characters), gen_num: int}``.
    """
    preds = postprocess_text(predictions)
    refs = postprocess_text(references)
    scores: dict = dict(aggregate_rouge(rouge_per_sample(preds, refs)))
    scores["gen_len"] = int(sum(len(p) for p in preds))
    scores["gen_num"] = int(len(preds))
    return scores, preds
